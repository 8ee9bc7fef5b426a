"""Convert a llama, qwen2, qwen3 or gemma3 GGUF file into a HF-style model directory (once, cached).

Weights are dequantized with the `gguf` package's readers (F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q4_1,
Q4_K, Q6_K, ...). llama: q/k projections are un-permuted from llama.cpp's interleaved rotary layout
back to HF's rotate-half layout (llama.cpp permutes only its llama architecture). gemma3: llama.cpp
stores every RMSNorm weight as 1 + w (Gemma3RMSNorm scales by 1 + w), so 1 is subtracted back, as
transformers' GGUF loader does; q/k are not permuted. The vocabulary becomes a `tokenizers`
tokenizer.json (specdec/model/gguf_tokenizer.py). The result (config.json, model.safetensors or, past
SHARD_BYTES of fp32, shards with an index, tokenizer.json, tokenizer_config.json) is written to a temporary
directory and renamed into place, so an interrupted conversion never leaves a half cache; tensors are
dequantized a shard at a time, so converting holds one shard in memory, not the whole model in fp32.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specdec.config import ConfigError
from specdec.model.gguf_tokenizer import tokenizer_files

_LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LLAMA_LAYER_NAMES.items() if "bias" not in k and k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_NAMES = {"llama": _LLAMA_LAYER_NAMES, "qwen2": _LLAMA_LAYER_NAMES, "qwen3": _LLAMA_LAYER_NAMES,
                "gemma3": _GEMMA3_LAYER_NAMES}
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "gemma3": "Gemma3ForCausalLM"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: [(h, 2, d/2)] interleave -> rotate-half rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _hf_config(reader, arch: str, n_tensors: dict) -> dict:
    p = f"{arch}."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in n_tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    kind = _field(reader, p + "rope.scaling.type")
    scaled = kind not in (None, "none") and _field(reader, p + "rope.scaling.factor") not in (None, 1.0)
    if arch != "gemma3" and (scaled or "rope_freqs.weight" in n_tensors):  # (llama.cpp's Llama 3.1+ factors)
        raise ConfigError(f"{arch} GGUF: RoPE scaling is not supported from GGUF (decoding without it would be "
                          "wrong); load the model's Hugging Face directory")
    if arch == "gemma3":
        del cfg["hidden_act"]
        cfg.update(_gemma3_config(reader, cfg))
    return cfg


def _gemma3_config(reader, cfg: dict) -> dict:
    """Gemma 3 keys llama.cpp stores, or hard-codes in its gemma3 loader (llama-model.cpp)."""
    p, n = "gemma3.", cfg["num_hidden_layers"]
    pattern = _field(reader, p + "attention.sliding_window_pattern", 6)  # llama.cpp: set_swa_pattern(6)
    if isinstance(pattern, list):  # per layer, True = sliding
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
    window = _field(reader, p + "attention.sliding_window")
    if window is None:  # no window written: every layer is global
        types = ["full_attention"] * n
    # llama.cpp: 27B (62 layers) scales queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    out = {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window is not None else None,
        "layer_types": types,
        "rope_local_base_freq": float(_field(reader, p + "rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": _field(reader, p + "final_logit_softcapping"),
        "attn_logit_softcapping": None,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    kind, factor = _field(reader, p + "rope.scaling.type"), _field(reader, p + "rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 1.0):
        if kind != "linear":
            raise ConfigError(f"gemma3 GGUF: rope scaling {kind!r} is not supported (linear is)")
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    eot = _token_id(reader, "<end_of_turn>")  # llama.cpp ends generation there too (an EOG token)
    if eot is not None and eot != cfg["eos_token_id"]:
        out["eos_token_id"] = [i for i in (cfg["eos_token_id"], eot) if i is not None]
    return out


def _token_id(reader, text: str) -> int | None:
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return tokens.index(text) if text in tokens else None


def _hf_name(name: str, arch: str) -> str:
    """A GGUF tensor's name -> its HF name; a ConfigError for one the converter does not know."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_NAMES[arch]:
            return f"model.layers.{idx}.{_LAYER_NAMES[arch][rest]}"
    raise ConfigError(f"unsupported GGUF tensor {name!r}")


def _converted(reader, cfg: dict, arch: str, tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) of each of `tensors` (the reader's), dequantized one at a time."""
    from gguf.quants import dequantize

    for t in tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        name = t.name
        key = _hf_name(name, arch)
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg["num_attention_heads"] if name.endswith(".attn_q.weight") else cfg["num_key_value_heads"]
            w = _unpermute(w, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's converter stored 1 + w
        w = np.ascontiguousarray(w)
        yield key, torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors map the file read-only


def _shards(tensors: list, limit: int) -> list[list]:
    """The tensors in order, cut into runs of at most `limit` fp32 bytes (a larger tensor alone)."""
    shards, size = [[]], 0
    for t in tensors:
        n = 4 * int(t.n_elements)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


# the most fp32 bytes of one safetensors file the conversion writes (and holds in memory at once): a larger
# model goes in shards with an index, as HF's, so converting a 7B GGUF does not hold its 28 GB of fp32
SHARD_BYTES = 2 << 30
_INDEX = "model.safetensors.index.json"


def converted(out_dir: Path) -> bool:
    """Whether out_dir holds a finished conversion (convert_gguf moves one there whole)."""
    return (out_dir / "config.json").exists() and ((out_dir / "model.safetensors").exists()
                                                   or (out_dir / _INDEX).exists())


def _write_weights(reader, cfg: dict, arch: str, out: Path, source: str, progress: bool) -> None:
    """The converted tensors into out: model.safetensors, or shards of at most SHARD_BYTES and their index,
    each dequantized, written and let go before the next (a tied LM head is left out)."""
    keep = [t for t in reader.tensors if not (cfg["tie_word_embeddings"] and t.name == "output.weight")]
    shards = _shards(keep, SHARD_BYTES)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    bar = tqdm(total=len(keep), desc="converting GGUF", unit="tensor", disable=not progress)
    for name, shard in zip(names, shards):
        tensors = {}
        for key, tensor in _converted(reader, cfg, arch, shard):
            tensors[key] = tensor
            bar.update()
        save_file(tensors, str(out / name), metadata={"format": "pt", "source": source})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    bar.close()
    if len(shards) > 1:
        total = 4 * sum(int(t.n_elements) for t in keep)
        (out / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def convert_gguf(path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Convert `path` into `out_dir` (atomically). Returns out_dir."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf reader raises several types on corrupt input
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    names = {t.name for t in reader.tensors}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        try:  # metadata or tensors missing or of the wrong kind: one line naming the file
            cfg = _hf_config(reader, arch, names)
            tok_json, tok_cfg = tokenizer_files(lambda key, default=None: _field(reader, key, default), arch)
            _write_weights(reader, cfg, arch, tmp, path.name, progress)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, ZeroDivisionError, NotImplementedError) as e:
            raise ConfigError(f"{path}: incomplete or invalid GGUF metadata or tensors "
                              f"({type(e).__name__}: {e})") from None
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        (tmp / "source.json").write_text(json.dumps({"gguf": str(path), "size": os.path.getsize(path)}))
        if out_dir.exists() and not converted(out_dir):  # a half-written one (before conversions were atomic)
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process converted the same file meanwhile (and may be loading it): its copy is ours
            if not converted(out_dir):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
