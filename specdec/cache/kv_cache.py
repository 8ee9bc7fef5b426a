"""A static, preallocated KV cache for one model and a batch of sequences.

Layout per layer: k, v of shape [B, n_kv_heads, max_len, head_dim]. `length` is the number of
valid positions (shared by the batch: single-request decoding and lock-step batches). Writing
never reallocates; speculation undoes rejected tokens with `rollback(n)` and keeps an accepted
tree path with `keep(slots)`, which gathers those slots into contiguous positions.
"""
from __future__ import annotations

import torch

from specdec.config import KV_CACHE_DTYPES, ConfigError


def kv_cache_dtype_named(name: str) -> torch.dtype | None:
    """--kv-cache-dtype's value as a model's `kv_cache_dtype` (None: "auto", the model's dtype), or a ConfigError."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return None if name == "auto" else getattr(torch, name)


def kv_dtype(model) -> torch.dtype:
    """The dtype a model's caches store keys and values in: its `kv_cache_dtype` (LLM(kv_cache_dtype=...)),
    else its own dtype. A bfloat16 cache of an fp32-activation model rounds each key and value once, when
    written, and every pass reads the same rounded values back (widened exactly), so plain and speculative
    decoding still compute the same."""
    return getattr(model, "kv_cache_dtype", None) or model.dtype


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, config, max_len: int, dtype: torch.dtype, batch_size: int = 1, device="cpu") -> "KVCache":
        return cls(config.num_hidden_layers, batch_size, config.num_key_value_heads,
                   config.head_dim, max_len, dtype, device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, n_kv, T, D] at [length, length+T) and return the valid prefix views.

        The caller (the model) advances `length` once per forward, after the last layer.
        """
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.max_len} positions")
        self.k[layer, :, :, start:end] = k  # (rounded to the cache's dtype; read back widened to k's)
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end].to(k.dtype), self.v[layer, :, :, :end].to(v.dtype)

    def attention_mask(self, block_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
        """Mask [T, length + T] for T new tokens: the whole prefix, plus block_mask (causal if None)."""
        from specdec.model.layers import build_attention_mask
        return build_attention_mask(self.length, block_mask, num_new, self.k.device)

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Sequence position of each key the next write returns, [B, length + T] for positions [B, T]:
        slot i < length holds position i (chains and kept tree paths are packed), then the new tokens."""
        past = torch.arange(self.length, device=positions.device).expand(positions.shape[0], -1)
        return torch.cat((past, positions), dim=1)

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every position at or after `length` (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.length})")
        self.length = length

    def keep(self, slots: list[int] | torch.Tensor, start: int) -> None:
        """Keep only `slots` (absolute, ascending, all >= start) after `start`, packed from `start` on.

        E.g. a tree verified at slots [10..17] whose accepted path is nodes 0, 2, 5 calls
        keep([10, 12, 15], start=10): positions 10, 11, 12 then hold those entries, length = 13.
        """
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        n = len(slots)
        if n and (min(slots) < start or max(slots) >= self.length):
            raise ValueError("keep(): slot outside the written range")
        if slots != list(range(start, start + n)):  # already packed (a chain-shaped path): nothing moves
            idx = torch.tensor(slots, dtype=torch.long).to(self.k.device)
            self.k[:, :, :, start:start + n] = self.k[:, :, :, idx]
            self.v[:, :, :, start:start + n] = self.v[:, :, :, idx]
        self.length = start + n

    def reset(self) -> None:
        self.length = 0
