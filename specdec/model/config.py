"""The model's architecture, from a HF config.json: a frozen dataclass checked at construction, so that a
config this runtime would compute unlike transformers (a RoPE type it lacks, biases it has no place for) is
a ConfigError, not a wrong model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.config import ConfigError, read_json_object

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, in HF config.json vocabulary."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2 has q/k/v biases
    qk_norm: bool = False  # qwen3 normalises q and k per head
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # Gemma 3 (specdec/model/gemma3.py); Llama-family models keep the defaults
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    sliding_window: int | None = None  # a local layer's query sees the last `sliding_window` positions
    layer_types: tuple[str, ...] | None = None  # per layer: "sliding_attention" | "full_attention"
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (no scaling there)
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
        bad = [f"{n}={getattr(self, n)!r}" for n in sizes
               if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if bad:
            raise ConfigError(f"model sizes must be positive integers: {', '.join(bad)}")
        if not _positive(self.rms_norm_eps) or not (self.final_logit_softcapping is None
                                                    or _positive(self.final_logit_softcapping)):
            raise ConfigError(f"rms_norm_eps must be a positive number and final_logit_softcapping a positive number "
                              f"or null, got {self.rms_norm_eps!r} and {self.final_logit_softcapping!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHS))}"
            )
        model_type = SUPPORTED_ARCHS[arch]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 folds theta and scaling in here
        eos = tuple(token_ids(cfg.get("eos_token_id")))
        fields = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            # (transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads)
            head_dim=cfg.get("head_dim") or (128 if model_type == "qwen3" else cfg["hidden_size"] // heads),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2",  # transformers: Qwen2's q/k/v always have a bias
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )
        if model_type != "gemma3" and cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # (the MLP is SiLU's)
            raise ConfigError(f"{model_type}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if model_type != "qwen2" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            # transformers' Llama puts attention_bias on o_proj too, mlp_bias on the MLP: not in this runtime
            raise ConfigError(f"{model_type}: attention_bias / mlp_bias models are not supported")
        _check_rope(fields["rope_theta"], fields["rope_scaling"])
        if model_type == "gemma3":
            fields.update(_gemma3_fields(cfg))
        elif (window := cfg.get("sliding_window", 4096 if model_type == "mistral" else None)) and (
                model_type == "mistral" or cfg.get("use_sliding_window")):
            # every layer attends within the window (Mistral 7B v0.1: 4096, transformers' default where the key
            # is missing; null: none); the loader caps the context there, where the window hides nothing
            # and full attention is the same computation
            fields["sliding_window"] = int(window)
        return cls(**fields)

    @property
    def context_limit(self) -> int:
        """The longest context this runtime computes exactly: a Llama-family model whose every layer
        has a sliding window is run within one window (gemma3 masks its local layers itself)."""
        if self.sliding_window and self.model_type != "gemma3":
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        norms = 4 * h + 2 * self.head_dim if self.model_type == "gemma3" else 2 * h
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + norms
        return L * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _check_rope(theta, scaling) -> None:
    """RoPE settings the runtime computes as transformers does, or a ConfigError naming what is off."""
    if not _positive(theta):
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    needs = {None: (), "default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in needs:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (linear and llama3 are)")
    bad = [k for k in needs[kind] if not _positive(scaling.get(k))]
    if bad:
        raise ConfigError(f"rope_scaling {kind}: {', '.join(bad)} must be positive numbers")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError("rope_scaling llama3: high_freq_factor must exceed low_freq_factor")


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text config keys (old style: rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern; transformers >= 5: rope_parameters per layer type, layer_types)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError("gemma3: attn_logit_softcapping is not supported (Gemma 3 checkpoints have none)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("gemma3: use_bidirectional_attention (an embedding model) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"gemma3: hidden activation {act!r} is not supported (gelu_pytorch_tanh is)")
    if cfg.get("attention_bias"):
        raise ConfigError("gemma3: attention_bias is not supported (Gemma 3 checkpoints have none)")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"gemma3: layer_types must list {n} of sliding_attention/full_attention")
    rope = cfg.get("rope_parameters") or {}
    glob, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = cfg.get("rope_scaling")
    if glob.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in glob.items() if k != "rope_theta"}
    if local.get("rope_type", "default") != "default":
        raise ConfigError("gemma3: RoPE scaling on the sliding layers is not supported")
    theta = glob.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    _check_rope(theta, scaling or None)  # (rope_parameters replaced what from_hf checked)
    _check_rope(local_theta, None)
    window, scale = cfg.get("sliding_window", 4096), cfg.get("query_pre_attn_scalar", 256)  # transformers' defaults
    if not _positive(scale) or not (window is None or (_positive(window) and int(window) == window)):
        raise ConfigError(f"gemma3: query_pre_attn_scalar must be a positive number and sliding_window a positive "
                          f"integer, got {scale!r} and {window!r}")
    return {
        "rope_theta": theta,
        "rope_scaling": scaling or None,
        "rope_local_theta": local_theta,
        "query_pre_attn_scalar": scale,
        "sliding_window": window,
        "layer_types": tuple(types),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "attention_bias": False,
        "qk_norm": True,
        # transformers' Gemma3TextConfig defaults, for configs that leave these out
        "head_dim": cfg.get("head_dim") or 256,
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        "max_position_embeddings": cfg.get("max_position_embeddings", 131_072),
    }


def token_ids(value) -> list[int]:
    """An eos_token_id field (an id or a list of ids) as a list; anything else: none."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def end_token_ids(directory: Path, config: dict) -> list[int]:
    """The ids generation stops at, as transformers' generate reads them: config.json's eos_token_id (`config`)
    and generation_config.json's beside it (some models list their end of turn only there)."""
    ids = token_ids(config.get("eos_token_id"))
    generation = directory / "generation_config.json"
    if generation.is_file():
        ids += token_ids(read_json_object(generation).get("eos_token_id"))
    return list(dict.fromkeys(ids))
