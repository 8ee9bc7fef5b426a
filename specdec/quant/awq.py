"""Activation-aware weight quantization (AWQ; Lin et al., MLSys 2024): the per-channel scale search.

A few salient input channels (large mean |x|) carry most of a linear's output; scaling their
weight columns up by s before round-to-nearest (and the input down by 1/s) shrinks their relative
rounding error. For each linear, over a grid of alpha in [0, 1]:

    s = mean|x|^alpha / sqrt(max * min)            (alpha = 0 is plain RTN)
    err(alpha) = mean( ((x / s) Q(W diag(s))^T - x W^T)^2 )      on the calibration inputs x

and the best s is folded into the op that feeds the linear, so the fp32 model is unchanged:
    qkv     <- input_norm.weight /= s         gate_up <- post_norm.weight /= s
    o_proj  <- v rows of qkv (and v bias) /= s, s tied across the query heads sharing a kv head
    down    <- up rows of gate_up /= s        (silu(gate) * up is linear in up)
Then the model is quantized with RTN as usual. The lm_head is not scaled (its input norm is shared
with nothing else, but its weight is tied to the embedding in many models).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specdec.model.llama import LlamaModel
from specdec.quant.schemes import QuantScheme, dequantize, quantize

LINEARS = ("qkv", "o_proj", "gate_up", "down")


class _Recorder:
    """Stands in for a weight in `linear(x, weight, bias)`: keeps x, then computes as before."""

    def __init__(self, weight: torch.Tensor, sink: list[torch.Tensor]):
        self.weight, self.sink = weight, sink

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.sink.append(x.reshape(-1, x.shape[-1]).detach().clone())
        return F.linear(x, self.weight, bias)


class _Probe(torch.nn.Module):
    def __init__(self, lin: torch.nn.Module, sink: list[torch.Tensor]):
        super().__init__()
        self.weight, self.bias = _Recorder(lin.weight, sink), lin.bias


@torch.inference_mode()
def collect_inputs(model: LlamaModel, sequences: list[list[int]]) -> dict[tuple[int, str], torch.Tensor]:
    """The input rows of every decoder linear over the calibration sequences: (layer, name) -> [n, K]."""
    sinks: dict[tuple[int, str], list[torch.Tensor]] = {}
    originals = []
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            lin = getattr(layer, name)
            originals.append((layer, name, lin))
            setattr(layer, name, _Probe(lin, sinks.setdefault((i, name), [])))
    try:
        for seq in sequences:
            cache = model.new_cache(len(seq))
            model(torch.tensor([seq]), torch.arange(len(seq))[None], cache, num_logits=1)
    finally:
        for layer, name, lin in originals:
            setattr(layer, name, lin)
    return {key: torch.cat(rows) for key, rows in sinks.items()}


def search_scale(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, grid: int = 20,
                 tie: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, float]:
    """Best input-channel scale s [K] for w [N, K] on inputs x [n, K], and its alpha."""
    x_mean = x.abs().mean(0)
    if tie is not None:
        x_mean = tie(x_mean)
    ref = x @ w.T
    best_err, best_s, best_alpha = float("inf"), torch.ones_like(x_mean), 0.0
    for i in range(grid + 1):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = dequantize(quantize(w * s, scheme)) / s
        err = float((x @ wq.T - ref).pow(2).mean())
        if err < best_err:
            best_err, best_s, best_alpha = err, s, alpha
    return best_s, best_alpha


def _kv_tie(n_heads: int, n_kv: int, head_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """o_proj input channels [n_heads * D]: one value per (kv head, dim), shared by its query heads."""
    group = n_heads // n_kv

    def tie(v: torch.Tensor) -> torch.Tensor:
        per_kv = v.view(n_kv, group, head_dim).mean(1, keepdim=True)  # [n_kv, 1, D]
        return per_kv.expand(n_kv, group, head_dim).reshape(-1)
    return tie


@torch.inference_mode()
def apply_awq(model: LlamaModel, sequences: list[list[int]], scheme: QuantScheme, grid: int = 20,
              progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Search and fold AWQ scales into `model` (fp, in place); returns the alpha chosen per linear."""
    cfg = model.config
    inputs = collect_inputs(model, sequences)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    I = cfg.intermediate_size
    tie = _kv_tie(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    alphas: dict[str, float] = {}
    for i, L in enumerate(model.layers):
        # o_proj first: its scale moves into the v rows of qkv, which qkv's own search then sees
        s, alphas[f"{i}.o_proj"] = search_scale(L.o_proj.weight, inputs[(i, "o_proj")], scheme, grid, tie)
        L.o_proj.weight.mul_(s)
        s_v = s.view(cfg.num_key_value_heads, -1, cfg.head_dim)[:, 0].reshape(-1)  # [kv]
        L.qkv.weight[q + kv:].div_(s_v[:, None])
        if L.qkv.bias is not None:
            L.qkv.bias[q + kv:].div_(s_v)
        s, alphas[f"{i}.down"] = search_scale(L.down.weight, inputs[(i, "down")], scheme, grid)
        L.down.weight.mul_(s)
        L.gate_up.weight[I:].div_(s[:, None])
        for name, norm in (("qkv", L.input_norm), ("gate_up", L.post_norm)):
            lin = getattr(L, name)
            s, alphas[f"{i}.{name}"] = search_scale(lin.weight, inputs[(i, name)], scheme, grid)
            lin.weight.mul_(s)
            norm.weight.div_(s)
        if progress is not None:
            progress(f"AWQ layer {i + 1}/{len(model.layers)}")
    return alphas
