"""Two EAGLE-3 heads side by side on this CPU, in one run (bf16 on AMX tiles, 2 threads, greedy, MT-bench
multi_turn + qa prompts; the systems alternate prompt by prompt, two rounds; every output must equal plain
decoding's). docs/benchmarks/heads-s46/cpu-ab.md holds session 46's figures.

    python scripts/ab_heads.py adaptive OLD_HEAD NEW_HEAD [TOKENS]  # speedups, the default configuration
    python scripts/ab_heads.py cost OLD_HEAD NEW_HEAD               # ms a pass at fixed draft shapes
"""
import statistics
import sys
import time

from specdec import LLM, SamplingParams
from specdec.bench.prompts import build_prompts

SHAPES = {"tree9": {"eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 9},
          "chain3": {"eagle_topk": 1, "num_steps": 3, "num_draft_tokens": 3}}


def make(speculative_config=None) -> LLM:
    return LLM("smollm2-135m", dtype="bfloat16", num_threads=2, progress=False, amx=True,
               speculative_config=speculative_config)


def interleaved(systems: dict, prompts, max_tokens: int) -> dict:
    """system -> prompt index -> [(seconds, RequestOutput)] over two rounds, the order alternating."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    runs = {name: {} for name in systems}
    for rnd in range(2):
        for i, p in enumerate(prompts):
            for name in (list(systems) if (i + rnd) % 2 == 0 else list(systems)[::-1]):
                t = time.perf_counter()
                r = systems[name].generate({"prompt_token_ids": p.token_ids}, params)[0]
                runs[name].setdefault(i, []).append((time.perf_counter() - t, r))
    return runs


def adaptive(heads: dict, max_tokens: int) -> None:
    systems = {"plain": make(), **{n: make({"method": "eagle3", "model": h}) for n, h in heads.items()}}
    prompts = build_prompts(systems["plain"].tokenizer, 8, ("multi_turn", "qa"))
    runs = interleaved(systems, prompts, max_tokens)
    for i in range(len(prompts)):
        outs = {tuple(r.outputs[0].token_ids) for name in systems for _, r in runs[name][i]}
        assert len(outs) == 1, f"prompt {i}: outputs differ"
    best = {name: {i: min(t for t, _ in v) for i, v in r.items()} for name, r in runs.items()}
    for cat in ("multi_turn", "qa", "all"):
        idx = [i for i, p in enumerate(prompts) if cat in ("all", p.category)]
        total = {name: sum(best[name][i] for i in idx) for name in systems}
        print(cat, {n: f"{total['plain'] / total[n]:.3f}x (per-prompt median "
                       f"{statistics.median(best['plain'][i] / best[n][i] for i in idx):.3f})" for n in heads})


def cost(heads: dict) -> None:
    systems = {(n, s): make({"method": "eagle3", "model": h, "adaptive": False, **shape})
               for n, h in heads.items() for s, shape in SHAPES.items()}
    prompts = build_prompts(next(iter(systems.values())).tokenizer, 4, ("multi_turn", "qa"))
    for name, runs in interleaved(systems, prompts, 96).items():
        seconds = passes = tokens = draft = verify = 0.0
        for t, r in (x for v in runs.values() for x in v):
            m = r.metrics
            seconds, passes, tokens = seconds + t, passes + m["target_forward_passes"], tokens + len(r.outputs[0].token_ids)
            draft, verify = draft + m["speculative"]["draft_time_s"], verify + m["speculative"]["verify_time_s"]
        print(name, f"ms/pass {1000 * seconds / passes:.2f}  draft ms/pass {1000 * draft / passes:.2f}  verify ms/pass "
                    f"{1000 * verify / passes:.2f}  tokens/pass {tokens / passes:.3f}  tok/s {tokens / seconds:.1f}")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] not in ("adaptive", "cost"):
        sys.exit(__doc__)
    pair = {"old": sys.argv[2], "new": sys.argv[3]}
    adaptive(pair, int(sys.argv[4]) if len(sys.argv) > 4 else 128) if sys.argv[1] == "adaptive" else cost(pair)
