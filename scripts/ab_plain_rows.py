"""Plain serving-engine rounds of N requests at once (no HTTP, no speculation): the seconds each round takes,
for comparing two versions of the code on one machine. Run it from each version's checkout in turn,
alternating processes, and compare per-process totals (the machine's speed drifts: same-run ratios only).

    S=$PWD/scripts/ab_plain_rows.py P=$PWD/.venv/bin/python; git worktree add /tmp/old REV
    for v in old new old new; do d=$([ $v = old ] && echo /tmp/old || echo $PWD)
        (cd $d && PYTHONPATH=$d $P $S --tag $v); done

Uses only what every version since session 43 has (LLM, Engine, mtbench_workload). Session 47's figures:
docs/benchmarks/serving.md, session 47.
"""
import argparse
import time

from specdec.bench.serve_workload import mtbench_workload
from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="this")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    llm = LLM("smollm2-135m", dtype=args.dtype, num_threads=2, enforce_eager=True, enable_prefix_caching=False,
              amx=True)
    engine = Engine(llm, EngineConfig(max(16, args.rows), 256))
    work = mtbench_workload(args.rows * (args.rounds + 1), args.max_tokens, 0)

    def run_round(prompts, tag) -> float:
        for i, (prompt, n) in enumerate(prompts):
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            engine.add_request(EngineRequest(f"{tag}-{i}", ids, SamplingParams(max_tokens=n, temperature=0,
                                                                                ignore_eos=True)))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    run_round(work[-args.rows:], "warm")  # (the last prompts: no measured round sends them)
    seconds = [run_round(work[r * args.rows:(r + 1) * args.rows], f"r{r}") for r in range(args.rounds)]
    print(f"{args.tag}: {sum(seconds):.2f} s in all; rounds {', '.join(f'{s:.2f}' for s in seconds)}")


if __name__ == "__main__":
    main()
