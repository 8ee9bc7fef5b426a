"""Quantized models on disk: an HF-style directory (config.json with a `quantization_config`,
model.safetensors, tokenizer files) that `specdec.model.loader.load_model` recognises.

Tensor names are HF's, with each quantized projection stored as three tensors:
    model.layers.0.self_attn.q_proj.qweight   int8/uint8 [N, K] (8 bits) or uint8 [N, K/2] (4 bits)
    model.layers.0.self_attn.q_proj.scales    fp16 [N, ceil(K / G)]
    model.layers.0.self_attn.q_proj.zeros     fp16 [N, ceil(K / G)] (absent when symmetric int8)
(layout in specdec/quant/schemes.py), or, FP8 (specdec/quant/fp8.py), as two:
    model.layers.0.self_attn.q_proj.qweight   float8_e4m3fn [N, K]
    model.layers.0.self_attn.q_proj.scales    fp32 [N]
A tied embedding is stored once, quantized, as model.embed_tokens.*; norms, biases and any matrix
left in full precision keep `.weight`/`.bias`.
    "quantization_config": {"quant_method": "specdec", "format_version": 1, "bits": 4,
                            "group_size": 128, "symmetric": false, "method": "awq",
                            "lm_head": {"bits": 8, "group_size": 32, "symmetric": true}}
(an FP8 scheme reads {"format": "fp8_e4m3", "weight_scales": "per_channel", "activation_scales": "per_token"}).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.config import ConfigError, read_json_object
from specdec.model.layers import Rotary
from specdec.model.llama import LlamaModel
from specdec.model.loader import check_shapes, read_safetensors_dir
from specdec.model.output_dir import new_dir
from specdec.quant.fp8 import FP8, Fp8Scheme, Fp8Weight
from specdec.quant.qlinear import QEmbedding, QLinear, QuantizedWeight
from specdec.quant.qmodel import stored_as
from specdec.quant.schemes import BLOCK, Packed, QuantScheme

FORMAT_VERSION = 1
QUANT_METHOD = "specdec"
# our fused module -> the HF projections it holds (rows in this order)
PROJECTIONS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "o_proj": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "down": ("mlp.down_proj",)}


def _raw_config(directory: Path) -> dict:
    return read_json_object(Path(directory) / "config.json")


def require_llama_layout(cfg) -> None:
    """Quantized checkpoints (and AWQ) know the Llama layer layout (two norms per layer) only."""
    if cfg.model_type == "gemma3":
        raise ConfigError("quantized checkpoints support Llama-family models; gemma3 is not supported yet "
                          "(the in-memory qdraft drafter is)")


def is_quantized(directory: Path) -> bool:
    return "quantization_config" in _raw_config(directory)


def _split_rows(model: LlamaModel, name: str) -> list[int]:
    cfg = model.config
    if name == "qkv":
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return [q, kv, kv]
    if name == "gate_up":
        return [cfg.intermediate_size] * 2
    return [getattr(model.layers[0], name).weight.shape[0]]


def _put(out: dict, prefix: str, weight, rows: slice) -> None:
    """One projection (rows of a fused weight) under HF names."""
    if isinstance(weight, QuantizedWeight):
        p = weight.packed.rows(rows)
        out[prefix + ".qweight"], out[prefix + ".scales"] = p.qweight, p.scales
        if p.zeros is not None:
            out[prefix + ".zeros"] = p.zeros
    elif isinstance(weight, Fp8Weight):
        out[prefix + ".qweight"], out[prefix + ".scales"] = weight.qweight[rows], weight.scales[rows]
    else:
        out[prefix + ".weight"] = weight[rows]


def quantized_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    cfg = model.config
    out: dict[str, torch.Tensor] = {"model.norm.weight": model.norm.weight}
    tied_packed = isinstance(model.embed, QEmbedding)
    if tied_packed:
        _put(out, "model.embed_tokens", model.embed.weight, slice(None))
    else:
        out["model.embed_tokens.weight"] = model.embed.weight
        if not cfg.tie_word_embeddings or isinstance(model.lm_head, QLinear):
            _put(out, "lm_head", model.lm_head.weight, slice(None))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.input_norm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_norm.weight
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = layer.q_norm.weight, layer.k_norm.weight
        for name, hf_names in PROJECTIONS.items():
            module, start = getattr(layer, name), 0
            for hf, n in zip(hf_names, _split_rows(model, name)):
                _put(out, p + hf, module.weight, slice(start, start + n))
                if module.bias is not None:
                    out[p + hf + ".bias"] = module.bias[start:start + n]
                start += n
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _scheme_as(sch) -> str | None:
    """How `sch` stores a weight, in the names of qmodel.stored_as."""
    if sch is None or isinstance(sch, Fp8Scheme):
        return None if sch is None else sch.name
    if not isinstance(sch, QuantScheme):
        raise ValueError(f"save_quantized: {sch!r} is not an int8/int4 or fp8 scheme")
    return f"int{sch.bits}-g{sch.group_size}"


def save_quantized(model: LlamaModel, src: Path, out: Path, scheme: QuantScheme | Fp8Scheme,
                   head: QuantScheme | Fp8Scheme | None, method: str, extra: dict | None = None) -> Path:
    """Write a quantized model as a directory that load_model() reads; tokenizer files from `src`."""
    require_llama_layout(model.config)
    for module, sch, what in ((model.layers[0].qkv, scheme, "layers"), (model.lm_head, head, "lm_head")):
        stored = stored_as(module.weight)
        if stored != _scheme_as(sch):
            raise ValueError(f"save_quantized: the model's {what} are {stored or 'not quantized'}, not {sch}")
        w = module.weight
        if isinstance(w, QuantizedWeight) and (w.zeros is None) != (sch.bits == 8 and sch.symmetric):
            how = "without" if w.zeros is None else "with"
            raise ValueError(f"save_quantized: the model's {what} are stored {how} zero points, not as {sch} "
                             "(the saved config would not load)")
    raw = _raw_config(src)
    raw["quantization_config"] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
                                  **scheme.to_dict(), "method": method,
                                  "lm_head": None if head is None else head.to_dict(), **(extra or {})}
    tensors = {k: v.detach().clone() for k, v in quantized_state_dict(model).items()}  # arena views: copy
    with new_dir(out) as partial:  # a new directory, renamed into place when whole
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(raw, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(src) / name).exists():
                (partial / name).write_text((Path(src) / name).read_text())
    return Path(out)


def _scheme(d: dict | None, what: str) -> QuantScheme | Fp8Scheme | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"bad quantization_config for {what}: {d!r} is not an object")
    if d.get("format") == "fp8_e4m3":
        return Fp8Scheme()
    symmetric = d.get("symmetric", False)
    if not isinstance(symmetric, bool):  # "false" would read as True
        raise ConfigError(f"bad quantization_config for {what}: symmetric {symmetric!r} is not true or false")
    try:
        return QuantScheme(int(d["bits"]), int(d["group_size"]), symmetric)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"bad quantization_config for {what}: {e}") from None


def _stored_weight(t: dict, prefixes: tuple[str, ...], scheme, K: int, N: int, dtype: torch.dtype):
    """The projections `prefixes` (quantized) concatenated along rows, as a QuantizedWeight or an
    Fp8Weight of N x K; None when stored in full precision. Every stored tensor's type and shape is
    checked: the kernels read them raw (fp32 scales read as fp16, a missing zero point a NULL)."""
    if not all(p + ".qweight" in t for p in prefixes):
        return None
    if scheme is None:
        raise ConfigError(f"{prefixes[0]} is quantized but the config has no scheme for it")
    parts = {suffix: [t.get(p + suffix) for p in prefixes] for suffix in (".qweight", ".scales", ".zeros")}
    for suffix, tensors in parts.items():
        if any(x is not None and x.dim() != (1 if suffix == ".scales" and isinstance(scheme, Fp8Scheme) else 2)
               for x in tensors):
            raise ConfigError(f"{prefixes[0]}{suffix}: a tensor of the wrong rank")
        if len({tuple(x.shape[1:]) for x in tensors if x is not None}) > 1:  # (concatenated along rows)
            raise ConfigError(f"{prefixes[0]}{suffix}: its parts' widths differ")
    cat = lambda suffix: torch.cat(parts[suffix])  # noqa: E731
    if isinstance(scheme, Fp8Scheme):
        q, s = cat(".qweight"), cat(".scales")
        if q.dtype != FP8 or q.shape != (N, K) or s.shape != (N,) or not s.is_floating_point():
            raise ConfigError(f"{prefixes[0]}: stored tensors do not match fp8 e4m3 [{N}, {K}] with per-channel "
                              "scales")
        return Fp8Weight(q, s, dtype)
    bits, G = scheme.bits, scheme.group_size
    if K % BLOCK:  # the kernels read whole blocks of 32 (K = 48: bytes past a row's end; the tail left out)
        raise ConfigError(f"{prefixes[0]}: int{bits} weights of {K} columns, not a multiple of {BLOCK}")
    has_zeros = not (bits == 8 and scheme.symmetric)
    if any((x is not None) != has_zeros for x in parts[".zeros"]):
        raise ConfigError(f"{prefixes[0]}: int{bits} {'with' if has_zeros else 'without'} zero points expected")
    p = Packed(cat(".qweight"), cat(".scales"), cat(".zeros") if has_zeros else None, bits, G, K)
    qtype = torch.int8 if bits == 8 and scheme.symmetric else torch.uint8
    grouped = (N, -(-K // G))
    if (p.qweight.dtype != qtype or p.qweight.shape != (N, K // 2 if bits == 4 else K)
            or p.scales.dtype != torch.float16 or p.scales.shape != grouped
            or (p.zeros is not None and (p.zeros.dtype != torch.float16 or p.zeros.shape != grouped))):
        raise ConfigError(f"{prefixes[0]}: stored tensors do not match int{bits}, group {G}, [{N}, {K}]")
    return QuantizedWeight(p, dtype)


def load_quantized(directory: Path, dtype: torch.dtype = torch.float32, max_len: int | None = None,
                   device: str = "cpu") -> LlamaModel:
    from specdec.model.loader import context_length, read_config

    if device == "cpu" and dtype is torch.bfloat16:
        # on a CPU bf16 is a weight format (load_model); these weights are packed already, and their kernels
        # (qgemv.c) take fp32 activations: bf16 activations fell back to torch, 3.6 vs 114 tok/s on int4
        dtype = torch.float32
    raw, cfg = _raw_config(directory), read_config(directory)
    require_llama_layout(cfg)
    qc = raw["quantization_config"]
    if not isinstance(qc, dict):
        raise ConfigError(f"{directory}/config.json: quantization_config is not an object")
    version = qc.get("format_version", 0)
    if qc.get("quant_method") != QUANT_METHOD or not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(f"{directory}: quantization {qc.get('quant_method')!r} (version "
                          f"{qc.get('format_version')}) is not one specdec reads; make it with `specdec quantize`")
    body, head = _scheme(qc, "layers"), _scheme(qc.get("lm_head"), "lm_head")
    if device == "cpu" and isinstance(body, Fp8Scheme):
        warnings.warn(f"{directory}: fp8 weights on a CPU run torch's emulated FP8 matmul (~15x slower than "
                      f"fp32); fp8 is for GPUs, int8/int4 for CPUs (specdec quantize --scheme int8)", stacklevel=2)
    max_len = context_length(cfg, max_len, directory)
    t = read_safetensors_dir(Path(directory))
    with torch.device("meta"):
        model = LlamaModel(cfg, max_len)
    sd: dict[str, torch.Tensor] = {"norm.weight": t.get("model.norm.weight")}
    H = cfg.hidden_size
    V = cfg.vocab_size
    emb, tie = _stored_weight(t, ("model.embed_tokens",), head, H, V, dtype), False
    if emb is not None:
        model.embed, model.lm_head = QEmbedding(emb), QLinear(emb)
    else:
        sd["embed.weight"] = t.get("model.embed_tokens.weight")
        lm = _stored_weight(t, ("lm_head",), head, H, V, dtype)
        if lm is not None:
            model.lm_head = QLinear(lm)
        elif "lm_head.weight" in t:
            sd["lm_head.weight"] = t["lm_head.weight"]
        else:
            tie = cfg.tie_word_embeddings
            if not tie:
                raise ConfigError(f"{directory}: no lm_head weights")
    for i, layer in enumerate(model.layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        sd[o + "input_norm.weight"] = t.get(p + "input_layernorm.weight")
        sd[o + "post_norm.weight"] = t.get(p + "post_attention_layernorm.weight")
        if cfg.qk_norm:
            sd[o + "q_norm.weight"], sd[o + "k_norm.weight"] = t.get(p + "self_attn.q_norm.weight"), t.get(p + "self_attn.k_norm.weight")
        for name, hf_names in PROJECTIONS.items():
            prefixes = tuple(p + n for n in hf_names)
            has_bias = [x + ".bias" in t for x in prefixes]
            if any(has_bias) != all(has_bias) or any(has_bias) != (getattr(layer, name).bias is not None):
                wants = "a bias for each" if getattr(layer, name).bias is not None else "none"
                raise ConfigError(f"{directory}: {prefixes[0]}: biases stored for {sum(has_bias)} of its "
                                  f"{len(prefixes)} projections; this model has {wants}")  # (one lost: wrong logits)
            bias = torch.cat([t[x + ".bias"] for x in prefixes]) if all(has_bias) else None
            N, K = getattr(layer, name).weight.shape
            if bias is not None and bias.shape != (N,):
                raise ConfigError(f"{directory}: {prefixes[0]}'s bias is {list(bias.shape)}, not [{N}]")
            stored = _stored_weight(t, prefixes, body, K, N, dtype)
            if stored is not None:
                setattr(layer, name, QLinear(stored, None if bias is None else bias.to(dtype)))
                continue
            if not all(x + ".weight" in t for x in prefixes):
                raise ConfigError(f"{directory}: weights missing for {prefixes[0]}")
            sd[o + name + ".weight"] = torch.cat([t[x + ".weight"] for x in prefixes])
            if bias is not None:
                sd[o + name + ".bias"] = bias
    missing = [k for k, v in sd.items() if v is None]
    if missing:
        raise ConfigError(f"{directory}: weights missing for {missing[:3]}")
    check_shapes(model, sd, directory)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=True)
    if tie:
        model.lm_head.weight = model.embed.weight
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len)
    left = [n for n, x in list(model.named_parameters()) + list(model.named_buffers()) if x.is_meta]
    if left:
        raise ConfigError(f"{directory}: weights missing for {left[:3]}")
    return model.to(device).eval()
