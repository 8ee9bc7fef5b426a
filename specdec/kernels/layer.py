"""A whole decoder layer (decoder_layer), or a model's whole stack of layers (decoder_layers), in one C
call (layer.c) for decode-shaped passes; None where it does not apply.

Applies where the fused attention does (fp32, no q/k norm; one sequence in a static cache with <= MAX_ROWS
(64) new tokens, or the serving engine's paged batch with <= MAX_ROWS rows in all: B x T, padding
included, which is where the per-op path's linears run the same kernels; packed, <= MAX_ROWS real tokens
in a grid the attention kernel takes) and every projection is an
fp32 matrix, a bf16 one (specdec.quant.bf16) or a packed int8/int4 weight on the CPU. The
result is bitwise the one of the per-op path (same kernels, same order), so callers fall back to
that path freely. The layer's pointers are described once and re-described only when a weight moves.
"""
from __future__ import annotations

import ctypes
import functools
import math
from ctypes import c_float, c_int64, c_void_p
from typing import Sequence

import torch

from specdec.kernels import MAX_ROWS, load_kernels
from specdec.kernels.attention import PAGED_ROWS, FusedAttention, PagedAttention, tail_args, tree_tails

LIN_F32, LIN_I8, LIN_I4, LIN_BF16, LIN_BF16_DOT, LIN_BF16_TILES = 0, 1, 2, 3, 4, 5


class _Linear(ctypes.Structure):
    _fields_ = [("kind", c_int64), ("weight", c_void_p), ("scales", c_void_p), ("zeros", c_void_p),
                ("bias", c_void_p), ("N", c_int64), ("K", c_int64), ("G", c_int64)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("qkv", _Linear), ("o_proj", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", c_void_p), ("v_cache", c_void_p)]


class _SeqCache(ctypes.Structure):
    _fields_ = [("k_cache", c_void_p), ("v_cache", c_void_p), ("past", c_int64), ("count", c_int64),
                ("max_len", c_int64)]


class _LayerShape(ctypes.Structure):
    _fields_ = [("cos", c_void_p), ("sin", c_void_p), ("pos", c_void_p), ("mask", c_void_p),
                ("T", c_int64), ("H", c_int64), ("Hq", c_int64), ("Hkv", c_int64), ("D", c_int64),
                ("past", c_int64), ("max_len", c_int64), ("eps", c_float), ("scale", c_float),
                ("B", c_int64), ("L", c_int64), ("new_slot", c_void_p), ("gather", c_void_p),
                ("num_real", c_int64), ("real_index", c_void_p),
                ("tail_start", c_void_p), ("tail_path", c_void_p), ("tail_width", c_int64),
                ("num_seqs", c_int64), ("seqs", ctypes.POINTER(_SeqCache))]


class _ChainHead(ctypes.Structure):
    _fields_ = [("norm", c_void_p), ("lm_head", _Linear), ("draft_ids", c_void_p), ("embed", c_void_p),
                ("embed_bf16", c_int64), ("vocab", c_int64), ("input_norm", c_void_p), ("hidden_norm", c_void_p),
                ("eps", c_float)]


@functools.cache
def _load():
    """The kernel library with this module's functions declared, or None."""
    lib, _ = load_kernels()
    if lib is not None:
        lib.specdec_decoder_layers_f32.argtypes = [c_void_p, ctypes.POINTER(ctypes.POINTER(_LayerWeights)),
                                                   c_int64, ctypes.POINTER(_LayerShape), c_void_p]
        lib.specdec_decoder_layers_f32.restype = ctypes.c_int
        lib.specdec_head_layer_f32.argtypes = [c_void_p, c_void_p, ctypes.POINTER(_LayerWeights),
                                               ctypes.POINTER(_LayerShape)]
        lib.specdec_head_layer_f32.restype = ctypes.c_int
        lib.specdec_head_chains_f32.argtypes = [c_void_p, ctypes.POINTER(_ChainHead), ctypes.POINTER(_LayerWeights),
                                                ctypes.POINTER(_LayerShape), c_void_p, c_void_p, c_int64, c_void_p]
        lib.specdec_head_chains_f32.restype = ctypes.c_int
        lib.specdec_head_digest_f32.argtypes = [c_void_p, c_void_p, ctypes.POINTER(_Linear), ctypes.POINTER(_ChainHead),
                                                ctypes.POINTER(_LayerWeights), ctypes.POINTER(_LayerShape), c_void_p]
        lib.specdec_head_digest_f32.restype = ctypes.c_int
    return lib


def _cpu_f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype is torch.float32 and t.is_contiguous())


def _describe(weight, bias: torch.Tensor | None) -> _Linear | None:
    """The C description of `linear(x, weight, bias)`, or None if layer.c cannot run it."""
    if not _cpu_f32(bias):
        return None
    b = None if bias is None else bias.data_ptr()
    if isinstance(weight, torch.Tensor):
        if not _cpu_f32(weight):
            return None
        N, K = weight.shape
        return _Linear(LIN_F32, weight.data_ptr(), None, None, b, N, K, 0)
    q = getattr(weight, "qweight", None)  # a packed specdec.quant weight: bf16, int8/int4 (not fp8)
    if q is not None and q.dtype is torch.bfloat16 and q.device.type == "cpu" and q.is_contiguous():
        N, K = q.shape
        rounded, tiles = getattr(weight, "round_inputs", False), getattr(weight, "tiles", None)
        if rounded and tiles is not None:
            return _Linear(LIN_BF16_TILES, tiles.data_ptr(), None, None, b, N, K, 0)
        kind = LIN_BF16_DOT if rounded else LIN_BF16
        return _Linear(kind, q.data_ptr(), None, None, b, N, K, 0)
    if q is None or q.device.type != "cpu" or getattr(weight, "bits", None) not in (4, 8):
        return None
    zeros = None if weight.zeros is None else weight.zeros.data_ptr()
    return _Linear(LIN_I4 if weight.bits == 4 else LIN_I8, q.data_ptr(), weight.scales.data_ptr(), zeros, b,
                   weight.out_features, weight.in_features, weight.group_size)


def _watch(owner, name: str, refs: list):
    """owner.<name> (a parameter, buffer, submodule or plain attribute) without nn.Module.__getattr__,
    recorded in refs as (where it was found, name, id, data address or None) for _unchanged."""
    if isinstance(owner, torch.nn.Module):
        d = owner.__dict__
        store = next((d[s] for s in ("_parameters", "_buffers", "_modules") if name in d[s]), d)
        value = store.get(name)
    else:  # a weight of another kind (e.g. AWQ's input recorder): read through getattr
        store, value = owner, getattr(owner, name, None)
    refs.append((store, name, id(value), value.data_ptr() if isinstance(value, torch.Tensor) else None))
    return value


def _unchanged(refs: list) -> bool:
    """Whether every watched attribute is still the same object at the same address. A check per layer
    and pass: a flat loop over what _watch recorded, ~3 us a layer; looking the ~30 attributes up again
    took ~8 us (0.25 ms of a ~11 ms bf16 decode step on 30 layers; 2% of the serving engine's time)."""
    for store, name, vid, ptr in refs:
        now = store.get(name) if isinstance(store, dict) else getattr(store, name, None)
        if id(now) != vid or (ptr is not None and now.data_ptr() != ptr):
            return False
    return True


def _watched(layer, refs: list) -> None:
    """Watch everything whose address a layer's description holds, and the bf16 weights' input rounding."""
    qkv = _watch(layer, "qkv", refs)
    _watch(_watch(layer, "input_norm", refs), "weight", refs)
    _watch(_watch(layer, "post_norm", refs), "weight", refs)
    _watch(qkv, "bias", refs)
    for lin in (qkv, _watch(layer, "o_proj", refs), _watch(layer, "gate_up", refs), _watch(layer, "down", refs)):
        w = _watch(lin, "weight", refs)
        if not isinstance(w, torch.Tensor):
            for name in ("qweight", "scales", "tiles", "round_inputs"):
                _watch(w, name, refs)


def _layer_weights(layer) -> _LayerWeights | None:
    cached = layer.__dict__.get("_fused_layer")
    if cached is not None and _unchanged(cached[0]):
        return cached[1]
    refs = []
    _watched(layer, refs)
    norms = (layer.input_norm.weight, layer.post_norm.weight)
    lins = [_describe(layer.qkv.weight, layer.qkv.bias), _describe(layer.o_proj.weight, None),
            _describe(layer.gate_up.weight, None), _describe(layer.down.weight, None)]
    desc = None
    if (all(_cpu_f32(n) for n in norms) and all(l is not None for l in lins)
            and layer.input_norm.eps == layer.post_norm.eps):  # layer.c takes one eps
        desc = _LayerWeights(norms[0].data_ptr(), norms[1].data_ptr(), *lins, None, None)
    layer._fused_layer = (refs, desc)
    return desc


def decoder_layer(layer, x: torch.Tensor, fused, layer_idx: int) -> torch.Tensor | None:
    """layer(x) for x [B, T, H] through layer.c, writing this layer's k/v; None if it does not apply.
    `fused` is the pass's FusedAttention (one sequence, static cache) or PagedAttention (paged batch)."""
    ran = _run([(layer_idx, layer)], x, fused, layer, ())
    return None if ran is None else ran[0]


def decoder_layers(layers, layer_ids, x: torch.Tensor, fused, keep: Sequence[int] = (),
                   pack: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """layers[i](x) for every i of layer_ids in turn, in ONE call to layer.c (bitwise the per-layer
    path, which costs a Python round trip per layer), with the hidden states after the layers in
    `keep` ({i: [B, T, H]}); None if layer.c does not apply to one of them. pack: a paged pass with
    padding runs its linears on the real tokens alone (packs(fused)); the padding rows of what comes
    back are zeros."""
    return _run([(i, layers[i]) for i in layer_ids], x, fused, layers, keep, pack and packs(fused))


def packs(fused) -> bool:
    """Whether decoder_layers(..., pack=True) runs this pass packed: a paged pass with padding whose real
    tokens fit layer.c's rows and whose grid fits one attention kernel call (PAGED_ROWS: layer.c calls it once)."""
    real = getattr(fused, "real_index", None)
    return (type(fused) is PagedAttention and real is not None and real.numel() <= MAX_ROWS
            and fused.new_slot.numel() <= PAGED_ROWS)


def unpack(rows: torch.Tensor, real: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[N, C] rows of a packed pass's real tokens (real: their places in the [B * T] grid) -> [B, T, C],
    zeros on the padding (written alone: a pass's logits are [B * T, V])."""
    grid = rows.new_empty(B * T, rows.shape[-1])
    grid[real] = rows
    pad = torch.ones(B * T, dtype=torch.bool)
    pad[real] = False
    grid[pad] = 0.0
    return grid.view(B, T, -1)


def _run(indexed: list, x: torch.Tensor, fused, owner, keep: Sequence[int], packed: bool = False):
    """The (layer index, layer) pairs in turn through layer.c in one call: (x after the last, {kept
    layer: x after it}), or None. `owner` (the layer or the model's layer list) keeps the C array of
    their descriptions between passes. packed: x's real tokens alone go through (packs(fused))."""
    paged = type(fused) is PagedAttention
    if (not (paged or type(fused) is FusedAttention) or torch.is_grad_enabled() or _load() is None
            or (paged and not packed and x.shape[0] * x.shape[1] > MAX_ROWS) or (not paged and x.shape[1] > MAX_ROWS)):
        return None
    descs = [_layer_weights(layer) for _, layer in indexed]
    if not descs or any(d is None for d in descs):
        return None
    k, v = (fused.cache.pool.k, fused.cache.pool.v) if paged else (fused.cache.k, fused.cache.v)
    for (i, _), d in zip(indexed, descs):  # this layer's [num_slots, Hkv, D] pool or [Hkv, max_len, D] cache
        d.k_cache = k.data_ptr() + i * k.stride(0) * k.element_size()
        d.v_cache = v.data_ptr() + i * v.stride(0) * v.element_size()
    stacks = owner.__dict__.setdefault("_fused_stacks", {})  # the C arrays of pointers, by description ids
    key = tuple(map(id, descs))  # the cached array holds its descriptions alive: an equal key is the same list
    if key not in stacks:
        if len(stacks) >= 16:  # weights moved, or many layer subsets: start afresh
            stacks.clear()
        stacks[key] = (ctypes.POINTER(_LayerWeights) * len(descs))(*map(ctypes.pointer, descs))
    B, T, H = x.shape
    # [B, T, H] or, packed, [N, H] (the real tokens), updated in place
    out = x.reshape(B * T, H)[fused.real_index] if packed else x.contiguous().clone()
    shapes = fused.layer_shapes  # packed -> the shape, the same for every layer of the pass
    shape = shapes.get(packed)
    if shape is None:
        first = indexed[0][1]
        make = _paged_shape if paged else _layer_shape
        shape = shapes[packed] = make(fused, T, H, first.n_heads, first.n_kv, first.head_dim,
                                      first.input_norm.eps)
        if packed:
            shape.num_real, shape.real_index = fused.real_index.numel(), fused.real_index.data_ptr()
    kept = {i: torch.empty_like(out) for i, _ in indexed if i in keep}
    saves = None
    if kept:
        saves = (c_void_p * len(indexed))(*(kept[i].data_ptr() if i in kept else None for i, _ in indexed))
    if _load().specdec_decoder_layers_f32(out.data_ptr(), stacks[key], len(descs), ctypes.byref(shape), saves) != 0:
        raise MemoryError("decoder layer kernel: out of memory for its buffers")
    if packed:
        out = unpack(out, fused.real_index, B, T)
        kept = {i: unpack(h, fused.real_index, B, T) for i, h in kept.items()}
    return out, kept


def _layer_shape(fused, T: int, H: int, Hq: int, Hkv: int, D: int, eps: float) -> _LayerShape:
    return _LayerShape(fused.cos.data_ptr(), fused.sin.data_ptr(), fused.positions.data_ptr(),
                       None if fused.mask is None else fused.mask.data_ptr(), T, H, Hq, Hkv, D, fused.past,
                       fused.cache.max_len, eps, 1.0 / math.sqrt(D), 0, 0, None, None, 0, None,
                       *tail_args(fused.tail_start, fused.tail_path))


def _paged_shape(fused, T: int, H: int, Hq: int, Hkv: int, D: int, eps: float) -> _LayerShape:
    B, L = fused.gather.shape
    return _LayerShape(fused.cos.data_ptr(), fused.sin.data_ptr(), fused.positions.data_ptr(),
                       fused.mask.data_ptr(), T, H, Hq, Hkv, D, 0, 0, eps, 1.0 / math.sqrt(D), B, L,
                       fused.new_slot.data_ptr(), fused.gather.data_ptr(), 0, None,
                       *tail_args(fused.tail_start, fused.tail_path))


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
