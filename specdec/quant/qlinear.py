"""Packed weights as modules: QuantizedWeight (what `specdec.kernels.linear` dispatches to), and
the QLinear / QEmbedding modules that hold one.

The model code is unchanged: it calls `linear(x, self.qkv.weight, self.qkv.bias)`, and when
`self.qkv` is a QLinear its `weight` is a QuantizedWeight, which runs itself:
    rows <= QGEMV_ROWS, fp32, CPU -> qgemv.c (AVX2/OpenMP, batch-invariant; decode and verify)
    rows <= CHUNKED_ROWS          -> qgemv.c on QGEMV_ROWS rows at a time (a drafter's catch-up, short prompts)
    int4 on a CUDA GPU            -> torch's int4 kernel (specdec/quant/torch_int4.py), where it applies
    otherwise (prefill, GPU, bf16) -> dequantize to the activation dtype, then F.linear (BLAS)
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.quant.schemes import Packed, StoredWeight, dequantize
from specdec.quant.torch_int4 import CudaInt4

QGEMV_ROWS = 32  # rows per qgemv.c call here (layer.c calls it with up to kernels.MAX_ROWS rows)
# Up to this many rows the kernel, streaming the packed weight once per QGEMV_ROWS rows, beats writing
# a full-precision copy of it first (int4 3072 x 576, 1 thread, AMD EPYC: 40 rows 7.7 vs 11.9 ms,
# 64 rows 7.2 vs 10.8 ms, 128 rows 20.6 vs 17.7 ms): a drafter's catch-up after a few plain steps.
CHUNKED_ROWS = 3 * QGEMV_ROWS
_lib = None
_load_error: str | None = None


def qkernel():
    """The compiled qgemv.c, or None (no compiler, not x86, SPECDEC_KERNELS=0)."""
    global _lib, _load_error
    if _lib is None and _load_error is None:
        lib, _load_error = kernels.load_kernels()
        if lib is not None:
            ptrs, i64 = [ctypes.c_void_p] * 6, [ctypes.c_int64] * 4
            for fn in (lib.specdec_qlinear_i8, lib.specdec_qlinear_i4):
                fn.argtypes, fn.restype = ptrs + i64, ctypes.c_int
            lib.specdec_dequant.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            lib.specdec_dequant.restype = None
            _lib = lib
    return _lib


def qkernel_status() -> str:
    lib = qkernel()
    if lib is None:
        return f"torch dequantize + matmul ({_load_error})"
    return "qgemv.c (AVX2; int4-g32 on AVX512-VNNI)" if lib.specdec_qlinear_quad() else "qgemv.c (AVX2)"


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


class QuantizedWeight(StoredWeight):
    """A packed [N, K] weight (see specdec.quant.schemes) that computes x @ W^T itself."""

    def __init__(self, p: Packed, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("qweight", p.qweight)
        self.register_buffer("scales", p.scales)
        self.register_buffer("zeros", p.zeros)
        self.bits, self.group_size, self._in_features = p.bits, p.group_size, p.in_features
        self.compute_dtype = compute_dtype  # the activations' dtype (what model.dtype reports)

    @property
    def packed(self) -> Packed:
        return Packed(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.in_features)

    in_features = property(lambda self: self._in_features)  # qweight packs it (int4: two per byte)

    def extra_repr(self) -> str:
        return (f"int{self.bits}, group_size={self.group_size}, {self.out_features}x{self.in_features}, "
                f"{'asymmetric' if self.zeros is not None else 'symmetric'}")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        # torch's int4 kernel computes in bf16: other activations (fp32, fp16) take the dequantized matmul
        fast = self._cuda_int4() if x.is_cuda and self.bits == 4 and x.dtype is torch.bfloat16 else None
        if fast is not None:
            y = fast(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias.to(y.dtype)
        rows = x.numel() // x.shape[-1]
        lib = None
        if (x.device.type == "cpu" and x.dtype is torch.float32 and rows <= CHUNKED_ROWS
                and x.shape[-1] == self.in_features and self.qweight.device.type == "cpu"
                and (bias is None or (bias.device.type == "cpu" and bias.shape == (self.out_features,)))
                and not (torch.is_grad_enabled() and x.requires_grad)):
            lib = qkernel()  # (else the dequantized matmul, which raises where the shapes do not fit)
        if lib is None:
            return F.linear(x, self.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
        x = x.contiguous()
        bias = None if bias is None else bias.float().contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        if rows == 0:  # (no rows to view)
            return y
        fn = lib.specdec_qlinear_i4 if self.bits == 4 else lib.specdec_qlinear_i8
        x2, y2 = x.view(rows, -1), y.view(rows, -1)
        for r0 in range(0, rows, QGEMV_ROWS):  # each row's result is independent of the others
            n = min(QGEMV_ROWS, rows - r0)
            if fn(x2[r0].data_ptr(), self.qweight.data_ptr(), self.scales.data_ptr(), _ptr(self.zeros), _ptr(bias),
                  y2[r0].data_ptr(), n, self.in_features, self.out_features, self.group_size) != 0:
                raise MemoryError("quantized matmul kernel: out of memory for the quantized activations")
        return y

    def _cuda_int4(self) -> CudaInt4 | None:
        """torch's int4 kernel for this weight on its GPU, converted once per device (None: not usable)."""
        if getattr(self, "_int4_device", None) != self.qweight.device:
            self._int4, self._int4_device = CudaInt4.build(self.packed), self.qweight.device
        return self._int4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The fp matrix [N, K] (the kernel's own arithmetic on CPU, the torch reference elsewhere)."""
        lib = qkernel() if self.device.type == "cpu" else None
        if lib is None:
            return dequantize(self.packed, dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        lib.specdec_dequant(self.bits, self.qweight.data_ptr(), self.scales.data_ptr(), _ptr(self.zeros),
                            out.data_ptr(), self.in_features, self.out_features, self.group_size)
        return out.to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ids [...] -> [..., K] (an embedding lookup)."""
        flat = ids.reshape(-1)
        return dequantize(self.packed.rows(flat), self.compute_dtype).view(*ids.shape, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)


class QLinear(torch.nn.Module):
    """A Linear whose weight is packed; `linear(x, m.weight, m.bias)` works on it as on nn.Linear."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x, self.bias)


class QEmbedding(torch.nn.Module):
    """An embedding table read from a packed matrix (shared with a tied lm_head)."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids)
