"""A whole decoder layer (decoder_layer), or a model's whole stack of layers (decoder_layers), in one C
call (layer.c) for decode-shaped passes; None where it does not apply.

Applies where the fused attention does (fp32, no q/k norm; one sequence in a static cache with <= MAX_ROWS
(64) new tokens, or the serving engine's paged batch with <= MAX_ROWS rows in all: B x T, padding
included, which is where the per-op path's linears run the same kernels; packed, <= MAX_ROWS real tokens
in a grid the attention kernel takes; up to TILE_CALL_ROWS (256) rows, a prompt's pass, where every linear
is on AMX tiles: _rows_fit) and every projection is an
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

from specdec.kernels import MAX_ROWS, TILE_CALL_ROWS, load_kernels
from specdec.kernels.attention import PAGED_ROWS, FusedAttention, PagedAttention, partials_fit, tail_args

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
                ("num_seqs", c_int64), ("seqs", ctypes.POINTER(_SeqCache)), ("kv_bf16", c_int64)]


class _ChainHead(ctypes.Structure):
    _fields_ = [("norm", c_void_p), ("lm_head", _Linear), ("draft_ids", c_void_p), ("embed", c_void_p),
                ("embed_bf16", c_int64), ("vocab", c_int64), ("input_norm", c_void_p), ("hidden_norm", c_void_p),
                ("eps", c_float)]


@functools.cache
def _load():
    """The kernel library with this module's functions declared (and kernels/head.py's: the head's layer,
    chains, digest and tree), or None."""
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
        lib.specdec_head_tree_f32.argtypes = [c_void_p, ctypes.POINTER(_ChainHead), ctypes.POINTER(_LayerWeights),
                                              ctypes.POINTER(_LayerShape), c_int64, c_int64, c_int64, c_void_p,
                                              c_void_p, c_void_p]
        lib.specdec_head_tree_f32.restype = ctypes.c_int
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
            for name in ("qweight", "scales", "zeros", "tiles", "round_inputs"):
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
    if not (paged or type(fused) is FusedAttention) or torch.is_grad_enabled() or _load() is None:
        return None
    descs = [_layer_weights(layer) for _, layer in indexed]
    if not descs or any(d is None for d in descs) or not _rows_fit(x, fused, descs, packed):
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


def _rows_fit(x: torch.Tensor, fused, descs: list, packed: bool) -> bool:
    """Whether layer.c takes this pass's rows (x [B, T, H]; packed: the real tokens alone, packs() said so):
    up to MAX_ROWS, where the per-op path's linears run the same kernels; wider (a prompt's pass, the engine's
    prefill chunk) up to TILE_CALL_ROWS where every linear is on AMX tiles, which take that many rows in
    one call with every row's sums unchanged (the per-op path's call size for them, so the result is still
    the per-op path's bit for bit), and the attention's partials fit in one kernel call. 100-256-token
    prompt passes of SmolLM2 in bf16 on tiles: 0.71-0.81x the per-op path's time (session 41)."""
    rows = x.shape[1] if type(fused) is FusedAttention else x.shape[0] * x.shape[1]
    if packed or rows <= MAX_ROWS:
        return True
    keys = fused.past + x.shape[1] if type(fused) is FusedAttention else fused.gather.shape[1]
    D = fused.cos.shape[1]
    return (rows <= TILE_CALL_ROWS and fused.tail_path is None
            and all(lin.kind == LIN_BF16_TILES for d in descs for lin in (d.qkv, d.o_proj, d.gate_up, d.down))
            and partials_fit(rows, fused.n_heads, D, keys))


def _layer_shape(fused, T: int, H: int, Hq: int, Hkv: int, D: int, eps: float) -> _LayerShape:
    return _LayerShape(fused.cos.data_ptr(), fused.sin.data_ptr(), fused.positions.data_ptr(),
                       None if fused.mask is None else fused.mask.data_ptr(), T, H, Hq, Hkv, D, fused.past,
                       fused.cache.max_len, eps, 1.0 / math.sqrt(D), 0, 0, None, None, 0, None,
                       *tail_args(fused.tail_start, fused.tail_path), 0, None, fused.kv_bf16)


def _paged_shape(fused, T: int, H: int, Hq: int, Hkv: int, D: int, eps: float) -> _LayerShape:
    B, L = fused.gather.shape
    return _LayerShape(fused.cos.data_ptr(), fused.sin.data_ptr(), fused.positions.data_ptr(),
                       fused.mask.data_ptr(), T, H, Hq, Hkv, D, 0, 0, eps, 1.0 / math.sqrt(D), B, L,
                       fused.new_slot.data_ptr(), fused.gather.data_ptr(), 0, None,
                       *tail_args(fused.tail_start, fused.tail_path), 0, None, fused.kv_bf16)
