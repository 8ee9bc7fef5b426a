"""A draft head directory (config.json with HF fields + "specdec": ours, and model.safetensors with the
upstream key names; the target's shared tensors left out): make, save and load any head kind, and find
the shipped head for a target."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdec.config import ConfigError, read_json_object
from specdec.proposers.heads import EagleHead, HeadConfig
from specdec.proposers.medusa_head import MedusaHead

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # the shipped heads


def make_head(cfg: HeadConfig) -> torch.nn.Module:
    return MedusaHead(cfg) if cfg.kind == "medusa" else EagleHead(cfg)


def save_head(head: torch.nn.Module, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors (upstream key names, shared tensors left out)."""
    from specdec.train.export import hf_config  # the HF/vLLM/SGLang config fields live with the exporter

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone()
          for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(head.cfg, dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def load_head(path: Path, dtype: torch.dtype = torch.float32, target_config=None) -> torch.nn.Module:
    """A head directory of ours (our exports too, in their upstream layouts: train/export.py's own_layout);
    with `target_config`, an upstream EAGLE / EAGLE-3 / Medusa checkpoint too (vLLM's or SGLang's layout, no
    'specdec' section: train/export.py's import_head)."""
    path = Path(path)
    raw = read_json_object(path / "config.json")
    try:
        sd = load_file(str(path / "model.safetensors"))
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"cannot read draft head {path}/model.safetensors: {e}") from None
    if "specdec" not in raw:
        if target_config is not None:
            from specdec.train.export import import_head
            return import_head(path, target_config).to(dtype).requires_grad_(False)
        raise ConfigError(f"{path}: not a specdec head (config.json has no 'specdec' section)")
    try:
        cfg = HeadConfig.from_dict(raw["specdec"])
    except (TypeError, AttributeError) as e:
        raise ConfigError(f"{path}/config.json: invalid 'specdec' section ({e})") from None
    head = make_head(cfg)
    from specdec.train.export import own_layout  # an export of ours (upstream keys) loads back as written
    sd = own_layout(head, sd, path, raw)
    try:
        missing, unexpected = head.load_state_dict(
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, strict=False)
    except RuntimeError as e:  # a tensor shaped unlike the config says
        raise ConfigError(f"{path}: head weights do not match its config ({str(e).splitlines()[-1].strip()[:160]})") from None
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise ConfigError(f"{path}: head weights do not match its config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    return head.to(dtype).eval().requires_grad_(False)


def check_head_fits(head: torch.nn.Module, target_config, path, kind: str | None = None) -> None:
    """A ConfigError unless `head` is a `kind` head made for this target: its hidden size, its vocabulary and
    the target layers it reads (a head of another model failed as a shape error deep in a matmul)."""
    cfg, tc = head.cfg, target_config
    if kind is not None and cfg.kind != kind:
        raise ConfigError(f"{path} is a {cfg.kind} head, not {kind}")
    if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ConfigError(f"{path}: head was trained for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                          f"the target has {tc.hidden_size} / {tc.vocab_size}")
    if any(not 0 <= layer < tc.num_hidden_layers for layer in cfg.aux_layers):
        raise ConfigError(f"{path}: head reads target layers {list(cfg.aux_layers)}, the target has "
                          f"{tc.num_hidden_layers}")


def default_head(kind: str, target_cfg) -> Path:
    """The shipped head of `kind` trained for this target (matched by architecture), if any."""
    for d in sorted(ASSETS.glob(f"*-{kind}")):
        try:
            sd = json.loads((d / "config.json").read_text())["specdec"]
        except (OSError, KeyError, ValueError):
            continue
        t = sd.get("training", {}).get("target_config", {})
        if (sd.get("kind") == kind and sd.get("hidden_size") == target_cfg.hidden_size
                and sd.get("vocab_size") == target_cfg.vocab_size
                and t.get("num_hidden_layers") == target_cfg.num_hidden_layers):
            return d
    raise ConfigError(f"no shipped {kind} head for this model; train one (`specdec train {kind}`) and pass "
                      f"its directory as the speculative model")
