"""bfloat16 weights with fp32 arithmetic: how `--dtype bfloat16` runs on a CPU.

Decoding streams every weight once per token, so half the bytes is up to twice the speed. A
Bf16Weight stores [N, K] as bfloat16 and computes x @ W^T with fp32 activations and fp32 sums: each
weight is widened exactly (bf16 -> fp32 is a 16-bit shift), so the only rounding is the weight's own
(llama.cpp keeps a BF16 file's residual stream and norms in fp32 too, but rounds every matmul's input to
bf16: its CPU vec_dot_type for BF16 is BF16). Norms, the KV cache and every activation stay fp32, which
is what model.dtype reports.

A prompt's pass is the exception where the CPU has native bf16 dot products (AVX512-BF16, AMX): prefill
is compute-bound, and there oneDNN's bf16 matmul does twice the fp32 FLOP/s. The loader sets the model's
prefill_matmul_dtype, and forward(prefill=True) rounds each layer matmul's input and output to bf16
(attention, norms, residual, cache and the LM head stay fp32): an 867-token prompt on a 2-vCPU Zen 4
takes 0.87 s instead of 1.37 s. Every other pass (decode, verify, drafts) keeps fp32 activations, so
plain and speculative decoding share the same prefill and stay token-for-token equal.

    x bf16 (a prompt on a bf16 CPU)  -> F.linear(x, W) in bf16 (fp32 sums inside oneDNN)
    rows <= MAX_ROWS, CPU, fp32 x    -> gemv.c's bf16 path (the fp32 kernel's tiles and order: batch invariant)
    otherwise (GPU, > MAX_ROWS rows) -> F.linear(x, W widened to x's dtype)

`quantize_model(model, Bf16Scheme(), head=Bf16Scheme())` converts a loaded fp32 model in place
(specdec/model/loader.py does so for `dtype=bfloat16` on a CPU); a tied embedding reads the same table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.kernels import linear_bf16
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

    def extra_repr(self) -> str:
        return f"bfloat16, fp32 sums, {self.out_features}x{self.in_features}"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        y = linear_bf16(x, self.qweight, bias)
        if y is not None:
            return y
        return F.linear(x, self.qweight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qweight.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [...] -> [..., K] (an embedding lookup)."""
        return self.qweight[ids].to(self.compute_dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size()
