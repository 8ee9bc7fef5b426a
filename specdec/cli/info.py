"""`specdec info`: the model card (architecture, parameters, dtype, where it was loaded from)."""
from __future__ import annotations

import json

from specdec.cli._common import add_model_args, make_llm


def register(sub) -> None:
    p = sub.add_parser("info", help="show what a model is and where it was loaded from")
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    info = make_llm(args, speculative=False).info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>20}: {v}")
    return 0
