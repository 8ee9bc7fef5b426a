"""Group-wise weight-only quantization schemes (int8, int4) and round-to-nearest (RTN).

A weight W [N, K] is cut along K into groups of G columns (G a multiple of 32; the last group of
a row may be shorter). Group g of row n has an fp16 scale s and, when asymmetric, an fp16 zero z:

    w ~= q * s + z      symmetric:  q in [-(2^(b-1) - 1), 2^(b-1) - 1], z = 0, s = max|w| / qmax
                        asymmetric: q in [0, 2^b - 1], z = min(w), s = (max(w) - min(w)) / qmax

(z is the float zero point in weight units, as in torch's int4pack and llama.cpp's Q4_1 "min").
s is rounded to fp16 (upwards unless within 2^-16 of it) so q does not clip:
|w - deq(w)| <= s / 2 + |min(w) - z|.
Storage, which the kernels (specdec/kernels/qgemv.c) read, in blocks of 32 columns per row:
    int8: q int8 (symmetric) or uint8 (asymmetric) [N, K]; in each block, byte 4i + c holds column
          8c + i (so one 32-byte load splits into four 8-column vectors with shifts alone);
    int4: q uint8 [N, K/2], two nibbles per byte (unsigned; symmetric int4 stores q + 8, z = -8 s);
          in each block, byte j holds column j (low nibble) and column j + 16 (high nibble).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import ConfigError

BLOCK = 32  # int4 packing block; every group is a multiple of it


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ConfigError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.group_size < BLOCK or self.group_size % BLOCK or self.group_size > 4096:
            raise ConfigError(f"group size must be a multiple of {BLOCK} in [32, 4096], got {self.group_size}")

    @classmethod
    def named(cls, name: str, group_size: int = 128, symmetric: bool | None = None) -> "QuantScheme":
        """'int8' (symmetric by default) or 'int4' (asymmetric by default)."""
        bits = {"int8": 8, "int4": 4}.get(name)
        if bits is None:
            raise ConfigError(f"unknown quantization scheme {name!r}; choose int8, int4 or fp8")
        return cls(bits, group_size, bits == 8 if symmetric is None else symmetric)

    @property
    def name(self) -> str:
        return f"int{self.bits}-g{self.group_size}{'-sym' if self.symmetric else ''}"

    def to_dict(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}


@dataclass
class Packed:
    """A quantized [N, K] matrix in the storage format above."""

    qweight: torch.Tensor  # [N, K] int8/uint8 (8 bits) or [N, K/2] uint8 (4 bits)
    scales: torch.Tensor  # [N, ng] fp16, ng = ceil(K / G)
    zeros: torch.Tensor | None  # [N, ng] fp16, None when symmetric int8
    bits: int
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def rows(self, index: torch.Tensor | slice) -> "Packed":
        """The packed rows `index` (groups run along K, so rows are independent)."""
        return Packed(self.qweight[index], self.scales[index], None if self.zeros is None else self.zeros[index],
                      self.bits, self.group_size, self.in_features)


def _grouped(w: torch.Tensor, G: int) -> torch.Tensor:
    """[N, K] -> [N, ng, G]; a short last group is padded with copies of its first column, which
    changes neither its min, max nor max|w|."""
    N, K = w.shape
    ng = -(-K // G)
    if K % G == 0:
        return w.view(N, ng, G)
    idx = torch.arange(ng * G, device=w.device)
    idx[K:] = (ng - 1) * G
    return w[:, idx].view(N, ng, G)


def _fp16_at_least(s: torch.Tensor) -> torch.Tensor:
    """fp16 s16 ~ s, never so far below s that the top of a group's range would clip by more than
    a rounding step (below by < 2^-16 relative costs <= qmax * 2^-16 < 0.004 steps); 0 -> 1.
    The slack keeps a scale that is exactly fp16 (a GGUF Q4_1 model's) exact."""
    s16 = s.half()
    low = s16.float() < s * (1 - 2.0 ** -16)
    s16 = torch.where(low, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    return torch.where(s16 == 0, torch.ones_like(s16), s16)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] bytes: per block of 32 columns, byte j = col j | col j+16 << 4."""
    N, K = q.shape
    blocks = q.to(torch.uint8).view(N, K // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] uint8 values 0..15 (inverse of pack_int4)."""
    N, half = packed.shape
    b = packed.view(N, half // (BLOCK // 2), BLOCK // 2)
    return torch.stack((b & 15, b >> 4), dim=2).reshape(N, 2 * half)


def interleave_int8(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K] with byte 4i + c of each 32-block = column 8c + i."""
    N, K = q.shape
    return q.view(N, K // BLOCK, 4, 8).transpose(2, 3).reshape(N, K)


def deinterleave_int8(q: torch.Tensor) -> torch.Tensor:
    """Inverse of interleave_int8."""
    N, K = q.shape
    return q.view(N, K // BLOCK, 8, 4).transpose(2, 3).reshape(N, K)


def quantize(w: torch.Tensor, scheme: QuantScheme) -> Packed:
    """Round-to-nearest group-wise quantization of w [N, K] (K % 32 == 0)."""
    N, K = w.shape
    if K % BLOCK:
        raise ConfigError(f"cannot quantize a matrix with {K} columns: needs a multiple of {BLOCK}")
    G = scheme.group_size
    wg = _grouped(w.detach().float(), G)  # [N, ng, G]
    if scheme.symmetric:
        qmax = 2 ** (scheme.bits - 1) - 1
        s16 = _fp16_at_least(wg.abs().amax(-1) / qmax)  # [N, ng]
        q = torch.round(wg / s16.float()[..., None]).clamp(-qmax, qmax)
        z16 = None
        if scheme.bits == 4:  # stored unsigned: q + 8, w = (q + 8) * s - 8 s
            q, z16 = q + 8, (-8.0 * s16.float()).half()
    else:
        qmax = 2 ** scheme.bits - 1
        lo, hi = wg.amin(-1), wg.amax(-1)
        s16, z16 = _fp16_at_least((hi - lo) / qmax), lo.half()
        q = torch.round((wg - z16.float()[..., None]) / s16.float()[..., None]).clamp(0, qmax)
    q = q.reshape(N, -1)[:, :K]
    if scheme.bits == 4:
        qweight = pack_int4(q.to(torch.uint8))
    else:
        qweight = interleave_int8(q.to(torch.int8 if scheme.symmetric else torch.uint8))
    return Packed(qweight.contiguous(), s16.contiguous(), None if z16 is None else z16.contiguous(),
                  scheme.bits, G, K)


def dequantize(p: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The readable reference: w[n, k] = q[n, k] * s[n, k // G] + z[n, k // G], [N, K]."""
    q = unpack_int4(p.qweight) if p.bits == 4 else deinterleave_int8(p.qweight)
    cols = torch.arange(p.in_features, device=q.device) // p.group_size
    w = q.float() * p.scales.float()[:, cols]
    if p.zeros is not None:
        w = w + p.zeros.float()[:, cols]
    return w.to(dtype)



def kernel_reference(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """What qgemv.c computes, readable and in float64: y = xq @ (W - Z)^T + x @ Z^T, with xq the block-
    quantized activations and Z the zero each weight's integer is offset by (0 for symmetric int8; z for
    int4; z + 128 s for unsigned int8, whose integers enter the dot product as q - 128), so the zero
    term uses the exact activations."""
    w = dequantize(p).double()
    cols = torch.arange(p.in_features) // p.group_size
    zeros = torch.zeros_like(w) if p.zeros is None else p.zeros.double()[:, cols]
    if p.bits == 8 and p.zeros is not None:
        zeros = zeros + 128 * p.scales.float().double()[:, cols]
    return quantize_activations(x).double() @ (w - zeros).T + x.double() @ zeros.T


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the decode kernels (qgemv.c) multiply the weights with: each row of x [..., K] in blocks of
    32, d = max|x| / 127, x ~ d * round_half_even(x / d); returned dequantized (readable reference)."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(x.shape)


class StoredWeight(torch.nn.Module):
    """A [N, K] weight kept in another format (`qweight`: bf16, fp8, packed int8/int4) that computes
    x @ W^T itself, in `compute_dtype`; what the model code reads of a weight tensor: its shape, dtype
    (the activations'), device. Subclasses provide linear(x, bias) and, if qweight is not [N, K],
    in_features."""

    compute_dtype: torch.dtype
    out_features = property(lambda self: self.qweight.shape[0])
    in_features = property(lambda self: self.qweight.shape[1])
    shape = property(lambda self: torch.Size((self.out_features, self.in_features)))
    dtype = property(lambda self: self.compute_dtype)
    device = property(lambda self: self.qweight.device)
