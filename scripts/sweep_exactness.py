"""A differential sweep: every speculative configuration's greedy output against plain greedy decoding
on a real model and the benchmark's prompts, in one process. Not a test (minutes per dtype), a net for
numerics: session 30's sweep found a tree row and the torch attention path leaving plain decoding at
near ties, which the tiny models' tests had not shown (docs/benchmarks/methods.md, session 30).

    python scripts/sweep_exactness.py --model smollm2-135m --dtype bfloat16 --prompts-per-category 2
    python scripts/sweep_exactness.py --model gemma3-270m --configs '[{"method": "ngram"}]'
    python scripts/sweep_exactness.py --amx      # bf16 decode and verify passes on AMX tiles
    python scripts/sweep_exactness.py --amx --engine 4   # through the serving engine, 4 rows at a time
    python scripts/sweep_exactness.py --amx --kv-cache-dtype bfloat16   # over bf16 KV caches

--engine N runs every configuration (and plain decoding) through the serving engine instead: N
sequences at a time, a small token budget so that long prompts are prefilled in chunks beside decode
rows, each against the offline plain reference. Session 33's found a bf16 prompt pass whose bits
depended on its chunks (oneDNN on an AMX CPU).

Prints each configuration's mismatches (category, prompt, first differing token) and exits 1 if any.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from specdec.bench.prompts import CATEGORIES, build_prompts
from specdec.config import KV_CACHE_DTYPES, ConfigError, SpeculativeConfig
from specdec.llm import LLM
from specdec.quant.bf16 import exact_prompt_passes
from specdec.sampling_params import SamplingParams
from specdec.spec.decoder import SpeculativeDecoder
from specdec.spec.proposer import ProposerContext, make_proposer

CONFIGS = [{"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 7}, {"method": "suffix"},
           {"method": "lookahead"}, {"method": "layerskip"}, {"method": "qdraft"},
           {"method": "qdraft", "lookup": "ngram"}, {"method": "eagle3"}, {"method": "eagle3", "lookup": "ngram"},
           {"method": "eagle3", "eagle_topk": 3, "num_steps": 4, "num_draft_tokens": 10},
           {"method": "medusa"}, {"method": "recycle"}]


def decoder(llm: LLM, config: dict | None) -> SpeculativeDecoder:
    """A decoder over llm's target (shared) with its own proposer; no kept prefix (cold prompts)."""
    cfg = SpeculativeConfig.from_dict(config)
    proposer = None
    if cfg is not None:
        proposer = make_proposer(ProposerContext(llm.model, llm.tokenizer, cfg, llm.source.directory, llm.dtype,
                                                 llm.model.max_len, llm._load_aux))
    return SpeculativeDecoder(llm.model, llm.tokenizer, proposer, cfg, prefix_caching=False)


def served(llm: LLM, prompts, params: SamplingParams, num_seqs: int) -> list[list[int]]:
    """Every prompt through a serving engine over `llm` with its own speculative config (plain where it has
    none), num_seqs at a time, prompts chunked by a 128-token budget; each request's tokens in prompt order."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    engine = Engine(llm, EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=128, request_methods=()))
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p.token_ids, params))
    got: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            got[int(out.request_id)].extend(out.token_ids)
    return got


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts-per-category", type=int, default=2)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=None, help="JSON list of speculative_config dicts (default: CONFIGS)")
    ap.add_argument("--amx", action="store_true", help="bf16 on AMX tiles (a CPU with AMX; LLM(amx=True))")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the caches' dtype (LLM(kv_cache_dtype=...)), for plain decoding and every configuration")
    ap.add_argument("--engine", type=int, default=0, metavar="N",
                    help="through the serving engine, N sequences at a time (default: the offline decoder)")
    args = ap.parse_args()
    def load(config: dict | None = None) -> LLM:
        return LLM(args.model, dtype=args.dtype, num_threads=args.threads, progress=False, amx=args.amx,
                   kv_cache_dtype=args.kv_cache_dtype, speculative_config=config)

    llm = load()
    if args.amx and not llm.amx:
        print("--amx: this CPU has no AMX tiles (or the dtype is not bfloat16)", file=sys.stderr)
        return 1
    prompts = build_prompts(llm.tokenizer, args.prompts_per_category, tuple(args.categories.split(",")))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    if args.engine:  # the prompt kernels an engine will use, for the offline reference too (quant/bf16.py)
        exact_prompt_passes(llm.model)
    plain = decoder(llm, None)
    reference = [plain.generate(p.token_ids, params).token_ids for p in prompts]
    mismatches = 0
    configs = json.loads(args.configs) if args.configs else CONFIGS
    for config in ([None] if args.engine else []) + configs:  # the engine's plain decoding first
        t0 = time.perf_counter()
        try:
            if args.engine:  # the whole config (lookup, tree shape, k) as the engine's own speculation
                outputs = served(llm if config is None else load(config), prompts, params, args.engine)
            else:
                spec = decoder(llm, config)
                outputs = [spec.generate(p.token_ids, params).token_ids for p in prompts]
        except (ConfigError, OSError, ValueError) as e:  # a drafter this model cannot have (no shipped head, ...)
            print(f"skipped {json.dumps(config)}: {e}")
            continue
        found = []
        for p, want, got in zip(prompts, reference, outputs):
            if got != want:
                found.append(f"{p.category} {p.source} @{first_difference(want, got)}")
        mismatches += len(found)
        print(f"{json.dumps(config)}: {len(found)} of {len(prompts)} differ ({time.perf_counter() - t0:.0f} s)"
              + "".join(f"\n    {f}" for f in found), flush=True)
    print(f"{args.model} {args.dtype}{' engine' if args.engine else ''}: {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
