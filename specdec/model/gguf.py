"""Convert a llama-architecture GGUF file into a HF-style model directory (once, cached).

Weights are dequantized with the `gguf` package's readers (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q4_K, Q6_K, ...), q/k projections are un-permuted from llama.cpp's interleaved rotary layout back
to HF's rotate-half layout, and the byte-level BPE vocabulary becomes a `tokenizers` tokenizer.json.
The result (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) is written to a
temporary directory and renamed into place, so an interrupted conversion never leaves a half cache.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specdec.config import ConfigError

_LAYER_NAMES = {
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
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
    return cfg


def _tensors(reader, cfg: dict, arch: str, progress: bool) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ConfigError(f"unsupported GGUF tensor {name!r}")
            key = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
            if arch == "llama" and rest in ("attn_q.weight", "attn_k.weight"):
                heads = cfg["num_attention_heads"] if rest == "attn_q.weight" else cfg["num_key_value_heads"]
                w = _unpermute(w, heads)
        elif name == "rope_freqs.weight":
            continue  # llama3 scaling factors; handled through rope_scaling when present
        else:
            raise ConfigError(f"unsupported GGUF tensor {name!r}")
        out[key] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def _tokenizer_files(reader) -> tuple[dict, dict]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ConfigError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' is)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # Same as SmolLM2's tokenizer.json (llama.cpp pre-tokenizer "smollm"): digits split, GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(special)

    def tok_str(key):
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_cfg = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": tok_str("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_str("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    return json.loads(tok.to_str()), tok_cfg


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
    cfg = _hf_config(reader, arch, names)
    tok_json, tok_cfg = _tokenizer_files(reader)
    tensors = _tensors(reader, cfg, arch, progress)
    if cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        (tmp / "source.json").write_text(json.dumps({"gguf": str(path), "size": os.path.getsize(path)}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
