"""`specdec make-draft`: save a layer-truncated copy of the target as a draft model directory.

    specdec make-draft smollm2-135m --layers 8 --out drafts/smollm2-8l
    specdec make-draft smollm2-135m --layers 8 --strategy even --out drafts/smollm2-8l-even
"""
from __future__ import annotations

from pathlib import Path

from specdec.train.make_draft import STRATEGIES, make_draft


def register(sub) -> None:
    p = sub.add_parser("make-draft", help="save a layer-truncated copy of a model as a draft model")
    p.add_argument("model", nargs="?", default="smollm2-135m", help="the target: alias, HF directory or .gguf file")
    p.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps")
    p.add_argument("--out", type=Path, required=True, help="output directory (new or empty)")
    p.add_argument("--strategy", choices=STRATEGIES, default="first-last",
                   help="first-last: layers 0..N-2 and the last one (default); even: evenly spaced")
    p.set_defaults(func=run)


def run(args) -> int:
    out, layers = make_draft(args.model, args.layers, args.out, args.strategy)
    print(f"saved a {len(layers)}-layer draft (target layers {layers}) to {out}")
    print(f"use it with: --speculative-method draft_model --speculative-model {out}")
    return 0
