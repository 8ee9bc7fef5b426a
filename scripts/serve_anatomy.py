"""Where a serving step goes at a few sequences: the engine in-process (no HTTP), speculation off and on,
MT-bench first turns, rounds of --concurrency requests at once (as `specdec bench serve` sends them), each
round's requests run to the end. Per round and setting: TPOT p50 (from the steps' end times), and per decode
step its target forward, its drafting and the rest, and the tokens it emitted. --tree-max-rows N adds a third
setting: speculation on with token trees verified at up to N rows (speculation.TREE_MAX_ROWS; 1 is the default).

    python scripts/serve_anatomy.py --rounds 6 --concurrency 4            # bf16 on AMX tiles where the CPU has them
    python scripts/serve_anatomy.py --rounds 8 --concurrency 4 --tree-max-rows 4

Settings take turns per round (ABBA), so the machine's drift falls on each; read same-run ratios only.
"""
from __future__ import annotations

import argparse
import statistics
import time

import specdec.engine.speculation as speculation
from specdec.bench.serve_workload import mtbench_workload
from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams


def engine(method: str | None, args) -> Engine:
    spec = dict(zip(("method", "lookup"), method.split("+"))) if method else None
    llm = LLM(args.model, speculative_config=spec, dtype=args.dtype, num_threads=args.threads, enforce_eager=True,
              enable_prefix_caching=False, amx=True)  # as `specdec serve` builds its LLM
    eng = Engine(llm, EngineConfig(16, args.max_num_batched_tokens))
    run, eng.forwards = eng.runner.run, []

    def timed(*a, **k):  # each target forward's seconds
        t0 = time.perf_counter()
        out = run(*a, **k)
        eng.forwards.append(time.perf_counter() - t0)
        return out
    eng.runner.run = timed
    return eng


def one_round(eng: Engine, work, tag: str, tree_max_rows: int) -> tuple[float, list[dict]]:
    """TPOT p50 (ms) of a round and its decode steps (one forward, no prompt chunk in it)."""
    speculation.TREE_MAX_ROWS = tree_max_rows
    for i, (prompt, n) in enumerate(work):
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        eng.add_request(EngineRequest(f"{tag}-{i}", ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
    first, last, count, steps = {}, {}, {}, []
    while eng.has_unfinished():
        eng.forwards.clear()
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        first_tokens = any(o.request_id not in first for o in outs if o.token_ids)  # (num_output_tokens: set at the end)
        if len(eng.forwards) == 1 and outs and not first_tokens:  # a decode step (no prompt pass in it)
            steps.append({"step": t1 - t0, "forward": eng.forwards[0], "draft": eng.spec.propose_seconds,
                          "tokens": sum(len(o.token_ids) for o in outs), "rows": len(outs)})
        for o in outs:
            if o.token_ids:
                first.setdefault(o.request_id, t1)
                last[o.request_id] = t1
                count[o.request_id] = count.get(o.request_id, 0) + len(o.token_ids)
    return statistics.median((last[r] - first[r]) / (count[r] - 1) * 1e3 for r in first), steps


def anatomy(steps: list[dict]) -> str:
    n = max(len(steps), 1)
    ms = {k: sum(s[k] for s in steps) / n * 1e3 for k in ("step", "forward", "draft")}
    rows = sum(s["rows"] for s in steps) or 1
    return (f"{len(steps)} decode steps, {ms['step']:.1f} ms each: forward {ms['forward']:.1f}, drafting "
            f"{ms['draft']:.1f}, the rest {ms['step'] - ms['forward'] - ms['draft']:.1f}; "
            f"{sum(s['tokens'] for s in steps) / rows:.2f} tokens a row and step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--method", default="eagle3+ngram")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--tree-max-rows", type=int, default=None)
    args = p.parse_args()
    engines = {"off": engine(None, args), "on": engine(args.method, args)}
    settings = [("off", 1), ("on", 1)] + ([("on", args.tree_max_rows)] if args.tree_max_rows else [])
    C = args.concurrency
    work = mtbench_workload(args.rounds * C, args.max_tokens, 0)
    warm = mtbench_workload(C, args.max_tokens, 0, turn=1)  # second turns: no round sends them
    for name, rows in settings:
        one_round(engines[name], warm, f"warm-{name}-{rows}", rows)
    tpot: dict[tuple, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for name, rows in (settings if r % 2 == 0 else settings[::-1]):
            ms, steps = one_round(engines[name], work[r * C:(r + 1) * C], f"{name}-{rows}-{r}", rows)
            tpot[(name, rows)].append(ms)
            print(f"round {r} {name:>3} (trees at <= {rows} rows): TPOT p50 {ms:.1f} ms; {anatomy(steps)}", flush=True)
    off = tpot[("off", 1)]
    for s in settings[1:]:
        ratios = [a / b for a, b in zip(off, tpot[s])]
        print(f"TPOT off / on (trees at <= {s[1]} rows): median {statistics.median(ratios):.3f}x, "
              f"each round {', '.join(f'{x:.3f}' for x in ratios)}")


if __name__ == "__main__":
    main()
