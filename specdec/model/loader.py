"""Find a model (alias, HF directory, GGUF file, or hub id in the local HF cache) and load it.

GGUF files are converted once into `$SPECDEC_CACHE` (default ~/.cache/specdec); later loads read the
converted safetensors directly. Nothing is ever downloaded and no remote code is run.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.config import ConfigError, read_json_object
from specdec.model.config import ModelConfig, end_token_ids
from specdec.model.aliases import ALIASES, DEFAULT_MODEL, alias_file  # noqa: F401 (DEFAULT_MODEL: re-exported)
from specdec.model.llama import LlamaModel
from specdec.model.memory import move_to_huge_pages
from specdec.model.output_dir import new_dir
from specdec.model.registry import architecture

CONVERTER_VERSION = "2"  # bump whenever a conversion's output changes (2: GGUF tokenizers, S44)


@dataclass(frozen=True)
class ModelSource:
    directory: Path  # HF-style dir: config.json, *.safetensors, tokenizer.json
    origin: str  # what the user named (alias, path, hub id)
    kind: str  # "alias", "gguf", "hf-dir", "hub-cache"


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _from_gguf(path: Path, progress: bool) -> Path:
    from specdec.model.gguf import convert_gguf, converted

    out = _gguf_cache_dir(path)
    return out if converted(out) else convert_gguf(path, out, progress=progress)


def _from_hub_cache(repo_id: str) -> Path | None:
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    snaps = hub / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not snaps.is_dir():
        return None
    try:  # the snapshot the main branch points to, as huggingface_hub resolves it; else the newest
        ref = (snaps.parent / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        ref = ""
    if ref.isalnum() and (snaps / ref / "config.json").exists():  # (a commit hash: no path in it)
        return snaps / ref
    for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if (snap / "config.json").exists():
            return snap
    return None


def resolve_model(model: str, progress: bool = True) -> ModelSource:
    if not model or not model.strip():
        raise ConfigError("no model given")
    if model in ALIASES:
        return ModelSource(_from_gguf(alias_file(model), progress), model, "alias")
    try:
        path = Path(model).expanduser()
        is_file = path.is_file()
    except (RuntimeError, OSError) as e:  # ~nosuchuser/..., a name past the file system's length
        raise ConfigError(f"{model[:80]!r}: not a usable model path ({e})") from None
    if is_file:
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"{model}: not a GGUF file or a model directory")
        return ModelSource(_from_gguf(path, progress), model, "gguf")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"{model}: directory has no config.json")
        return ModelSource(path, model, "hf-dir")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        snap = _from_hub_cache(model)
        if snap is not None:
            return ModelSource(snap, model, "hub-cache")
        raise ConfigError(f"{model}: not in the local Hugging Face cache (specdec never downloads; "
                          f"aliases: {', '.join(ALIASES)})")
    raise ConfigError(f"unknown model {model!r} (not an alias, a file or a directory; aliases: {', '.join(ALIASES)})")


def read_config(directory: Path) -> ModelConfig:
    raw = read_json_object(directory / "config.json")
    # the end ids as the tokenizer reads them, generation_config.json's too (the trainer's draft vocabulary keeps
    # them); read before the try below, whose errors name config.json
    eos = end_token_ids(directory, raw)
    try:
        return ModelConfig.from_hf({**raw, "eos_token_id": eos})
    except ConfigError as e:
        raise ConfigError(f"{directory / 'config.json'}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"{directory / 'config.json'}: missing key {e}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ConfigError(f"{directory / 'config.json'}: invalid value ({type(e).__name__}: {e})") from None


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_bf16() -> bool:
    flags = _cpuinfo()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles (Intel Sapphire Rapids on): oneDNN's bf16 GEMM runs on them there,
    summing a row differently at 1-32 rows than at more (specdec/cache/kept_prefix.py)."""
    return "amx_bf16" in _cpuinfo()


def resolve_device(device: str = "auto") -> str:
    """auto: CUDA when available, else CPU. Asking for CUDA without it is an error, not a fallback."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ConfigError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype not in table:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return table[dtype]


def read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's *.safetensors files (never pickles); a ConfigError names a bad file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():  # its shards only (a hub snapshot may also hold a consolidated copy of every weight)
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(f"{index}: no weight_map of tensor names to files")
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists() or f.parent.resolve() != directory.resolve()]
        if missing:
            raise ConfigError(f"{index} names shards that are not in {directory}: {missing[:3]}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = list(directory.glob("*.bin"))
        hint = " (only pickle .bin files, which specdec refuses to load)" if bins else ""
        raise ConfigError(f"{directory}: no *.safetensors weights{hint}")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises SafetensorError and others on corrupt files
            raise ConfigError(f"corrupt weights file {f}: {e}") from None
    return tensors


def in_model_dtypes(model: torch.nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """sd cast to `dtype`, but for the parameters of modules that keep fp32 (`keeps_fp32`: Gemma's norms)."""
    fp32 = {f"{name}.{p}" if name else p for name, m in model.named_modules() if getattr(m, "keeps_fp32", False)
            for p, _ in m.named_parameters(recurse=False)}
    return {k: v.to(torch.float32 if k in fp32 else dtype) for k, v in sd.items()}


def check_shapes(model: torch.nn.Module, sd: dict[str, torch.Tensor], directory) -> None:
    """A ConfigError unless every weight has the shape the config gives (a vocab_size that is not the
    embedding's rows, q/k/v of other widths were a RuntimeError from load_state_dict)."""
    expected = model.state_dict()
    for k, v in sd.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise ConfigError(f"{directory}: {k} is {list(v.shape)}, the config says {list(expected[k].shape)}")


def hf_to_specdec(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict, by the architecture's map (specdec/model/registry.py)."""
    return architecture(cfg).from_hf(hf, cfg)


def specdec_to_hf(model, layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Our weights under HF names; `layers` keeps a subset (renumbered), e.g. for a truncated draft."""
    return architecture(model.config).to_hf(model, layers)


def context_length(cfg: ModelConfig, max_len: int | None, directory: Path) -> int:
    """The context to allocate: max_len (default: up to 8192) within what the model computes exactly."""
    limit = cfg.context_limit
    if max_len is not None and max_len < 2:  # a prompt token and one generated
        raise ConfigError(f"max_model_len must be >= 2, got {max_len}")
    if max_len and max_len > limit and limit < cfg.max_position_embeddings:
        raise ConfigError(f"{directory}: a context of {max_len} tokens exceeds the model's sliding window "
                          f"({limit}); sliding-window attention past it is not supported for {cfg.model_type}")
    return min(max_len or min(limit, 8192), limit)


def load_model(directory: Path, dtype: torch.dtype = torch.float32, max_len: int | None = None,
               device: str = "cpu") -> LlamaModel:
    from specdec.quant.io import is_quantized, load_quantized  # `specdec quantize` output (int8/int4)
    if is_quantized(directory):
        return load_quantized(directory, dtype, max_len, device)
    cfg = read_config(directory)
    # bf16 on a CPU: bf16 weights, fp32 activations and sums (specdec/quant/bf16.py): converted after loading
    cpu_bf16 = dtype is torch.bfloat16 and device == "cpu"
    dtype = torch.float32 if cpu_bf16 else dtype
    max_len = context_length(cfg, max_len, directory)
    arch = architecture(cfg)
    with torch.device("meta"):
        model = arch.model_cls(cfg, max_len)
    try:
        sd = arch.from_hf(read_safetensors_dir(directory), cfg)
    except KeyError as e:
        raise ConfigError(f"{directory}: weights missing tensor {e}") from None
    except RuntimeError as e:  # q/k/v or gate/up of shapes that do not join (from_hf concatenates them)
        raise ConfigError(f"{directory}: weights of inconsistent shapes ({str(e).splitlines()[0][:160]})") from None
    check_shapes(model, sd, directory)
    model.load_state_dict(in_model_dtypes(model, sd, dtype), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    arch.init_rotary(model, max_len)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ConfigError(f"{directory}: weights missing for {missing[:3]}")
    model = model.to(device).eval()
    if cpu_bf16:
        from specdec.quant.bf16 import to_cpu_bf16
        to_cpu_bf16(model)
    if model.device.type == "cpu":
        move_to_huge_pages(model)
    return model


def save_model_dir(model: LlamaModel, src: Path, out: Path, layers: list[int] | None = None,
                   extra_files: dict[str, str] | None = None) -> Path:
    """Write `model` (or a layer subset) as a HF directory, copying tokenizer files from `src`, plus
    extra_files (name -> text: a draft's specdec_draft.json): written beside `out`, then renamed over it (a
    crash mid-save left new weights beside an old or missing config.json)."""
    with new_dir(out, replace=True) as tmp:
        _write_model_dir(model, Path(src), tmp, layers)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out)


def _write_model_dir(model: LlamaModel, src: Path, out: Path, layers: list[int] | None) -> None:
    raw = json.loads((src / "config.json").read_text())
    if layers is not None:
        raw["num_hidden_layers"] = len(layers)
        if model.config.layer_types is not None:  # gemma3: kept layers keep their attention type
            raw["layer_types"] = [model.config.layer_types[i] for i in layers]
    # clone: the weights may be views into one arena (memory.py), which safetensors would refuse
    tensors = {k: v.detach().clone() for k, v in specdec_to_hf(model, layers).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            (out / name).write_text((src / name).read_text())
