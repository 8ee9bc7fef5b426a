"""The EAGLE draft head's decoder layer and its pieces (attention, MLP, RMSNorm), with the stacked
matrices drafting multiplies by (stacked_weight): q/k/v and gate/up as one matmul each, bf16 where the
head was saved in bf16. The head around it (fc, norm, LM head, vocabulary maps) is heads.EagleHead."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.kernels import linear, rms_norm, silu_mul
from specdec.model.layers import apply_rotary, sdpa
from specdec.quant.bf16 import Bf16Weight

if TYPE_CHECKING:
    from specdec.proposers.heads import HeadConfig


class _Attention(torch.nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = torch.nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        # x: [B, T, in] -> q [B, Hq, T, D], k, v [B, Hkv, T, D] (rotary applied)
        B, T, _ = x.shape
        if torch.is_grad_enabled():
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # drafting: one matmul for the three
            sizes = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
            q, k, v = linear(x, stacked_weight(self, ("q_proj", "k_proj", "v_proj"))).split(sizes, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q, k, v, mask):
        # k, v: [B, Hkv, S, D]; mask [T, S] bool -> [B, T, H]
        return self.project(sdpa(q, k, v, mask, enable_gqa=True))

    def project(self, out):
        # out [B, Hq, T, D] -> o_proj -> [B, T, H]
        B, _, T, _ = out.shape
        return linear(out.transpose(1, 2).reshape(B, T, -1), stacked_weight(self, ("o_proj",)))


class _MLP(torch.nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, stacked_weight(self, ("gate_proj", "up_proj")))  # [..., 2I]
        return linear(silu_mul(gate_up), stacked_weight(self, ("down_proj",)))


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if not torch.is_grad_enabled():
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class EagleLayer(torch.nn.Module):
    """The draft decoder layer. eagle3: attention over [norm(embed); norm(hidden)] (2H);
    eagle: input already fused by fc (H), no input norm (as upstream EAGLE-1)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.eagle3 = cfg.kind == "eagle3"
        H = cfg.hidden_size
        self.self_attn = _Attention(cfg, 2 * H if self.eagle3 else H)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if self.eagle3:
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)

    def attn_input(self, embeds, hidden):
        # embeds, hidden: [B, T, H] -> (attention input, residual)
        if self.eagle3:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1), hidden
        return hidden, hidden

    def finish(self, residual, attn_out):
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


def stacked_weight(module: torch.nn.Module, names: tuple[str, ...]):
    """The weights of module's linears `names` stacked by output rows, [sum of N, K], for drafting: one
    matmul for several (q/k/v, gate/up), each output the same sum as its own linear's in the C kernels.
    Stored as bfloat16 when every value is one (a head saved in bf16, as the shipped ones are): widened
    exactly in the kernel, so the same result from half the bytes. Built once, rebuilt when a weight
    moves or is updated in place (training)."""
    parts = [getattr(module, n).weight for n in names]
    if torch.is_grad_enabled():  # training: the parameters themselves, for their gradients
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    key = tuple((p.data_ptr(), p._version) for p in parts)
    built = module.__dict__.setdefault("_draft_weights", {})
    if names not in built or built[names][0] != key:
        w = torch.cat(parts).contiguous() if len(parts) > 1 else parts[0]
        if w.dtype is torch.float32 and w.device.type == "cpu" and torch.equal(w.to(torch.bfloat16).float(), w):
            w = Bf16Weight(w)
        built[names] = (key, w)
    return built[names][1]
