"""Fused attention (attention.c): rotary, KV-cache write and attention over the prefix plus T new
tokens (a decode or verify pass; a causal prompt pass of any length, MAX_ROWS rows per call), for one
sequence in a static fp32 `KVCache` (FusedAttention) or for the serving
engine's batch of ragged rows in the paged pool (PagedAttention); None where it does not apply.

The caller falls back to the torch path (rotary, `cache.write`, SDPA) on None, so other caches
(paged, batched), dtypes and devices keep working unchanged.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch

from specdec.cache.kv_cache import KVCache
from specdec.cache.paged_cache import BatchKV
from specdec.kernels import MAX_ROWS, load_kernels
from specdec.spec.tree import root_path_columns

PAGED_ROWS = 128  # rows (B x T, padding included) per paged kernel call: a wider pass goes in column groups
KEY_SPLIT = 128  # attention_split.h's: the kernel keeps a partial softmax per query and split of this many keys
# the partials a call keeps (a buffer of the calling thread, grown to its largest call and kept): past this
# the pass runs the torch path (an 8B-shaped model's 128-row pass over 32k keys would keep ~545 MB)
MAX_PARTIALS_BYTES = 256 << 20


def partials_fit(rows: int, n_heads: int, head_dim: int, n_keys: int) -> bool:
    """Whether the kernel's partials for `rows` new tokens over n_keys keys stay within MAX_PARTIALS_BYTES."""
    splits = -(-n_keys // KEY_SPLIT)
    return splits == 1 or rows * n_heads * splits * (head_dim + 2) * 4 <= MAX_PARTIALS_BYTES


@functools.cache
def _load():
    """The kernel library with this module's functions declared, or None."""
    lib, _ = load_kernels()
    if lib is not None:
        tail = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]  # tail_start, tail_path, tail_width
        tail += [ctypes.c_int64]  # kv_bf16: the cache holds bfloat16
        lib.specdec_attention_f32.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float] + tail
        lib.specdec_attention_f32.restype = ctypes.c_int
        lib.specdec_paged_attention_f32.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 6 + [ctypes.c_float] + tail
        lib.specdec_paged_attention_f32.restype = ctypes.c_int
    return lib


def tree_tails(block_mask: torch.Tensor, past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A tree pass's new rows (block_mask [T, T], spec/tree.py's tree_mask) after `past` cached keys as the
    kernels read them (mask [T, T] uint8: columns 0..depth of the root path; tail_start [T]; tail_path
    [T, T]: each row's root path in the columns of its positions), or None for a chain (causal already)."""
    paths = root_path_columns(block_mask)
    if paths is None:
        return None
    vis, path = paths
    return (vis.to(torch.uint8).contiguous(), torch.full((len(path),), past, dtype=torch.int64),
            (past + path).contiguous())


def tail_args(tail_start: torch.Tensor | None, tail_path: torch.Tensor | None) -> tuple:
    """A tree pass's root paths as the kernels take them (tail_start, tail_path, tail_width), or none."""
    if tail_path is None:
        return None, None, 0
    return tail_start.data_ptr(), tail_path.data_ptr(), tail_path.shape[-1]


KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches the kernels read (bfloat16: widened exactly on load)


def _kernel_applies(rotary, positions: torch.Tensor, x: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    """What both attention kernels need: fp32 on the CPU, an fp32 or bf16 cache, positions inside the rotary
    tables, the library."""
    return (x.dtype is torch.float32 and x.device.type == "cpu" and kv_dtype in KV_DTYPES
            and rotary.cos.dtype is torch.float32 and _load() is not None
            and int(positions.max()) < rotary.cos.shape[0])


class FusedAttention:
    """What the fused kernel needs for one forward pass; built once, used by every layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, block_mask, cache: KVCache,
                 n_heads: int):
        self.cos, self.sin = cos, sin  # [max_pos, D] fp32 tables
        self.n_heads = n_heads  # the model's query heads (the partials a wider call keeps)
        self.positions = positions[0].to(torch.int64).contiguous()  # [T]
        self.mask = None if block_mask is None else block_mask.to(torch.uint8).contiguous()  # [T, T]
        self.cache = cache
        self.kv_bf16 = int(cache.k.dtype is torch.bfloat16)
        self.past = cache.length
        # a tree: each row reads its root path in the columns of its positions (attention.c's tail_path)
        self.tail_start = self.tail_path = None
        tails = None if block_mask is None else tree_tails(block_mask, self.past)
        if tails is not None:
            self.mask, self.tail_start, self.tail_path = tails
        self.layer_shapes = {}  # layer.c's descriptions of this pass (specdec.kernels.layer), made once

    @classmethod
    def build(cls, rotary, positions: torch.Tensor, block_mask, cache, x: torch.Tensor,
              n_heads: int) -> "FusedAttention | None":
        B, T = positions.shape
        D = rotary.cos.shape[1]
        if block_mask is not None and tuple(block_mask.shape) != (T, T):
            raise ValueError(f"block_mask must be [{T}, {T}] for {T} new tokens, got {list(block_mask.shape)}")
        if (type(cache) is not KVCache or B != 1 or cache.length + T > cache.max_len
                or (T > MAX_ROWS and block_mask is not None)
                or not _kernel_applies(rotary, positions, x, cache.k.dtype)
                or not partials_fit(min(T, MAX_ROWS), n_heads, D, cache.length + T)):
            return None
        return cls(rotary.cos, rotary.sin, positions, block_mask, cache, n_heads)

    def __call__(self, qkv: torch.Tensor, layer: int, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
        """qkv [1, T, (Hq + 2 Hkv) D] -> attention output [1, T, Hq D]; writes this layer's k/v.
        A causal pass of more than MAX_ROWS tokens (a long prompt) goes MAX_ROWS rows per call, as a chunked
        prefill would: a row's result depends on its own keys alone, so the prompt's keys, values and
        outputs are bitwise the same however its passes were cut (a reused prefix equals a cold one)."""
        T = qkv.shape[1]
        qkv = qkv.contiguous()
        out = torch.empty(1, T, n_heads * head_dim, dtype=torch.float32)
        k, v = self.cache.k[layer, 0], self.cache.v[layer, 0]  # [Hkv, max_len, D], contiguous
        width, lib = qkv.shape[-1], _load()
        tail = tail_args(self.tail_start, self.tail_path)
        for start in range(0, T, MAX_ROWS):  # (a masked pass, so a tree, is at most MAX_ROWS rows: one call)
            rows = min(MAX_ROWS, T - start)
            rc = lib.specdec_attention_f32(
                qkv.data_ptr() + 4 * start * width, self.cos.data_ptr(), self.sin.data_ptr(),
                self.positions.data_ptr() + 8 * start, k.data_ptr(), v.data_ptr(),
                None if self.mask is None else self.mask.data_ptr(), out.data_ptr() + 4 * start * out.shape[-1],
                rows, n_heads, n_kv, head_dim, self.past + start, self.cache.max_len, 1.0 / math.sqrt(head_dim),
                *tail, self.kv_bf16)
            if rc != 0:
                raise MemoryError("attention kernel: out of memory for its score buffer")
        return out


class PagedAttention:
    """The engine's batched pass (BatchKV: B left-padded rows over the paged pool), one C call per layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache: BatchKV, n_heads: int):
        B, T = positions.shape
        self.cos, self.sin, self.n_heads = cos, sin, n_heads
        self.positions = positions.to(torch.int64).contiguous()  # [B, T]
        self.cache = cache
        self.kv_bf16 = int(cache.pool.k.dtype is torch.bfloat16)
        new_slot = torch.full((B, T), -1, dtype=torch.int64)
        new_slot[cache.rows, cache.cols] = cache.new_slots
        self.new_slot = new_slot  # [B, T], -1 on padding
        self.gather = cache.gather.contiguous()  # [B, L]
        # [B, T, L]; with trees, their rows' root paths by depth, read through tail_path (as FusedAttention)
        self.mask = (cache.mask[:, 0] if cache.tails is None else cache.tails[0]).to(torch.uint8).contiguous()
        self.tail_start, self.tail_path = (None, None) if cache.tails is None else cache.tails[1:]
        # the real tokens' places b * T + t in the grid, ascending; None without padding (layer.c can then
        # run the linears on these rows alone: specdec.kernels.layer)
        real = cache.rows * T + cache.cols  # [N]
        self.real_index = real.to(torch.int64).contiguous() if real.numel() < B * T else None
        self.layer_shapes = {}  # layer.c's descriptions of this pass (specdec.kernels.layer), made once

    @classmethod
    def build(cls, rotary, positions: torch.Tensor, cache, x: torch.Tensor, n_heads: int) -> "PagedAttention | None":
        B, T = positions.shape
        D = rotary.cos.shape[1]
        if (type(cache) is not BatchKV or B > PAGED_ROWS
                or not _kernel_applies(rotary, positions, x, cache.pool.k.dtype)
                or not partials_fit(min(B * T, PAGED_ROWS), n_heads, D, cache.gather.shape[1])):
            return None
        return cls(rotary.cos, rotary.sin, positions, cache, n_heads)

    def __call__(self, qkv: torch.Tensor, layer: int, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
        """qkv [B, T, (Hq + 2 Hkv) D] -> attention output [B, T, Hq D]; writes this layer's new k/v.
        A pass over more than PAGED_ROWS rows (a long prompt chunk) goes in groups of columns, as a finer
        chunking would: a row's result depends on its own keys alone, so a prompt's keys and values do not
        depend on how the engine chunked it."""
        B, T, _ = qkv.shape
        cols = max(1, PAGED_ROWS // B)
        if T <= cols:
            return self._attend(qkv.contiguous(), self.positions, self.new_slot, self.mask, self.tail_start,
                                self.tail_path, layer, n_heads, n_kv, head_dim)
        out = torch.empty(B, T, n_heads * head_dim, dtype=torch.float32)
        for t0 in range(0, T, cols):  # earlier columns' keys are in the pool when later ones attend
            t1 = min(T, t0 + cols)
            tails = (None, None) if self.tail_path is None else (self.tail_start[:, t0:t1].contiguous(),
                                                                 self.tail_path[:, t0:t1].contiguous())
            out[:, t0:t1] = self._attend(qkv[:, t0:t1].contiguous(), self.positions[:, t0:t1].contiguous(),
                                         self.new_slot[:, t0:t1].contiguous(), self.mask[:, t0:t1].contiguous(),
                                         *tails, layer, n_heads, n_kv, head_dim)
        return out

    def _attend(self, qkv, positions, new_slot, mask, tail_start, tail_path, layer, n_heads, n_kv,
                head_dim) -> torch.Tensor:
        """One kernel call over qkv [B, t, .] with its columns' positions, new slots, mask rows and tails."""
        B, T, _ = qkv.shape
        out = torch.empty(B, T, n_heads * head_dim, dtype=torch.float32)
        k, v = self.cache.pool.k[layer], self.cache.pool.v[layer]  # [num_slots, Hkv, D]
        L = self.gather.shape[1]
        rc = _load().specdec_paged_attention_f32(
            qkv.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), positions.data_ptr(), k.data_ptr(),
            v.data_ptr(), new_slot.data_ptr(), self.gather.data_ptr(), mask.data_ptr(), out.data_ptr(),
            B, T, L, n_heads, n_kv, head_dim, 1.0 / math.sqrt(head_dim),
            *tail_args(tail_start, tail_path), self.kv_bf16)
        if rc != 0:
            raise MemoryError("paged attention kernel: out of memory for its score buffer")
        return out


def fused_attention(rotary, positions: torch.Tensor, block_mask, cache, x: torch.Tensor, n_heads: int):
    """The C attention for this pass (static or paged cache) of a model with n_heads query heads, or None:
    the caller's torch path."""
    if type(cache) is BatchKV:
        return PagedAttention.build(rotary, positions, cache, x, n_heads)
    return FusedAttention.build(rotary, positions, block_mask, cache, x, n_heads)
