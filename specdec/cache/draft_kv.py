"""The KV cache of a draft head (EAGLE's one layer) for one request: a static buffer, appended to."""
from __future__ import annotations

import torch


class DraftKV:
    """The drafter's own KV cache for one request: [1, Hkv, max_len, D]; `length` committed + speculative."""

    def __init__(self, cfg, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.k = torch.zeros(1, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"draft KV cache overflow: {end} > {self.k.shape[2]}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]
