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
drafter issue) raises acceptance.
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
    from specdec.model.output_dir import check_new_dir, new_dir

    source = resolve_model(target, progress=progress)
    out = Path(out)
    check_new_dir(out)
    model = load_model(source.directory, torch.float32)
    layers = draft_layers(model.config.num_hidden_layers, num_layers, strategy)
    with new_dir(out) as partial:
        save_model_dir(model, source.directory, partial, layers=layers)
        (partial / "specdec_draft.json").write_text(json.dumps(
            {"target": source.origin, "layers": layers, "strategy": strategy}, indent=2))
    return out, layers
