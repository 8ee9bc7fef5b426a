"""Attention one query row at a time, for the models whose attention runs in torch on a CPU (q/k-norm
Llamas such as Qwen3, Gemma 3).

torch's SDPA is not row-invariant: a query's result moves in its last bits with the other queries of the
call and with the mask (1e-5 in a Gemma 3 270M fp32 verify pass, 0.11 in bf16, where rounding matmul
inputs to bf16 amplifies it). A verify pass over k + 1 tokens then does not give the logits of k + 1
single-token passes, and greedy speculation left plain decoding at near ties: 4 of 16 prompts in bf16.
The C attention kernel (specdec/kernels/attention.c) is row-invariant, but it does not cover q/k norms,
per-layer scales or sliding windows.

RowAttention gives each row of a decode or verify pass exactly the call a single-token pass at its
position makes: SDPA over the keys at positions 0..p (a tree node's root path, gathered in position
order), with no mask (or, in a sliding layer past the window, the window's), the same scale.
It costs one SDPA call per row and layer, so it runs only where rows are few (MAX_ROWS): a prompt's
pass, and a wider pass, keep one call.

    plan = RowAttention.build(mask, positions, cache)   # once per forward; None: not needed
    out = plan.attend(q, k_all, v_all, scale=..., window=W)   # [B, Hq, T, D]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kernels import MAX_ROWS
from specdec.model.layers import sdpa


@dataclass
class _Row:
    b: int
    t: int
    keys: slice | torch.Tensor  # the row's key columns: the first n, or a tree's root path (ascending)
    position: int


class RowAttention:
    def __init__(self, rows: list[_Row], key_positions):
        self.rows = rows
        self._key_positions = key_positions  # () -> [B, L] sequence positions of the keys, or None
        self._windows: dict[int, list[torch.Tensor | None]] = {}

    @classmethod
    def build(cls, mask: torch.Tensor | None, positions: torch.Tensor, cache,
              prefill: bool) -> "RowAttention | None":
        """The plan for a pass with positions [B, T] under `mask` (cache.attention_mask: [T, L], or
        [B, 1, T, L] for the paged cache; None when T == 1), or None where one call is what a single-token
        pass makes anyway (B = T = 1), where it cannot apply (a prompt's pass, a GPU, gradients, more than
        MAX_ROWS rows)."""
        B, T = positions.shape
        if (prefill or B * T == 1 or B * T > MAX_ROWS or mask is None or positions.device.type != "cpu"
                or torch.is_grad_enabled()):
            return None
        visible = mask.reshape(B if mask.dim() == 4 else 1, T, mask.shape[-1]).expand(B, T, -1)  # [B, T, L]
        pos = positions.tolist()
        rows = []
        for b in range(B):
            for t in range(T):
                cols = visible[b, t].nonzero().flatten()
                n = len(cols)
                rows.append(_Row(b, t, slice(0, n) if n and int(cols[-1]) == n - 1 else cols, pos[b][t]))
        key_positions = getattr(cache, "key_positions", None)  # only a sliding window needs them
        return cls(rows, None if key_positions is None else lambda: key_positions(positions))

    def _window_masks(self, window: int) -> list[torch.Tensor | None]:
        """Per row, what a single-token pass adds in a sliding layer: None while its position is below
        the window, else [1, 1, 1, n] keys at positions > p - window."""
        if window not in self._windows:
            kp = None
            if any(r.position >= window for r in self.rows):
                if self._key_positions is None:
                    raise ValueError("this cache does not give key positions, which sliding-window attention "
                                     f"needs past {window} tokens")
                kp = self._key_positions()  # [B, L]
            self._windows[window] = [None if r.position < window else
                                     (kp[r.b, r.keys] > r.position - window)[None, None, None, :] for r in self.rows]
        return self._windows[window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               window: int | None = None) -> torch.Tensor:
        """q [B, Hq, T, D]; k, v [B, Hkv, L, D] (the cache's visible keys) -> [B, Hq, T, D]."""
        out = torch.empty_like(q)
        masks = self._window_masks(window) if window is not None else [None] * len(self.rows)
        for r, m in zip(self.rows, masks):
            kr, vr = k[r.b:r.b + 1, :, r.keys], v[r.b:r.b + 1, :, r.keys]
            out[r.b:r.b + 1, :, r.t:r.t + 1] = sdpa(q[r.b:r.b + 1, :, r.t:r.t + 1], kr, vr, m, scale=scale,
                                                      enable_gqa=True)
        return out
