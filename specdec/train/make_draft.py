"""Make a draft model from the target by layer truncation: keep N of its decoder layers (with the
target's embeddings, final norm and LM head) and save them as an ordinary HF model directory that
any loader reads (`--speculative-model DIR`).

    specdec make-draft smollm2-135m --layers 8 --out drafts/smollm2-8l
    specdec generate smollm2-135m --speculative-method draft_model --speculative-model drafts/smollm2-8l ...

Layer choice (`strategy`):
  first-last (default)  layers 0..N-2 and the last layer, e.g. 30 layers, N=8 -> [0..6, 29]. The early
                        layers build the residual stream the later ones expect, and the last layer is
                        the one the final norm and LM head were trained on.
  even                  N layers evenly spaced from the first to the last, e.g. N=8 -> [0, 4, 8, 12, 17,
                        21, 25, 29].
Untrained, such a draft agrees with the target on the easy tokens only; distilling it (the learned-
drafter issue) raises acceptance. `specdec bench --draft-model auto` makes its draft here too, once into the
cache (cached_draft_dir).
"""
from __future__ import annotations

import json
from pathlib import Path

from specdec.config import ConfigError

STRATEGIES = ("first-last", "even")


def draft_layers(num_layers: int, n: int, strategy: str = "first-last") -> list[int]:
    """Indices of the target layers the draft keeps (ascending)."""
    if not 1 <= n <= num_layers:
        raise ConfigError(f"--layers must be in [1, {num_layers}] for this model, got {n}")
    if strategy == "first-last":
        return list(range(n - 1)) + [num_layers - 1] if n > 1 else [num_layers - 1]
    if strategy == "even":
        if n == 1:
            return [num_layers - 1]
        return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})
    raise ConfigError(f"unknown layer strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def make_draft(target: str, num_layers: int, out: Path, strategy: str = "first-last",
               progress: bool = True) -> tuple[Path, list[int]]:
    """Save a layer-truncated copy of `target` (alias, directory or GGUF) to `out`; weights in float32."""
    import torch  # (here: the CLI imports this module for STRATEGIES, and must not pay for torch then)

    from specdec.model.loader import load_model, resolve_model, save_model_dir
    from specdec.model.output_dir import check_new_dir

    source = resolve_model(target, progress=progress)
    out = Path(out)
    check_new_dir(out)  # (before the model loads: refused at once)
    model = load_model(source.directory, torch.float32)
    layers = draft_layers(model.config.num_hidden_layers, num_layers, strategy)
    meta = {"target": source.origin, "layers": layers, "strategy": strategy}
    save_model_dir(model, source.directory, out, layers, {"specdec_draft.json": json.dumps(meta, indent=2)})
    return out, layers


def cached_draft_dir(source_dir: Path, target, layers: int) -> Path:
    """A layer-truncated copy of `target` (read from `source_dir`) keeping `layers` layers, first-last, made
    once into the cache (`specdec bench --draft-model auto`); a packed target (bf16, int8/int4) is re-read
    in fp32 from the source to be saved."""
    import hashlib

    import torch

    from specdec.model.loader import cache_root, load_model, save_model_dir

    total = target.config.num_hidden_layers
    n = max(1, min(layers, total - 1))
    kept = draft_layers(total, n)
    st = next(iter(sorted(source_dir.glob("*.safetensors"))), source_dir / "config.json").stat()
    key = hashlib.sha1(f"{source_dir.resolve()}|{st.st_size}|{st.st_mtime_ns}|{kept}".encode()).hexdigest()[:10]
    out = cache_root() / "bench" / "drafts" / f"{source_dir.name}-first-last{n}-{key}"
    if not out.exists():  # (save_model_dir puts the whole directory in place at once)
        if not isinstance(target.layers[0].qkv.weight, torch.Tensor):
            target = load_model(source_dir, torch.float32)
        meta = {"target": str(source_dir), "layers": kept, "strategy": "first-last"}
        save_model_dir(target, source_dir, out, kept, {"specdec_draft.json": json.dumps(meta, indent=2)})
    return out


def draft_dir_layers(draft_dir: Path) -> list[int] | None:
    """The target layers a draft made here kept (its specdec_draft.json), None for any other model."""
    meta = Path(draft_dir) / "specdec_draft.json"
    return json.loads(meta.read_text()).get("layers") if meta.exists() else None
