"""int4 weights through torch's own int4 kernel (torch._weight_int4pack_mm, "tinygemm") on CUDA GPUs.

On a GPU, QuantizedWeight would otherwise dequantize the whole matrix at every call, which costs more
than the bf16 matmul it feeds; this converts a packed int4 weight (specdec/quant/schemes.py) once into
torch's tiled layout and runs one kernel call per linear, bf16 activations in and out:

    ours:  w = q * s + z                 q in 0..15, one (s, z) per group of G columns
    torch: w = (q - 8) * s + zero        so zero = z + 8 s; scales_and_zeros [K / G, N, 2]

The CPU keeps qgemv.c (faster there); torch's CPU variant of the same kernel
(_weight_int4pack_mm_for_cpu) is what the tests run, to check this conversion. The CUDA calls could
not be run in this project's sessions (no GPU was lent), so the first conversion on a GPU checks
itself against the readable dequantization and falls back (with a warning) if they disagree.
"""
from __future__ import annotations

import warnings

import torch

from specdec.quant.schemes import Packed, dequantize, unpack_int4

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel takes
K_TILE, N_TILE = 16, 8


def int4pack_applies(p: Packed) -> bool:
    N, K = p.out_features, p.in_features
    return (p.bits == 4 and p.zeros is not None and p.group_size in GROUP_SIZES and K % p.group_size == 0
            and K % (2 * K_TILE) == 0 and N % N_TILE == 0)


def scales_and_zeros(p: Packed, dtype: torch.dtype) -> torch.Tensor:
    """[K / G, N, 2]: torch's (scale, zero) per group, for w = (q - 8) * scale + zero."""
    s, z = p.scales.float(), p.zeros.float()  # [N, K / G]
    return torch.stack((s, z + 8 * s), dim=-1).transpose(0, 1).contiguous().to(dtype)


def _inner_k_tiles(K: int) -> int:
    return next(t for t in (8, 4, 2) if K % (t * K_TILE) == 0)


def pack_for_cpu(p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's packed weight, scales_and_zeros) for _weight_int4pack_mm_for_cpu (fp32 activations)."""
    q = unpack_int4(p.qweight).to(torch.int32)  # [N, K], 0..15
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros(p, torch.float32)


def pack_for_cuda(p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's packed weight, scales_and_zeros) for _weight_int4pack_mm on CUDA (bf16 activations):
    the kernel reads bytes holding two consecutive columns, the even one in the high nibble."""
    q = unpack_int4(p.qweight)  # [N, K] uint8, 0..15
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(p.in_features))
    return packed, scales_and_zeros(p, torch.bfloat16)


class CudaInt4:
    """The converted weight and its matmul; `build` returns None where it cannot run or disagrees."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, group_size: int):
        self.packed, self.sz, self.group_size = packed, sz, group_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> [M, N] in x's dtype."""
        y = torch._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.sz)
        return y.to(x.dtype)

    @classmethod
    def build(cls, p: Packed) -> "CudaInt4 | None":
        if not int4pack_applies(p):
            return None
        try:
            fast = cls(*pack_for_cuda(p), p.group_size)
            x = torch.randn(3, p.in_features, device=p.qweight.device)
            want = x @ dequantize(p, torch.float32).t()
            got = fast(x.bfloat16()).float()
        except RuntimeError as e:  # this torch build or GPU does not take the layout
            warnings.warn(f"torch int4 kernel unavailable ({str(e).splitlines()[0]}); dequantizing instead",
                          stacklevel=2)
            return None
        if not torch.allclose(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item()):
            warnings.warn("torch int4 kernel disagrees with the dequantized weight; dequantizing instead",
                          stacklevel=2)
            return None
        return fast
