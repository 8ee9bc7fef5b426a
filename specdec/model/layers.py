"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings (incl. llama3 scaling), masks."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.kernels import linear, rms_norm

# SDPA's backends on CUDA, cuDNN's left out: it builds an execution plan for every new shape, and a decode
# step brings a new key length every time (H200, torch 2.11: eager decoding at ~15 tok/s where the same
# steps ran at ~80 once their shapes had been seen; session 25)
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(torch.nn.Module):
    """Llama's (Qwen's, Mistral's): fp32 activations through our kernel; others as transformers' LlamaRMSNorm
    rounds them: the normalized x rounded to x's dtype, then times the weight in that dtype (computed in fp32 and
    rounded once, 9,475 of 64 x 576 bf16 outputs were 1 ulp off it). Gemma's rounds once (gemma3.GemmaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32:
            return rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class Rotary(torch.nn.Module):
    """cos/sin tables for every position up to max_len, gathered by explicit positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_len, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        # rotate_half(x) * sin == cat(x2, x1) * sin_signed, with the first half of sin negated
        sin = emb.sin()
        sin[:, : head_dim // 2] *= -1
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, 1, T, D]
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; rotate_half layout (HF), the GGUF loader un-permutes llama.cpp's layout.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def sdpa_backends(device: torch.device):
    """A context in which SDPA on `device` (CUDA) uses _CUDA_SDPA's backends (e.g. around a transformers
    model's decode loop); a no-op elsewhere."""
    return sdpa_kernel(_CUDA_SDPA) if torch.device(device).type == "cuda" else contextlib.nullcontext()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         is_causal: bool = False, enable_gqa: bool = False, scale: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA through the backends of _CUDA_SDPA only (inference: training's
    shapes repeat, and its backward keeps torch's choice, which trained the shipped head)."""
    with sdpa_backends(q.device) if not torch.is_grad_enabled() else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D] (grouped-query: query head h reads kv head
    h // (Hq / Hkv)) under a bool mask [T, S] (or per row, [B, T, S]). Each kv head's query group is folded
    into the query rows, [B, Hkv, G T, D], so no kv head is copied (SDPA's kernels that take a mask want
    equal head counts, and expanding the cache would copy it G times a layer). -> [B, Hq, T, D]"""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    mask = mask.repeat(G, 1) if mask.dim() == 2 else mask.repeat(1, G, 1)[:, None]  # [G T, S] / [B, 1, G T, S]
    out = sdpa(q.reshape(B, k.shape[1], G * T, D), k, v, mask)  # [B, Hkv, G T, D]
    return out.reshape(B, Hq, T, D)


def build_attention_mask(past_len: int, block_mask: torch.Tensor | None, num_new: int,
                         device) -> torch.Tensor | None:
    """Boolean mask [T, past_len + T]: every new token sees the whole prefix, plus `block_mask`
    among the new tokens (causal when None; a tree mask for token trees). None when T == 1."""
    if block_mask is None:
        if num_new == 1:
            return None
        block_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    prefix = torch.ones(num_new, past_len, dtype=torch.bool, device=device)
    return torch.cat((prefix, block_mask.to(device=device, dtype=torch.bool)), dim=1)


def rounded_linear(x: torch.Tensor, weight, bias, dtype: torch.dtype | None) -> torch.Tensor:
    """linear(x, weight, bias) with its input and output rounded to `dtype` (None: as is): a bf16 model's
    prompt pass (LlamaModel.prefill_matmul_dtype) on oneDNN's bf16 matmul, whose rows come out bitwise the
    same at any row count on bf16 CPUs without AMX (not with it: quant/bf16.py onednn_prompt_rows_invariant)."""
    if dtype is None:
        return linear(x, weight, bias)
    return linear(x.to(dtype), weight, bias).to(x.dtype)
