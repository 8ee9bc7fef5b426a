"""FP8 (e4m3) weights for GPUs: per-output-channel weight scales, activations quantized per token at
run time, and the matmul through torch's own kernel (torch._scaled_mm: FP8 tensor cores on Hopper
and Ada GPUs).

    W[n, :] ~= Wq[n, :] * sw[n]     sw[n] = max|W[n, :]| / 448     (448: e4m3's largest finite value)
    x[t, :] ~= xq[t, :] * sx[t]     sx[t] = max|x[t, :]| / 448     (per token, dynamic)
    y[t, n]  = sx[t] * sw[n] * <xq[t, :], Wq[n, :]>  (+ bias)

e4m3 keeps 3 mantissa bits: each stored weight is within 2^-4 of its value (relative), so FP8 is for
targets on GPUs and for the quantized self-draft there (qdraft with extra {"scheme": "fp8"}), whose
drafts the full-precision target verifies (lossless whatever the drafter computes). On a CPU
torch._scaled_mm runs and gives the same numbers, but ~15x slower than an fp32 matmul: the CPU's
schemes are int8/int4 (qgemv.c).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specdec.config import ConfigError
from specdec.quant.schemes import StoredWeight

E4M3_MAX = 448.0
ALIGN = 16  # torch._scaled_mm on GPUs wants both matrix dimensions multiples of 16
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 weights with one scale per output channel; activations scaled per token."""

    @property
    def name(self) -> str:
        return "fp8-e4m3"

    def to_dict(self) -> dict:
        return {"format": "fp8_e4m3", "weight_scales": "per_channel", "activation_scales": "per_token"}


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as e4m3 (round to nearest even), clamped to the finite range (a cast past 448 is NaN)."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (Wq [N, K] e4m3, scales [N] fp32). A zero row gets scale 1 (and zero weights)."""
    if w.dim() != 2:
        raise ConfigError(f"fp8 quantizes matrices, got shape {tuple(w.shape)}")
    amax = w.detach().float().abs().amax(dim=1)
    scales = amax / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero rows, and amax below ~6e-43 (0 / 448)
    return _to_fp8(w.detach(), scales[:, None]), scales


def fp8_applies(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[0] % ALIGN == 0 and w.shape[1] % ALIGN == 0


@lru_cache(maxsize=None)
def check_cuda_fp8(device_index: int) -> None:
    """FP8 matmuls need compute capability 8.9+ (Ada, Hopper and later): a clear error before CUDA's."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device_index)
        raise ConfigError(f"fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+); {name} has "
                          f"{major}.{minor}: use int8/int4, or bf16 without quantization")


class Fp8Weight(StoredWeight):
    """An e4m3 [N, K] weight with per-channel scales that computes x @ W^T itself (as QuantizedWeight does)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        if qweight.dtype != FP8 or scales.shape != qweight.shape[:1]:
            raise ConfigError(f"fp8 weight: want e4m3 [N, K] and fp32 [N] scales, got {qweight.dtype} "
                              f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.float())
        self.compute_dtype = compute_dtype

    @classmethod
    def from_float(cls, w: torch.Tensor, compute_dtype: torch.dtype = torch.float32) -> "Fp8Weight":
        return cls(*quantize_fp8(w), compute_dtype)

    def extra_repr(self) -> str:
        return f"fp8 e4m3, per-channel scales, {self.out_features}x{self.in_features}"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]: x quantized per token, one torch._scaled_mm."""
        if x.is_cuda:
            check_cuda_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())
        x2 = x.reshape(-1, self.in_features)
        sx = x2.detach().float().abs().amax(dim=1, keepdim=True) / E4M3_MAX  # [M, 1]
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        # rowwise scales on CUDA produce bf16 only; the CPU kernel gives the activations' dtype
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        y = torch._scaled_mm(_to_fp8(x2, sx), self.qweight.t(), scale_a=sx, scale_b=self.scales[None, :],
                             out_dtype=out_dtype).to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ids [...] -> [..., K] (an embedding lookup)."""
        flat = ids.reshape(-1)
        out = self.qweight[flat].float() * self.scales[flat, None]
        return out.to(self.compute_dtype).view(*ids.shape, self.in_features)

    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()
