"""`specdec advise`: measure this machine and your prompts, and recommend a speculative method and k.

    specdec advise smollm2-135m --prompts my_prompts.txt
    specdec advise smollm2-135m --prompts chats.jsonl --batch-size 8 --json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.cli._common import add_model_args, at_least


def register(sub) -> None:
    p = sub.add_parser("advise", help="recommend a speculative method, k and tree size for your prompts")
    add_model_args(p)
    p.add_argument("--prompts", type=Path, required=True,
                   help="a text file (one prompt per line) or JSONL ({\"prompt\": ...} or {\"messages\": [...]})")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--batch-size", type=at_least(1), default=1, help="concurrent requests you will serve (default 1)")
    p.add_argument("--max-tokens", type=at_least(1), default=64, help="tokens generated per prompt while measuring")
    p.add_argument("--k-max", type=at_least(1), default=8, help="largest k considered")
    p.add_argument("--temperature", type=float, default=0.0, help="how your requests sample (default 0: greedy)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="the repetition penalty your requests use (default 1: none); it changes what lookups gain")
    p.add_argument("--methods", default=None, help="comma list (default: every registered method)")
    p.add_argument("--method-config", action="append", default=[], metavar="METHOD=JSON",
                   help="extra speculative_config keys for one method, e.g. eagle3+ngram='{\"eagle_topk\": 3, "
                        "\"num_steps\": 3, \"num_draft_tokens\": 9}' (an EAGLE-2 tree)")
    p.add_argument("--speculative-model", "--draft-model", dest="draft_model", default=None,
                   help="draft model for the draft_model method")
    p.add_argument("--max-prompts", type=at_least(1), default=16, help="use at most this many prompts")
    p.add_argument("--no-verify", action="store_true", help="skip measuring the recommendation against plain decoding")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.bench.advise import advise
    from specdec.bench.prompts import load_prompt_file
    from specdec.cli.bench import _method_configs
    from specdec.config import split_method
    from specdec.model.loader import resolve_model
    from specdec.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.model).directory)
    prompts = load_prompt_file(args.prompts, tokenizer, chat=not args.raw)[: max(1, args.max_prompts)]
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else None
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    adv = advise(args.model, prompts, args.dtype, args.threads, args.batch_size, args.max_tokens, args.k_max,
                 methods, _method_configs(args.method_config), args.draft_model, not args.no_verify, log, args.temperature,
                 args.repetition_penalty, bool(args.amx),  # --amx (add_model_args): measure on AMX tiles
                 args.kv_cache_dtype)
    if args.json:
        print(json.dumps(adv.to_dict(), default=str))
        return 0
    rec = adv.recommendation
    if rec["method"] is None:
        print("Recommendation: plain decoding (speculation off).")
    else:
        tree = f", tree size {rec['tree_size']:.0f}" if rec["tree_size"] else ""
        one = " one request at a time" if args.batch_size > 1 else ""  # (the measurement runs batch 1)
        meas = f", measured {rec['measured_speedup']:.2f}x{one}" if rec["measured_speedup"] else ""
        k = f" --num-speculative-tokens {rec['k']}" if rec["k"] else " (adaptive k)"
        method, lookup = split_method(rec["method"])  # "eagle3+ngram": the CLI's method and lookup flags
        flags = f"--speculative-method {method}" + (f" --speculative-lookup {lookup}" if lookup else "")
        print(f"Recommendation: {flags}{k}{tree} "
              f"(expected {rec['expected_speedup']:.2f}x{meas})")
        print(f"  --speculative-config '{json.dumps(rec['speculative_config'])}'")
    print(f"Why: {adv.reason}")
    if args.temperature or args.repetition_penalty != 1.0:
        print(f"Measured at temperature {args.temperature:g}, repetition penalty {args.repetition_penalty:g}.")
    print(f"\n{'method':14s} {'best k':>6s} {'expected':>9s} {'tokens/step':>12s} {'acceptance':>11s} {'draft cost':>11s}")
    for c in sorted(adv.candidates, key=lambda c: -c.expected_speedup):
        print(f"{c.method:14s} {c.best_k:6d} {c.expected_speedup:8.2f}x {c.tokens_per_step:12.2f} "
              f"{c.acceptance_rate:11.2f} {c.draft_cost_rel:11.3f}")
    for s in adv.skipped:
        print(f"{s['method']:14s} skipped: {s['reason']}")
    print(f"(costs measured after {adv.cost_curve['prefix_len']} cached tokens: the prompts' median plus half the answer)")
    return 0
