"""The Gemma 3 text decoder (Gemma3ForCausalLM, model_type gemma3_text, e.g. Gemma 3 270M).

Same interface as LlamaModel (explicit positions, block/tree masks, layer subsets, output_layers,
input_embeds, KVCache and the paged BatchKV/SeqKV), so every proposer and the engine run it. What
differs from Llama (reference: transformers' models/gemma3/modeling_gemma3.py):
  - embeddings are scaled by sqrt(hidden_size), the factor cast to the model dtype first;
  - RMSNorm scales by (1 + w). Our state dict holds 1 + w (from_hf adds 1, to_hf subtracts it),
    so the plain RMSNorm kernel computes x * rsqrt(mean(x^2) + eps) * (1 + w) as HF does in fp32;
  - four norms per layer: input, post-attention (on the attention output, before the residual
    add), pre-feedforward, post-feedforward (on the MLP output); q/k RMSNorm per head;
  - GELU(tanh)-gated MLP; attention scale query_pre_attn_scalar ** -0.5; head_dim != hidden / heads;
  - `layer_types`: a sliding layer sees keys at positions k > q - sliding_window (HF's
    sliding_window_overlay) and uses RoPE base rope_local_theta without scaling; a full layer uses
    rope_theta with rope_scaling;
  - tied embeddings; an optional final logit softcap, tanh(logits / c) * c (None for Gemma 3).
The window needs each key's sequence position, which a cache gives with key_positions(positions)
[B, L]. While every query position is < sliding_window the window hides nothing, so short contexts
skip the second mask entirely.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from specdec.cache.kv_cache import KVCache, kv_dtype
from specdec.config import ConfigError
from specdec.model.config import ModelConfig
from specdec.kernels import linear, rms_norm
from specdec.model.layers import RMSNorm, Rotary, apply_rotary, rounded_linear, sdpa
from specdec.model.llama import ForwardOutput
from specdec.model.row_attention import RowAttention

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, its weight stored as 1 + w and kept in fp32 at any model dtype (keeps_fp32: the
    loader does not round it; 1 + w in bf16 loses w's low bits where transformers' Gemma3RMSNorm adds the 1
    in fp32): x normalized and scaled in fp32 and rounded once, as Gemma3RMSNorm does ((x * w).to(dtype),
    where Llama's rounds the normalized x first)."""

    keeps_fp32 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32:
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).type_as(x)


class Gemma3Layer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv, H, eps = self.n_heads * self.head_dim, self.n_kv * self.head_dim, cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = GemmaRMSNorm(H, eps)
        self.qkv = torch.nn.Linear(H, q + 2 * kv, bias=False)
        self.q_norm, self.k_norm = GemmaRMSNorm(self.head_dim, eps), GemmaRMSNorm(self.head_dim, eps)
        self.o_proj = torch.nn.Linear(q, H, bias=False)
        self.post_attn_norm = GemmaRMSNorm(H, eps)
        self.pre_ffn_norm = GemmaRMSNorm(H, eps)
        self.gate_up = torch.nn.Linear(H, 2 * cfg.intermediate_size, bias=False)
        self.down = torch.nn.Linear(cfg.intermediate_size, H, bias=False)
        self.post_ffn_norm = GemmaRMSNorm(H, eps)
        self.split = (q, kv, kv)
        self.scale = float(cfg.query_pre_attn_scalar or self.head_dim) ** -0.5

    def forward(self, x, cos, sin, cache, layer_idx: int, mask, matmul_dtype: torch.dtype | None = None):
        # x: [B, T, H]; cache.write stores this block's k/v and returns the visible keys/values;
        # matmul_dtype: the four matmuls' input and output dtype (a bf16 prompt pass; None: x's)
        B, T, _ = x.shape
        dt = matmul_dtype
        q, k, v = rounded_linear(self.input_norm(x), self.qkv.weight, None, dt).split(self.split, dim=-1)
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_norm(k.view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.write(layer_idx, k, v)  # [B, Hkv, past+T, D]
        if isinstance(mask, tuple):  # (RowAttention, window): row by row, as single-token passes
            attn = mask[0].attend(q, k_all, v_all, scale=self.scale, window=mask[1])
        else:
            attn = sdpa(q, k_all, v_all, mask, scale=self.scale, enable_gqa=True)
        attn = attn.transpose(1, 2).reshape(B, T, -1)  # [B, T, Hq D]
        x = x + self.post_attn_norm(rounded_linear(attn, self.o_proj.weight, None, dt))
        gate, up = rounded_linear(self.pre_ffn_norm(x), self.gate_up.weight, None, dt).chunk(2, dim=-1)  # [B, T, I]
        ffn = F.gelu(gate, approximate="tanh") * up  # [B, T, I]
        return x + self.post_ffn_norm(rounded_linear(ffn, self.down.weight, None, dt))


class Gemma3Model(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        if cfg.layer_types is None or len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ConfigError("gemma3: the config needs one layer type per layer")
        self.config = cfg
        self.max_len = max_len or cfg.max_position_embeddings
        self.layer_types = cfg.layer_types
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = torch.nn.ModuleList(Gemma3Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        init_rotary(self, self.max_len)
        self.prefill_matmul_dtype: torch.dtype | None = None  # as LlamaModel's (set by the loader)
        self.kv_cache_dtype: torch.dtype | None = None  # as LlamaModel's

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the embedding's (a packed table reports its compute dtype); the norms keep
        fp32 at any dtype (GemmaRMSNorm.keeps_fp32)."""
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, max_len: int | None = None, batch_size: int = 1) -> KVCache:
        return KVCache.for_model(self.config, min(max_len or self.max_len, self.max_len), kv_dtype(self),
                                 batch_size, self.device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: embeddings * sqrt(hidden), the factor in the model dtype (as HF)."""
        x = self.embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

    def sliding_mask(self, mask, positions: torch.Tensor, cache):
        """The full-attention mask (None, [T, L] or [B, 1, T, L]) narrowed to the window: key k is
        visible to query q only if pos(k) > pos(q) - sliding_window. Returns `mask` itself while no
        query is far enough along for the window to hide anything."""
        W = self.config.sliding_window
        if W is None or int(positions.max()) < W:
            return mask
        key_positions = getattr(cache, "key_positions", None)
        if key_positions is None:
            raise ValueError(f"{type(cache).__name__} does not give key positions, which sliding-window "
                             f"attention needs past {W} tokens")
        kp = key_positions(positions).to(positions.device)  # [B, L]
        inside = (kp[:, None, :] > positions[:, :, None] - W)[:, None]  # [B, 1, T, L]
        return inside if mask is None else mask & inside

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                block_mask: torch.Tensor | None = None, num_logits: int | None = None,
                layers: Sequence[int] | None = None, output_layers: Sequence[int] = (),
                input_embeds: torch.Tensor | None = None, prefill: bool = False) -> ForwardOutput:
        """As LlamaModel.forward; input_embeds (if given) are already scaled (embed_tokens)."""
        matmul_dtype = self.prefill_matmul_dtype if prefill else None
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [B, T, H]
        T = x.shape[1]
        layer_ids = range(len(self.layers)) if layers is None else layers
        kinds = {self.layer_types[i] for i in layer_ids}
        full = cache.attention_mask(block_mask, T)  # paged caches make their own
        rows = RowAttention.build(full, positions, cache, prefill)  # decode / verify: row by row
        if rows is not None:  # each row's window is made as a single-token pass makes it
            masks = {FULL: (rows, None), SLIDING: (rows, self.config.sliding_window)}
        else:
            masks = {FULL: full, SLIDING: self.sliding_mask(full, positions, cache) if SLIDING in kinds else None}
        rope = {kind: (self.rotary if kind == FULL else self.rotary_local)(positions, x.dtype) for kind in kinds}
        kept = {} if output_layers else None
        for i in layer_ids:
            kind = self.layer_types[i]
            x = self.layers[i](x, *rope[kind], cache, i, masks[kind], matmul_dtype)
            if kept is not None and i in output_layers:
                kept[i] = x
        cache.advance(T)
        h = self.norm(x)
        return ForwardOutput(self.logits_of(h if num_logits is None else h[:, -num_logits:]), h, kept)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [..., H] -> logits [..., V] (the LM head, then the optional softcap)."""
        logits = linear(h, self.lm_head.weight)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def init_rotary(model: Gemma3Model, max_len: int) -> None:
    cfg = model.config
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len)  # full layers
    model.rotary_local = Rotary(cfg.head_dim, cfg.rope_local_theta or 10_000.0, None, max_len)  # sliding


# our module -> HF names; every norm here is stored as 1 + w (see the module docstring)
_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
          "pre_ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Gemma3ForCausalLM tensors -> our state dict (fused q/k/v and gate/up, norms as 1 + w)."""
    one = lambda w: w.float() + 1.0  # noqa: E731
    sd = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": one(hf["model.norm.weight"])}
    # a missing untied head is a missing tensor (it was the embedding, silently)
    untied = "lm_head.weight" in hf or not cfg.tie_word_embeddings
    sd["lm_head.weight"] = hf["lm_head.weight"] if untied else hf["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs in _NORMS.items():
            sd[o + ours + ".weight"] = one(hf[p + theirs + ".weight"])
        sd[o + "qkv.weight"] = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        sd[o + "o_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        sd[o + "gate_up.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        sd[o + "down.weight"] = hf[p + "mlp.down_proj.weight"]
    return sd


def to_hf(model: Gemma3Model, layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Our weights under HF names (norms back to w); `layers` keeps a renumbered subset."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    minus = lambda w: (w.float() - 1.0).to(w.dtype)  # noqa: E731
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": minus(model.norm.weight)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for new, old in enumerate(layers if layers is not None else range(cfg.num_hidden_layers)):
        L, p = model.layers[old], f"model.layers.{new}."
        for ours, theirs in _NORMS.items():
            out[p + theirs + ".weight"] = minus(getattr(L, ours).weight)
        for name, w in zip("qkv", L.qkv.weight.split([q, kv, kv])):
            out[p + f"self_attn.{name}_proj.weight"] = w
        out[p + "self_attn.o_proj.weight"] = L.o_proj.weight
        gate, up = L.gate_up.weight.chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = L.down.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
