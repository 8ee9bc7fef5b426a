"""An EAGLE head's passes in C (layer.c's head layer, head_chain.c, head_tree.c), described from torch: its
layer over the rows of several sequences each in its own static cache (head_layer), the digest of accepted
rows (head_digest), greedy chains of several rows (head_chains) and an EAGLE-2 tree (head_tree). Each returns
None where it does not apply, and the caller runs its torch path; the ctypes structures are layer.py's.
"""
from __future__ import annotations

import ctypes
import math
from typing import Sequence

import torch

from specdec.kernels import MAX_ROWS
from specdec.kernels.attention import tail_args, tree_tails
from specdec.kernels.layer import (_ChainHead, _LayerShape, _LayerWeights, _Linear, _SeqCache, _cpu_f32, _describe,
                                   _load)


def describe_head_layer(post_norm: torch.Tensor, qkv, o_proj, gate_up, down) -> _LayerWeights | None:
    """A draft head's layer for head_layer, from its post-attention norm weight and its four (stacked)
    projections; None if layer.c cannot run one of them."""
    lins = [_describe(qkv, None), _describe(o_proj, None), _describe(gate_up, None), _describe(down, None)]
    if not _cpu_f32(post_norm) or any(lin is None for lin in lins):
        return None
    return _LayerWeights(None, post_norm.data_ptr(), *lins, None, None)


def _seq_caches(caches: Sequence, counts: Sequence[int]):
    """The DraftKV caches as layer.c's SeqCache array (each `count` new rows after its `length`), or None
    where one is not an fp32 cache with room for them."""
    seqs = (_SeqCache * len(caches))()
    for seq, cache, n in zip(seqs, caches, counts):
        if not (_cpu_f32(cache.k) and _cpu_f32(cache.v)) or cache.length + n > cache.k.shape[2]:
            return None
        seq.k_cache, seq.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
        seq.past, seq.count, seq.max_len = cache.length, n, cache.k.shape[2]
    return seqs


def _head_shape(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None, N: int, H: int, n_heads: int,
                caches: Sequence, eps: float, seqs, mask: torch.Tensor | None = None,
                tail_start: torch.Tensor | None = None, tail_path: torch.Tensor | None = None) -> _LayerShape:
    """A draft head's pass over N rows of len(caches) sequences, each in its own cache (seqs), as layer.c
    takes it; pos [N] (None: the C call sets them per depth), mask and tails: a tree block's."""
    _, n_kv, _, D = caches[0].k.shape
    return _LayerShape(cos.data_ptr(), sin.data_ptr(), None if pos is None else pos.data_ptr(),
                       None if mask is None else mask.data_ptr(), N, H, n_heads, n_kv, D, 0, 0, eps,
                       1.0 / math.sqrt(D), 0, 0, None, None, 0, None, *tail_args(tail_start, tail_path),
                       len(caches), seqs)


def head_layer(desc: _LayerWeights, x: torch.Tensor, attn_in: torch.Tensor, caches: Sequence, sizes: Sequence[int],
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
               eps: float, tree: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [1, N, H] after a draft head's layer (specdec_head_layer_f32) in one C call, attn_in [1, N, K] being
    its projections' input: the rows of len(caches) sequences back to back (sizes[i] of caches[i], a DraftKV
    whose `length` keys stay and whose static k, v [1, Hkv, max_len, D] take the new ones after them),
    causal among a sequence's rows, positions [1, N] indexing the rotary tables cos, sin [max_pos, D]. The
    caches' lengths are the caller's to advance. tree: [N, N] bool (one cache), the rows are a token tree
    (spec/tree.py's tree_mask: each row sees the cache and its ancestors), read by root path as a verify
    pass's. None where layer.c does not apply (a position past the tables' end included)."""
    _, N, H = x.shape
    if (not caches or x.shape[0] != 1 or N > MAX_ROWS or torch.is_grad_enabled() or _load() is None
            or x.dtype is not torch.float32 or attn_in.dtype is not torch.float32 or x.device.type != "cpu"
            or not (_cpu_f32(cos) and _cpu_f32(sin)) or int(positions.max()) >= cos.shape[0]
            or (tree is not None and len(caches) != 1)):
        return None
    if len(sizes) != len(caches) or sum(sizes) != N:
        raise ValueError(f"head_layer: {len(caches)} caches and sizes {list(sizes)} for {N} rows")
    seqs = _seq_caches(caches, sizes)
    if seqs is None:
        return None
    pos = positions.reshape(N).to(torch.int64).contiguous()
    tails = None if tree is None else tree_tails(tree, caches[0].length)  # (held until the call returns)
    mask, tail_start, tail_path = (None, None, None) if tails is None else tails
    shape = _head_shape(cos, sin, pos, N, H, n_heads, caches, eps, seqs, mask, tail_start, tail_path)
    out = x.contiguous().clone()
    attn_in = attn_in.contiguous()
    if _load().specdec_head_layer_f32(out.data_ptr(), attn_in.data_ptr(), ctypes.byref(desc), ctypes.byref(shape)) != 0:
        raise MemoryError("head layer kernel: out of memory for its buffers")
    return out


def describe_head_chain(norm: torch.Tensor, lm_head, draft_ids: torch.Tensor, embed: torch.Tensor,
                        input_norm: torch.Tensor, hidden_norm: torch.Tensor, eps: float) -> _ChainHead | None:
    """An EAGLE-3 head's drafting weights for head_chains: its final norm, LM head and draft ids, the
    target's embedding table (fp32, or a bf16 table whose rows widen exactly) and the layer's two input
    norms; None where head_chain.c cannot run them."""
    lin = _describe(lm_head, None)
    if (lin is None or not all(_cpu_f32(t) and t.numel() == lin.K for t in (norm, input_norm, hidden_norm))
            or draft_ids.dtype is not torch.int64 or not draft_ids.is_contiguous() or draft_ids.device.type != "cpu"
            or draft_ids.numel() != lin.N or embed.device.type != "cpu" or not embed.is_contiguous()
            or embed.dtype not in (torch.float32, torch.bfloat16) or embed.dim() != 2 or embed.shape[1] != lin.K):
        return None
    return _ChainHead(norm.data_ptr(), lin, draft_ids.data_ptr(), embed.data_ptr(), int(embed.dtype is torch.bfloat16),
                      embed.shape[0], input_norm.data_ptr(), hidden_norm.data_ptr(), eps)


def describe_linear(weight) -> _Linear | None:
    """The C description of linear(x, weight) (no bias), or None where layer.c cannot run it."""
    return _describe(weight, None)


def head_digest(chain: _ChainHead, fc: _Linear, desc: _LayerWeights, feats: torch.Tensor, tokens: Sequence[int],
                caches: Sequence, sizes: Sequence[int], positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                n_heads: int, eps: float) -> torch.Tensor | None:
    """An EAGLE-3 head's digest of accepted rows in one C call (head_chain.c): x [N, H] = the layer over
    [input_norm(embed(tokens)); hidden_norm(fc(feats))], feats [N, 3H] the rows of len(caches) sequences
    back to back (sizes[i] after caches[i]'s `length` rows, which are the caller's to advance), positions
    [N]. None where it does not apply (then forward_rows, which gives the same)."""
    N = feats.shape[0]
    if (not 0 < N <= MAX_ROWS or torch.is_grad_enabled() or _load() is None or not _cpu_f32(feats)
            or feats.dim() != 2 or feats.shape[1] != fc.K or fc.N != chain.lm_head.K or len(tokens) != N
            or sum(sizes) != N or positions.numel() != N or len(caches) != len(sizes)
            or not (_cpu_f32(cos) and _cpu_f32(sin)) or int(positions.max()) >= cos.shape[0]):
        return None
    seqs = _seq_caches(caches, sizes)
    if seqs is None:
        return None
    pos = positions.to(torch.int64).contiguous()
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    shape = _head_shape(cos, sin, pos, N, chain.lm_head.K, n_heads, caches, eps, seqs)
    x = torch.empty(N, chain.lm_head.K, dtype=torch.float32)
    rc = _load().specdec_head_digest_f32(feats.data_ptr(), ids.data_ptr(), ctypes.byref(fc), ctypes.byref(chain),
                                         ctypes.byref(desc), ctypes.byref(shape), x.data_ptr())
    if rc == -1:
        raise MemoryError("head digest kernel: out of memory for its buffers")
    return x if rc == 0 else None


def head_chains(chain: _ChainHead, desc: _LayerWeights, g: torch.Tensor, caches: Sequence, starts: Sequence[int],
                ks: Sequence[int], cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                eps: float) -> list[list[int]] | None:
    """Greedy chains of ks[b] draft tokens (target ids) for the rows b in one C call (head_chain.c): g [B, H]
    the rows' head outputs where their chains start, caches their DraftKV (`length`: the committed rows; the
    chain's rows are written after them, the lengths are the caller's to advance), starts[b] the position
    of row b's first forward. None where it does not apply (then the caller's loop, which gives the same)."""
    B, H = g.shape
    if (not 0 < B <= MAX_ROWS or len(caches) != B or len(starts) != B or len(ks) != B or min(ks) < 1
            or H != chain.lm_head.K or torch.is_grad_enabled() or _load() is None
            or not _cpu_f32(g) or not (_cpu_f32(cos) and _cpu_f32(sin))
            or max(s + k - 2 for s, k in zip(starts, ks)) >= cos.shape[0]):
        return None
    seqs = _seq_caches(caches, [k - 1 for k in ks])  # (count: the room the chain's forwards need)
    if seqs is None:
        return None
    shape = _head_shape(cos, sin, None, B, H, n_heads, caches, eps, seqs)
    kmax = max(ks)
    pos0 = torch.tensor(list(starts), dtype=torch.int64)
    row_ks = torch.tensor(list(ks), dtype=torch.int64)
    tokens = torch.empty(B, kmax, dtype=torch.int64)
    work = g.clone()  # (the kernel overwrites it with each depth's outputs)
    rc = _load().specdec_head_chains_f32(work.data_ptr(), ctypes.byref(chain), ctypes.byref(desc),
                                         ctypes.byref(shape), pos0.data_ptr(), row_ks.data_ptr(), kmax,
                                         tokens.data_ptr())
    if rc == -1:
        raise MemoryError("head chain kernel: out of memory for its buffers")
    if rc != 0:
        return None
    return [row[:k] for row, k in zip(tokens.tolist(), ks)]


TREE_TOPK_MAX = 8  # head_tree.c's (topk.c's TOPK_MAX)


def head_tree(chain: _ChainHead, desc: _LayerWeights, g: torch.Tensor, cache, start: int, topk: int, depths: int,
              cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
              eps: float) -> tuple[list[int], list[int], list[float]] | None:
    """EAGLE-2's dynamic tree from an EAGLE-3 head in one C call (head_tree.c; eagle_tree.dynamic_tree's
    nodes in its order): g [H] the head's output at the last committed row, cache its DraftKV (`length`: the
    committed rows; the tree's blocks are written after them, scratch), start the position of a depth-1
    node's forward, topk children a node, depths levels. Returns every node's (target id, parent node or -1,
    cumulative log-probability); None where it does not apply (then the Python tree)."""
    H = g.shape[-1]
    F = (depths - 1) * topk
    if (not 1 <= topk <= TREE_TOPK_MAX or depths < 1 or F > MAX_ROWS or g.numel() != H or H != chain.lm_head.K
            or topk > chain.lm_head.N or torch.is_grad_enabled() or _load() is None or not _cpu_f32(g)
            or not (_cpu_f32(cos) and _cpu_f32(sin)) or start + depths - 2 >= cos.shape[0]):
        return None
    seqs = _seq_caches([cache], [F])  # (count: the room the blocks need)
    if seqs is None:
        return None
    shape = _head_shape(cos, sin, None, F, H, n_heads, [cache], eps, seqs)
    n = topk + (depths - 1) * topk * topk
    tok, par = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    val = torch.empty(n, dtype=torch.float32)
    g = g.contiguous()
    rc = _load().specdec_head_tree_f32(g.data_ptr(), ctypes.byref(chain), ctypes.byref(desc),
                                       ctypes.byref(shape), start, topk, depths, tok.data_ptr(), par.data_ptr(),
                                       val.data_ptr())
    if rc == -1:
        raise MemoryError("head tree kernel: out of memory for its buffers")
    return None if rc != 0 else (tok.tolist(), par.tolist(), val.tolist())
