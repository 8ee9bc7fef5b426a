"""Interchange: draft heads in the checkpoint layouts vLLM and SGLang load, and the serve command line.

    specdec export specdec/assets/smollm2-135m-eagle3 --format sglang --out /tmp/sg-head

Layouts (key names as the upstream loaders read them: vLLM llama_eagle.py / llama_eagle3.py / medusa.py,
SGLang llama_eagle.py / llama_eagle3.py); the two engines differ in places, so the config is per format:
  EAGLE-1  config.json num_hidden_layers 1, architectures ["LlamaForCausalLM"] for vLLM (its EAGLE config
           prefixes "Eagle"), ["LlamaForCausalLMEagle"] for SGLang (which maps nothing); fc.weight [H, 2H]
           over [embed; hidden] (SGLang's fc has a bias: a zero fc.bias is written for it, else its loader
           leaves the bias at its random init); layers.0.self_attn.{q,k,v,o}_proj,
           layers.0.mlp.{gate,up,down}_proj, layers.0.post_attention_layernorm (no input norm). A draft
           vocabulary goes to SGLang as hot_token_ids.pt (its --speculative-token-map); vLLM's EAGLE-1 has
           none and drafts over the whole vocabulary, which the exported config then says.
  EAGLE-3  architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, and the target layers whose outputs
           the head reads, in each engine's own key and convention: vLLM reads the top-level
           eagle_aux_hidden_state_layer_ids as the INPUTS of those layers (our output layer + 1); SGLang
           reads eagle_config.eagle_aux_hidden_state_layer_ids as the OUTPUTS of those layers (SpecForge's
           convention; it adds the 1 itself). fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm,
           post_attention_layernorm}, midlayer.self_attn.* (q/k/v [., 2H]), midlayer.mlp.*, norm.weight,
           lm_head.weight [Vd, H], d2t [Vd] (target id = i + d2t[i]), t2d [V] bool.
  Medusa   architectures ["MedusaModel"], model_type "medusa", num_heads, num_hidden_layers,
           truncated_vocab_size, medusa_fc_bias, original_lm_head; blocks.<i>.layers.0.{weight,bias},
           lm_heads.0.weight (the target LM head, shared), token_map [truncated_vocab_size] (vLLM only;
           SGLang serves no Medusa).
The embedding (and EAGLE-1's LM head) are left out: both engines share the target's when absent.
Every export loads back into specdec as written (own_layout), and so do upstream heads (import_head).
"""
from __future__ import annotations

import json
import pickle  # (its error type only: torch.load's weights_only unpickler raises it on a damaged file)
import shlex
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.config import ConfigError
from specdec.model.output_dir import check_new_dir, new_dir

FORMATS = ("vllm", "sglang")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(cfg, dtype: torch.dtype = torch.float32, fmt: str = "vllm") -> dict:
    """config.json of a head for `fmt` (a head directory of ours: vLLM's): the HF fields the engine reads
    plus our own section."""
    common = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "torch_dtype": _DTYPE_NAMES[dtype]}
    if cfg.kind == "medusa":
        hf = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": cfg.medusa_num_heads,
              "num_hidden_layers": 1, "truncated_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
              "medusa_fc_bias": True, "original_lm_head": True, **common}
    else:
        eagle1 = "LlamaForCausalLMEagle" if fmt == "sglang" else "LlamaForCausalLM"
        hf = {"architectures": ["LlamaForCausalLMEagle3" if cfg.kind == "eagle3" else eagle1],
              "model_type": "llama", "num_hidden_layers": 1, "intermediate_size": cfg.intermediate_size,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
              "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, **common}
        if cfg.kind == "eagle3":
            hf["draft_vocab_size"] = cfg.draft_vocab_size or cfg.vocab_size
            hf["target_hidden_size"] = cfg.hidden_size
            if fmt == "sglang":
                hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
                                      "use_aux_hidden_state": True}
            else:
                hf["eagle_aux_hidden_state_layer_ids"] = [l + 1 for l in cfg.aux_layers]
    hf["specdec"] = cfg.to_dict()
    return hf


def import_head(path: Path, target_config) -> "torch.nn.Module":
    """Load an upstream EAGLE / EAGLE-3 / Medusa checkpoint (no 'specdec' section) for `target_config`."""
    from specdec.proposers.head_io import make_head
    from specdec.proposers.heads import HeadConfig

    raw = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    arch = (raw.get("architectures") or [""])[0]
    if raw.get("model_type") == "medusa" or arch.startswith("Medusa"):
        kind = "medusa"
    elif "Eagle3" in arch:
        kind = "eagle3"
    else:
        kind = "eagle"
    aux = _aux_layers(raw)
    if kind == "eagle3" and not aux:
        L = target_config.num_hidden_layers
        aux = (1, L // 2 - 1, L - 4)  # vLLM's default (2, L//2, L-3), as outputs of the layer before
    vocab = raw.get("vocab_size", target_config.vocab_size)
    hot = _hot_token_ids(path, vocab) if kind == "eagle" else None
    dv = {"eagle3": raw.get("draft_vocab_size"), "medusa": raw.get("truncated_vocab_size"),
          "eagle": None if hot is None else hot.numel()}[kind]
    cfg = HeadConfig.for_target(kind, target_config, 0 if dv in (None, vocab) else dv,
                                raw.get("num_heads", raw.get("medusa_num_heads", 0)), aux)
    head = make_head(cfg)
    sd = own_layout(head, sd, path, raw)
    try:
        missing, unexpected = head.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a tensor shaped unlike this target's head (another hidden size, draft vocabulary)
        raise ConfigError(f"{path}: the checkpoint does not match a {kind} head for this target "
                          f"({str(e).splitlines()[-1].strip()[:160]})") from None
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise ConfigError(f"{path}: the checkpoint does not match a {kind} head for this target (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})")
    return head.eval()


def own_layout(head, sd: dict, path: Path, raw: dict) -> dict:
    """`sd`, a checkpoint in an upstream layout (vLLM's or SGLang's: upstream heads and our exports), as
    `head`'s own state dict: the target's shared tensors and SGLang's zero fc bias dropped, the vocabulary
    maps a full vocabulary leaves out filled in (an EAGLE-1 draft vocabulary from SGLang's hot_token_ids.pt).
    A ConfigError for what specdec's heads cannot hold. Our own layout passes through unchanged."""
    cfg = head.cfg
    if cfg.kind == "medusa":
        sd = {k.replace("medusa_heads.", ""): v for k, v in sd.items()}
        # vLLM's Medusa: original_lm_head (default false) says whether lm_heads.0 is the target's own, shared
        # by every head, or each head has its own lm_heads.i
        if not raw.get("original_lm_head", False) and any(k.startswith("lm_head") for k in sd):
            raise ConfigError(f"{path}: its Medusa heads have LM heads of their own (original_lm_head is not "
                              "true); specdec's Medusa heads share the target's")
        sd = {k: v for k, v in sd.items() if not k.startswith("lm_head")}
        if "token_map" not in sd:
            if cfg.draft_vocab_size:
                raise ConfigError(f"{path}: a truncated vocabulary of {cfg.draft_vocab_size} tokens without the "
                                  "token_map that names them")
            sd["token_map"] = head.token_map
        return sd
    sd = dict(sd)
    bias = sd.pop("fc.bias", None)
    if bias is not None and bool(bias.any()):
        raise ConfigError(f"{path}: its fc has a nonzero bias, which specdec's EAGLE heads do not have")
    sd = {k: v for k, v in sd.items() if not k.startswith(("embed_tokens.", "layers.0.input_layernorm"))
          and not (cfg.kind == "eagle" and k.startswith("lm_head"))}
    if "d2t" not in sd:
        hot = _hot_token_ids(path, cfg.vocab_size) if cfg.kind == "eagle" and cfg.draft_vocab_size else None
        if hot is not None and hot.numel() != cfg.draft_vocab_size:
            raise ConfigError(f"{path}/hot_token_ids.pt names {hot.numel()} distinct tokens, the head's draft "
                              f"vocabulary has {cfg.draft_vocab_size}")
        if hot is not None:
            head.set_vocab(hot)
        elif cfg.draft_vocab_size:
            raise ConfigError(f"{path}: a draft vocabulary of {cfg.draft_vocab_size} tokens without the map that "
                              "names them (d2t, or SGLang's hot_token_ids.pt for EAGLE-1)")
        sd["d2t"], sd["t2d"] = head.d2t, head.t2d
    elif "t2d" not in sd:  # (the engines read d2t alone) draft token i is target token i + d2t[i]
        ids = torch.arange(sd["d2t"].numel()) + sd["d2t"]
        if ids.shape != head.d2t.shape or not bool(((ids >= 0) & (ids < head.t2d.numel())).all()):
            raise ConfigError(f"{path}: its d2t does not map {head.d2t.numel()} draft tokens into this "
                              "target's vocabulary")
        head.set_vocab(ids)
        sd["t2d"] = head.t2d
    sd["t2d"] = sd["t2d"].bool()
    return sd


def _hot_token_ids(path: Path, vocab_size: int) -> torch.Tensor | None:
    """SGLang's EAGLE-1 draft vocabulary (--speculative-token-map, hot_token_ids.pt beside the head), as
    ascending distinct target ids; None where the file is absent. torch.load with weights_only=True: a
    tensor, never code."""
    f = path / "hot_token_ids.pt"
    if not f.exists():
        return None
    try:
        ids = torch.load(f, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, IndexError, pickle.UnpicklingError) as e:
        raise ConfigError(f"cannot read {f}: {(str(e).splitlines() or [type(e).__name__])[0][:160]}") from None
    if isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        ids = torch.tensor(ids, dtype=torch.long)  # (SGLang takes a list too)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0:
        raise ConfigError(f"{f}: not a 1-D list or tensor of token ids")
    ids = ids.long().unique()  # (sorted; FR-Spec's files are ordered by frequency)
    if not bool(((ids >= 0) & (ids < vocab_size)).all()):
        raise ConfigError(f"{f}: token ids outside this target's vocabulary of {vocab_size}")
    return ids


def _aux_layers(raw: dict) -> tuple[int, ...]:
    """The target layers (outputs, 0-based) an upstream EAGLE-3 config names: vLLM's top-level key counts
    layer inputs, SGLang's / SpecForge's eagle_config key layer outputs; () where neither is given."""
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(l - 1 for l in raw["eagle_aux_hidden_state_layer_ids"])
    return tuple((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", ()))


def export_head(head_dir: Path, fmt: str, out: Path, target_dir: Path, num_speculative_tokens: int = 5,
                num_steps: int = 5, eagle_topk: int = 4, num_draft_tokens: int = 8) -> str:
    """Write the head in `fmt`'s layout as a new directory `out` (written beside it, then renamed into place,
    so a failed export leaves nothing that loads); returns the serve command line."""
    from specdec.proposers.head_io import load_head

    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; one of {', '.join(FORMATS)}")
    out = Path(out)
    check_new_dir(out)
    head = load_head(head_dir)
    cfg = head.cfg
    if cfg.kind == "medusa" and fmt == "sglang":
        raise ConfigError("SGLang serves no Medusa heads; export Medusa with --format vllm")
    name = json.loads((head_dir / "config.json").read_text()).get("torch_dtype", "float32")
    dtype = {v: k for k, v in _DTYPE_NAMES.items()}.get(name)
    if dtype is None:
        raise ConfigError(f"{head_dir}/config.json: torch_dtype {name!r} is not one of "
                          f"{', '.join(_DTYPE_NAMES.values())}")
    # from the head as loaded, our own layout (a head that is itself an export: no SGLang fc.bias carried
    # over), in the dtype it was stored in (its values are that dtype's: the round trip is exact)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in head.state_dict().items()
          if not k.startswith("rotary.")}
    with new_dir(out) as partial:
        extra_args, notes = _write_export(head, sd, dtype, fmt, head_dir, partial, out, target_dir)
    command = serve_command(fmt, cfg.kind, str(target_dir), str(out), num_speculative_tokens, num_steps,
                            eagle_topk, num_draft_tokens, extra_args)
    return "".join(f"# {n}\n" for n in notes) + command


def _write_export(head, sd: dict, dtype: torch.dtype, fmt: str, head_dir: Path, into: Path, out: Path,
                  target_dir: Path) -> tuple[list[str], list[str]]:
    """The export's files, written into `into` (to be renamed to `out`); returns the serve command's extra
    arguments and what its user should know (comment lines above the command)."""
    cfg = head.cfg
    extra_args: list[str] = []
    notes: list[str] = []
    if cfg.kind == "eagle":  # upstream EAGLE-1 checkpoints have no vocabulary maps
        sd = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    if cfg.kind == "medusa":  # vLLM slices the shared LM head down to token_map itself
        sd["lm_heads.0.weight"] = _target_lm_head(target_dir).to(dtype)
    if cfg.kind == "eagle" and fmt == "sglang":  # SGLang's fc has a bias, loaded where given
        sd["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=dtype)
    if cfg.kind == "eagle" and cfg.draft_vocab_size and fmt == "sglang":
        # FR-Spec style token map: SGLang's --speculative-token-map reads a .pt, so this one file is torch.save's
        # (a pickle holding one tensor, which torch.load(weights_only=True) reads; specdec never loads it)
        torch.save(head.draft_ids.clone(), into / "hot_token_ids.pt")
        extra_args = ["--speculative-token-map", str(out / "hot_token_ids.pt")]
    if cfg.kind == "eagle" and cfg.draft_vocab_size and fmt == "vllm":
        # vLLM's EAGLE-1 has no draft vocabulary: it drafts over the target's whole LM head; the config says
        # so, and specdec loads this directory back as that full-vocabulary head
        cfg = replace(cfg, draft_vocab_size=0)
        notes.append(f"vLLM's EAGLE-1 drafts over the whole vocabulary: this head was trained on "
                     f"{head.cfg.draft_vocab_size} tokens, so its acceptance there is unmeasured "
                     "(--format sglang keeps the draft vocabulary)")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(into / "model.safetensors"), metadata={"format": "pt"})
    (into / "config.json").write_text(json.dumps(hf_config(cfg, dtype, fmt), indent=2))
    for name in ("README.md",):
        if (head_dir / name).exists():
            shutil.copy(head_dir / name, into / name)
    return extra_args, notes


def serve_command(fmt: str, kind: str, target: str, head: str, k: int, num_steps: int, topk: int,
                  num_draft_tokens: int, extra_args: list[str] = ()) -> str:
    if fmt == "vllm":
        spec = json.dumps({"method": kind, "model": head, "num_speculative_tokens": k})
        return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"
    algo = {"eagle": "EAGLE", "eagle3": "EAGLE3"}[kind]
    args = ["python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", algo,
            "--speculative-draft-model-path", head, "--speculative-num-steps", str(num_steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(num_draft_tokens),
            *extra_args]
    return " ".join(shlex.quote(a) for a in args)


def _target_lm_head(target_dir: Path) -> torch.Tensor:
    from specdec.model.loader import read_safetensors_dir

    t = read_safetensors_dir(target_dir)
    return t.get("lm_head.weight", t["model.embed_tokens.weight"])
