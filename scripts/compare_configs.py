"""Speculative configurations side by side in one process: every benchmark prompt goes through plain decoding
and each configuration in turn, so a drift in the machine's load falls on all of them; prints each one's wall
clock over plain decoding and its tokens per target pass. Not the benchmark (no report, one repeat): a quick
A/B of draft shapes, e.g. session 40's chain against tree for eagle3's default on AMX tiles.

    python scripts/compare_configs.py --dtype bfloat16 --amx --configs \
        '[{"method": "eagle3", "eagle_topk": 1, "num_steps": 3}, {"method": "eagle3", "eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 9}]'
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from specdec.bench.prompts import CATEGORIES, build_prompts
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--amx", action="store_true", help="bf16 on AMX tiles (LLM(amx=True))")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--prompts-per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", required=True, help="JSON list of speculative_config dicts")
    args = ap.parse_args()
    configs = json.loads(args.configs)

    def make(config):
        return LLM(args.model, dtype=args.dtype, num_threads=args.threads, amx=args.amx, progress=False,
                   speculative_config=config)

    systems = [("plain", make(None))] + [(json.dumps(c), make(c)) for c in configs]
    prompts = build_prompts(systems[0][1].tokenizer, args.prompts_per_category, tuple(args.categories.split(",")))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for _, llm in systems:  # warm-up: kernels, caches, the cost profile
        llm.generate_one(prompts[0].token_ids, params)
    seconds, passes, tokens = [0.0] * len(systems), [0] * len(systems), [0] * len(systems)
    for p in prompts:
        for i, (_, llm) in enumerate(systems):
            t0 = time.perf_counter()
            r = llm.generate_one(p.token_ids, params)
            seconds[i] += time.perf_counter() - t0
            passes[i] += r.metrics.target_passes
            tokens[i] += len(r.token_ids)
    print(f"{args.model} {args.dtype}{' on AMX tiles' if args.amx else ''}, {len(prompts)} prompts x {args.max_tokens} tokens")
    for i, (name, _) in enumerate(systems[1:], 1):
        print(f"  {seconds[0] / seconds[i]:.3f}x  {tokens[i] / max(passes[i], 1):.2f} tokens a pass  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
