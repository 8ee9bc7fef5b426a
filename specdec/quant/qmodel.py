"""Whole-model conversion: swap a LlamaModel's linear layers for packed QLinear modules.

    quantize_model(model, QuantScheme.named("int8"))      in place (a quantized target)
    quantized_copy(model, QuantScheme.named("int4", 32))  a second model that shares the norms,
                                                          rotary tables and fp32 embedding of
                                                          `model` (the qdraft drafter)
    quantize_model(model, Fp8Scheme())                    FP8 e4m3 (torch._scaled_mm; for GPUs)
    quantize_model(model, Bf16Scheme(), Bf16Scheme())     bf16 weights, fp32 sums (--dtype bfloat16 on a CPU)
The lm_head (and a tied embedding) uses its own scheme, int8 by default: it is a large share of a
small model's error and only ~20% of its bytes. A matrix the scheme cannot hold (int: width not a
multiple of 32; fp8: a dimension not a multiple of 16) stays in full precision.
"""
from __future__ import annotations

import torch

from specdec.model.llama import LlamaModel
from specdec.quant.bf16 import Bf16Scheme, Bf16Weight
from specdec.quant.fp8 import Fp8Scheme, Fp8Weight, fp8_applies
from specdec.quant.qlinear import QEmbedding, QLinear, QuantizedWeight
from specdec.quant.schemes import BLOCK, QuantScheme, quantize

Scheme = QuantScheme | Fp8Scheme | Bf16Scheme

LAYER_LINEARS = ("qkv", "o_proj", "gate_up", "down")
DEFAULT_HEAD = QuantScheme(8, 32, True)


def scheme_named(name: str, group_size: int = 128, symmetric: bool | None = None) -> Scheme:
    """'int8' / 'int4' (group-wise, qgemv.c on CPUs), 'fp8' (e4m3, torch._scaled_mm: for GPUs) or 'bf16'
    (bf16 weights, fp32 sums: what --dtype bfloat16 loads on a CPU)."""
    if name == "bf16":
        return Bf16Scheme()
    return Fp8Scheme() if name == "fp8" else QuantScheme.named(name, group_size, symmetric)


def packed_weight(w: torch.Tensor, scheme: Scheme, dtype: torch.dtype) -> torch.nn.Module | None:
    """w [N, K] as `scheme` stores it (a module with .linear, .rows), or None where it cannot.
    A bf16-stored w (a bf16 target's weight) is widened first: a quantized copy of a bf16 model."""
    if isinstance(w, Bf16Weight):
        w = w.dequantize()
    if isinstance(scheme, Bf16Scheme):
        return Bf16Weight(w, dtype)
    if isinstance(scheme, Fp8Scheme):
        return Fp8Weight.from_float(w, dtype) if fp8_applies(w) else None
    return None if w.shape[1] % BLOCK else QuantizedWeight(quantize(w, scheme), dtype)


def _qlinear(lin: torch.nn.Module, scheme: Scheme, dtype: torch.dtype) -> torch.nn.Module:
    already = isinstance(lin, QLinear) and not isinstance(lin.weight, Bf16Weight)
    qw = None if already else packed_weight(lin.weight, scheme, dtype)
    return lin if qw is None else QLinear(qw, lin.bias)


def _quantize_head(src: LlamaModel, dst: LlamaModel, head: Scheme | None, embed: bool) -> None:
    """dst.lm_head (and dst.embed when `embed` and the model ties them) from src's weights."""
    qw = None if head is None else packed_weight(src.lm_head.weight, head, src.dtype)
    if qw is None:
        dst.lm_head = src.lm_head
        return
    dst.lm_head = QLinear(qw)
    if embed and src.config.tie_word_embeddings:
        dst.embed = QEmbedding(qw)


def quantize_model(model: LlamaModel, scheme: Scheme, head: Scheme | None = DEFAULT_HEAD,
                   embed: bool = True) -> LlamaModel:
    """Quantize every decoder linear with `scheme` and the lm_head with `head` (None: keep it), in place.
    embed: a tied embedding reads the packed lm_head (else it keeps its fp table)."""
    dtype = model.dtype
    for layer in model.layers:
        for name in LAYER_LINEARS:
            setattr(layer, name, _qlinear(getattr(layer, name), scheme, dtype))
    _quantize_head(model, model, head, embed)
    return model


def quantized_copy(model: LlamaModel, scheme: Scheme, head: Scheme | None = DEFAULT_HEAD) -> LlamaModel:
    """A quantized twin of `model` sharing its norms, rotary tables and embedding (no fp copies)."""
    with torch.device("meta"):
        copy = type(model)(model.config, model.max_len)  # LlamaModel, Gemma3Model, ...
    for name, module in model.named_children():  # embed, norm, rotary tables: shared
        if name not in ("layers", "lm_head"):
            setattr(copy, name, module)
    dtype = model.dtype
    for src, dst in zip(model.layers, copy.layers):
        for name, module in src.named_children():
            setattr(dst, name, _qlinear(module, scheme, dtype) if name in LAYER_LINEARS else module)
    _quantize_head(model, copy, head, embed=False)
    copy.kv_cache_dtype = getattr(model, "kv_cache_dtype", None)  # its caches as the target's (qdraft copies them)
    return copy.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, tied tensors counted once (tensors are counted, not
    storages: the loader puts every weight into one arena, see specdec/model/memory.py)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes, t.device)
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def stored_as(w) -> str | None:
    """How a weight is stored: 'int4-g32', 'fp8-e4m3', ..., or None (a full-precision tensor)."""
    if isinstance(w, QuantizedWeight):
        return f"int{w.bits}-g{w.group_size}"
    if isinstance(w, Bf16Weight):
        return "bf16"
    return "fp8-e4m3" if isinstance(w, Fp8Weight) else None


def describe(model: LlamaModel) -> str:
    """e.g. 'int4-g32 (lm_head int8-g32)' or 'float32'."""
    def name(w) -> str:
        return stored_as(w) or str(w.dtype).replace("torch.", "")
    body, head = name(model.layers[0].qkv.weight), name(model.lm_head.weight)
    return body if head == body else f"{body} (lm_head {head})"
