"""Architectures by `ModelConfig.model_type`: the decoder class and its HF <-> specdec weight maps.

    arch = architecture(cfg)                 # ARCHITECTURES[cfg.model_type]
    model = arch.model_cls(cfg, max_len)     # same forward interface (and prefill_matmul_dtype) for every class
    sd = arch.from_hf(hf_tensors, cfg)       # HF names -> our state dict (fused q/k/v and gate/up)
    hf = arch.to_hf(model, layers)           # ours -> HF names; `layers` keeps a renumbered subset
    arch.init_rotary(model, max_len)         # RoPE tables (a model built on the meta device has none)

A new family adds a module (e.g. specdec/model/gemma3.py) and one entry here, not branches in llama.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specdec.config import ConfigError
from specdec.model.config import ModelConfig
from specdec.model import gemma3
from specdec.model.layers import Rotary
from specdec.model.llama import LlamaModel


def llama_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF keys to ours and fuse q/k/v and gate/up."""
    sd = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf or not cfg.tie_word_embeddings:  # (a missing untied head: a missing tensor)
        sd["lm_head.weight"] = hf["lm_head.weight"]
    else:
        sd["lm_head.weight"] = hf["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        sd[o + "input_norm.weight"] = hf[p + "input_layernorm.weight"]
        sd[o + "post_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[o + "qkv.weight"] = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        if cfg.attention_bias:
            sd[o + "qkv.bias"] = torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        sd[o + "o_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            sd[o + "q_norm.weight"] = hf[p + "self_attn.q_norm.weight"]
            sd[o + "k_norm.weight"] = hf[p + "self_attn.k_norm.weight"]
        sd[o + "gate_up.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        sd[o + "down.weight"] = hf[p + "mlp.down_proj.weight"]
    return sd


def llama_to_hf(model, layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Our weights under HF names; `layers` keeps a subset (renumbered), e.g. for a truncated draft."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for new, old in enumerate(layers if layers is not None else range(cfg.num_hidden_layers)):
        L, p = model.layers[old], f"model.layers.{new}."
        out[p + "input_layernorm.weight"] = L.input_norm.weight
        out[p + "post_attention_layernorm.weight"] = L.post_norm.weight
        for name, w in zip("qkv", L.qkv.weight.split([q, kv, kv])):
            out[p + f"self_attn.{name}_proj.weight"] = w
        if cfg.attention_bias:
            for name, b in zip("qkv", L.qkv.bias.split([q, kv, kv])):
                out[p + f"self_attn.{name}_proj.bias"] = b
        out[p + "self_attn.o_proj.weight"] = L.o_proj.weight
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = L.q_norm.weight
            out[p + "self_attn.k_norm.weight"] = L.k_norm.weight
        gate, up = L.gate_up.weight.chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = L.down.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def llama_init_rotary(model, max_len: int) -> None:
    cfg = model.config
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len)


@dataclass(frozen=True)
class Architecture:
    model_cls: type
    from_hf: Callable[[dict, ModelConfig], dict]
    to_hf: Callable[..., dict]
    init_rotary: Callable[[torch.nn.Module, int], None]


LLAMA = Architecture(LlamaModel, llama_from_hf, llama_to_hf, llama_init_rotary)
GEMMA3 = Architecture(gemma3.Gemma3Model, gemma3.from_hf, gemma3.to_hf, gemma3.init_rotary)
ARCHITECTURES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gemma3": GEMMA3}


def architecture(cfg: ModelConfig) -> Architecture:
    if cfg.model_type not in ARCHITECTURES:
        raise ConfigError(f"no decoder for model type {cfg.model_type!r}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[cfg.model_type]
