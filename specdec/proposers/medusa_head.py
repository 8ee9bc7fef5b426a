"""Medusa heads: K residual blocks on the target's last hidden state, head i proposing token t+i+2 through
the (restricted) target LM head. Keys: blocks.<i>.layers.0.{weight,bias}; token_map (vLLM's reduced
vocabulary). Saved and loaded with the other heads (proposers/head_io.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.kernels import linear
from specdec.proposers.heads import HeadConfig, draft_rows


class MedusaHead(torch.nn.Module):
    """K residual blocks on the last hidden state; logits through the (restricted) target LM head."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.blocks = torch.nn.ModuleList(_ResBlock(H) for _ in range(cfg.medusa_num_heads))
        Vd = cfg.draft_vocab_size or cfg.vocab_size
        self.register_buffer("token_map", torch.arange(Vd, dtype=torch.long))  # draft id -> target id

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.token_map

    @property
    def vocab_version(self) -> int:
        return self.token_map._version

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        self.token_map.copy_(draft_ids)

    def forward(self, h: torch.Tensor, target_lm_head: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """h [N, H] -> logits [K, N, Vd] of the first num_heads heads (all by default)."""
        w = draft_rows(self, target_lm_head)
        return torch.stack([linear(blk(h), w) for blk in self.blocks[:num_heads]])


class _ResBlock(torch.nn.Module):
    def __init__(self, H: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(H, H, bias=True)])
        torch.nn.init.zeros_(self.layers[0].weight)  # Medusa: start as the identity (head = next-token head)
        torch.nn.init.zeros_(self.layers[0].bias)

    def forward(self, x):
        for lin in self.layers:
            x = x + F.silu(linear(x, lin.weight, lin.bias))
        return x
