"""bfloat16 weights with fp32 sums: how `--dtype bfloat16` runs on a CPU.

Decoding streams every weight once per token, so half the bytes is up to twice the speed. A
Bf16Weight stores [N, K] as bfloat16 and computes x @ W^T with fp32 sums. Norms, attention, the residual
stream and the KV cache stay fp32, which is what model.dtype reports. What a matmul's input is depends
on the CPU, chosen once by the loader (to_cpu_bf16):

- with bf16 dot products (AVX512-BF16, AMX): every matmul's input is rounded to bf16 (round_inputs), as
  llama.cpp's BF16 matmul does (its CPU vec_dot_type for BF16 is BF16) and as torch's bf16 matmul does.
  Every product is then exact and only the sums round. bf16dot.c runs decode, verify and draft passes on
  vdpbf16ps, twice the multiply-adds of an fp32 FMA: on a 2-vCPU Zen 4 a verify pass over 8 tokens costs
  ~1.1x a single-token step instead of ~1.8x (on a 2-vCPU Xeon still ~1.8x: there `use_amx_tiles` moves
  them to AMX tiles, bf16amx.c, from a tile-packed copy of each matrix held beside it). A prompt's layer
  matmuls also round their outputs to bf16 (prefill_matmul_dtype, oneDNN's bf16 matmul at twice the fp32
  FLOP/s: an 867-token prompt 0.87 s instead of 1.37 s); attention, norms, residual, cache and the LM head
  stay fp32 there. Not where the tiles are packed: oneDNN is not row-invariant on an AMX CPU, so prompts
  run on the tiles, as decode passes do (use_amx_tiles, exact_prompt_passes).
- without: the input stays fp32 and each weight is widened exactly (a 16-bit shift), so the only rounding
  is the weights': the model is the fp32 model over bf16-rounded weights (rounding the inputs too would
  cost accuracy and gain nothing on fp32 FMAs).

Either way plain and speculative decoding run the same kernels in the same order at every row count, so
they stay token-for-token equal.

    x bf16 (a prompt on a bf16 CPU)  -> F.linear(x, W) in bf16 (fp32 sums inside oneDNN)
    rows <= MAX_ROWS, CPU, fp32 x    -> bf16dot.c (round_inputs) or gemv.c's widening path: batch invariant
    otherwise (GPU, > MAX_ROWS rows) -> F.linear(x (rounded if round_inputs), W widened to x's dtype)

`to_cpu_bf16(model)` converts a loaded fp32 model in place as the loader does for `dtype=bfloat16` on a
CPU (quantize_model with Bf16Scheme for the layers and the head; a tied embedding reads the same table).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.kernels import amx_active, amx_tiles, linear_bf16
from specdec.quant.schemes import StoredWeight


@dataclass(frozen=True)
class Bf16Scheme:
    """Store a matrix as bfloat16 (round to nearest even), compute in fp32."""

    @property
    def name(self) -> str:
        return "bf16"

    def to_dict(self) -> dict:
        return {"scheme": "bf16"}


class Bf16Weight(StoredWeight):
    """A bfloat16 [N, K] weight that computes x @ W^T in fp32 itself (as QuantizedWeight does)."""

    def __init__(self, weight: torch.Tensor, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("qweight", weight.detach().to(torch.bfloat16).contiguous())  # the stored matrix
        self.compute_dtype = compute_dtype
        self.round_inputs = False  # x rounded to bf16 before the product (set_bf16_inputs)
        # use_amx_tiles: the matrix packed as AMX tiles (kernels.amx_tiles), what decode and verify passes
        # read; qweight stays for prompt passes and the embedding. Not a buffer: never saved.
        self.tiles: torch.Tensor | None = None

    def extra_repr(self) -> str:
        inputs = "bf16" if self.round_inputs else "fp32"
        return f"bfloat16, {inputs} inputs, fp32 sums, {self.out_features}x{self.in_features}"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        y = linear_bf16(x, self.qweight, bias, self.round_inputs, self.tiles)
        if y is not None:
            return y
        if self.round_inputs:
            x = x.to(torch.bfloat16).to(x.dtype)
        return F.linear(x, self.qweight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qweight.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [...] -> [..., K] (an embedding lookup)."""
        return self.qweight[ids].to(self.compute_dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size()


def to_cpu_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """A loaded fp32 model as `--dtype bfloat16` runs it on this CPU, in place: bf16 weights (the LM head
    and a tied embedding too), and where the CPU has bf16 dot products bf16 matmul inputs and bf16 prompt
    matmuls."""
    from specdec.model.loader import cpu_has_bf16
    from specdec.quant.qmodel import quantize_model
    quantize_model(model, Bf16Scheme(), head=Bf16Scheme())
    if cpu_has_bf16():
        set_bf16_inputs(model, True)
        model.prefill_matmul_dtype = torch.bfloat16
    return model


def onednn_prompt_rows_invariant() -> bool:
    """Whether oneDNN's bf16 GEMM (a bf16 prompt pass's matmuls, prefill_matmul_dtype) gives a row the same
    bits at any row count here: measured so on bf16 CPUs without AMX (AMD Zen 4); with AMX it sums a row one
    way at 1-32 rows and another at 64-512 (2 threads; tests/test_prompt_pass.py), so a prompt cut in two
    differs from one pass."""
    from specdec.model.loader import cpu_has_amx, cpu_has_bf16
    return cpu_has_bf16() and not cpu_has_amx()


def exact_prompt_passes(model: torch.nn.Module) -> bool:
    """Make a model's prompt pass independent of how the prompt is cut (the serving engine's chunked
    prefill, its prefix cache): where its bf16 prompt matmuls would run on a oneDNN that is not row-invariant
    here, they run on our kernels instead (tiles where packed, else bf16dot.c: a 900-token prompt as fast /
    2.8x the time on a 2-vCPU Xeon). True if the model's prompt passes were changed."""
    if getattr(model, "prefill_matmul_dtype", None) is None or onednn_prompt_rows_invariant():
        return False
    model.prefill_matmul_dtype = None
    return True


def _bf16_weights(model: torch.nn.Module) -> list[Bf16Weight]:
    return [m for m in model.modules() if isinstance(m, Bf16Weight)]


def set_bf16_inputs(model: torch.nn.Module, on: bool) -> int:
    """Round every Bf16Weight's matmul input to bf16 (on) or not; how many weights it set. (Turning the
    rounding off drops AMX tiles: they multiply rounded inputs.)"""
    weights = _bf16_weights(model)
    for w in weights:
        w.round_inputs = on
        if not on:
            w.tiles = None
    return len(weights)


def use_amx_tiles(model: torch.nn.Module, on: bool = True) -> int:
    """Run every bf16 matmul with rounded inputs on AMX tiles (on, where the CPU has AMX) or on vdpbf16ps;
    how many weights now run on tiles. A choice per model, made before it decodes: plain and speculative
    passes of one model must share it (each kernel is batch-invariant; the two sum in different orders).

    Measured on a 2-vCPU Xeon with AMX, SmolLM2-135M bf16 (docs/benchmarks/methods.md, session 31): a
    single-token pass 5-10% slower than on vdpbf16ps, an 8-token verify pass 1.2x a single-token one
    instead of 1.8x, the serving engine at 16 sequences 1.2-1.4x the tokens/s; hence off by default,
    on for `specdec serve`."""
    weights = _bf16_weights(model)  # (in forward order: layer by layer)
    eligible = [w for w in weights if w.round_inputs and w.qweight.device.type == "cpu"]
    packed = pack_tiles(weights, eligible if on else [])
    # a prompt's matmuls on the tiles too: row-invariant (oneDNN's bf16 GEMM is not on an AMX CPU), and the
    # decode passes' kernel, so a prompt-pass row equals a decoded one; as fast as oneDNN on a 900-token
    # prompt (2-vCPU Xeon, session 33). Off the tiles, oneDNN again (to_cpu_bf16's choice)
    if eligible and hasattr(model, "prefill_matmul_dtype"):
        model.prefill_matmul_dtype = None if packed else torch.bfloat16
    return len(packed)


def on_tiles(model) -> bool:
    """Whether a model's bf16 matmuls run on AMX tiles (use_amx_tiles): its drafters may follow."""
    return isinstance(model, torch.nn.Module) and any(w.tiles is not None for w in _bf16_weights(model))


def pack_tiles(weights: list[Bf16Weight], on: list[Bf16Weight]) -> list[Bf16Weight]:
    """Drop the tiles of `weights` and pack those of `on` (where the CPU has AMX): the ones now on tiles."""
    for w in weights:
        w.tiles = None
    packed = on if amx_active() else []
    for w, tiles in zip(packed, amx_tiles([w.qweight for w in packed])):
        w.tiles = tiles
    return packed
