"""Training checkpoints (heads and distilled drafts): written whole (a temporary file renamed into place, so a
crash leaves the last one), read back with torch.load(weights_only=True) (tensors and plain values, never code),
and the settings a rerun must share with the run it resumes."""
from __future__ import annotations

import json
import pickle  # (its error type only: torch.load's weights_only unpickler raises it on a damaged file)
from pathlib import Path

import torch

from specdec.config import ConfigError
from specdec.model.output_dir import sync_replace


def write_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    sync_replace(tmp, path)


def read_checkpoint(path: Path, device="cpu") -> dict:
    """The state at `path`; a ConfigError (delete it to start over) for a file cut short or damaged."""
    try:
        state = torch.load(path, weights_only=True, map_location=device)
    except (RuntimeError, OSError, EOFError, IndexError, pickle.UnpicklingError) as e:  # cut short, zero-filled
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise ConfigError(f"{path} cannot be read ({why}); delete it to start over") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path} is not a checkpoint; delete it to start over")
    return state


def check_settings(state: dict, settings: dict, out: Path) -> None:
    """A ConfigError naming each setting the checkpoint's run had otherwise (its "settings", a JSON object)."""
    try:
        saved = json.loads(state.get("settings", "null")) or {}
    except (TypeError, ValueError):
        saved = None
    if not isinstance(saved, dict):
        raise ConfigError(f"{out}: its checkpoint's settings cannot be read; delete it to start over")
    now = json.loads(json.dumps(settings))
    changed = sorted(k for k in saved if saved[k] != now.get(k))
    if changed:  # the batches skipped, the schedule and the weights' shapes all follow the settings
        raise ConfigError(f"{out} holds a run with other settings ({', '.join(changed)}: "
                          f"{', '.join(repr(saved[k]) for k in changed)}); resume with those, or use a new --out")
