"""A/B of the KV cache's dtype in one process: the serving engine's paged pass (BatchKV, the attention and layer
kernels) over an fp32 pool against a bf16 one (--kv-cache-dtype bfloat16), by rows, new tokens per row and
cached tokens; the two alternate within each round (and which goes first, from round to round), so the
machine's drift falls on both.

    python scripts/ab_kv_cache.py [--dtype bfloat16] [--amx] [--rounds 5]

Figures of session 41: docs/benchmarks/serving.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.cache.paged_cache import BatchKV, PagedKVPool  # noqa: E402
from specdec.llm import LLM  # noqa: E402

# (rows, new tokens per row, cached tokens per row)
CASES = [(1, 1, 250), (1, 1, 1000), (1, 4, 1000), (4, 1, 250), (4, 4, 250), (16, 1, 250), (16, 3, 250), (16, 1, 500)]
BLOCK = 16


def time_pass(model, pool, rows: int, new: int, cached: int, reps: int) -> float:
    """Median seconds of one paged pass over `rows` rows of `new` tokens after `cached` tokens each."""
    per_row = -(-(cached + new) // BLOCK)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    ids = torch.randint(0, model.config.vocab_size, (rows, new))
    positions = (torch.arange(new) + cached).expand(rows, new)
    times = []
    for _ in range(reps):
        kv = BatchKV(pool, tables, [cached] * rows, [new] * rows)
        t0 = time.perf_counter()
        model(ids, positions, kv)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--amx", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=15, help="passes per case and round (their median is the round's)")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, num_threads=args.threads, amx=args.amx,
              enforce_eager=True, progress=False)
    model = llm.model
    need = max(rows * -(-(cached + new) // BLOCK) for rows, new, cached in CASES)
    pools = {dt: PagedKVPool.for_model(model.config, need, BLOCK, dt) for dt in (torch.float32, torch.bfloat16)}
    for pool in pools.values():  # keys and values of a plausible scale (the scores then are not all -inf or nan)
        pool.k.normal_(), pool.v.normal_()
    took: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for case in CASES:
                for dt in (torch.float32, torch.bfloat16)[::1 if r % 2 == 0 else -1]:  # who goes first alternates
                    took.setdefault((case, dt), []).append(time_pass(model, pools[dt], *case, args.reps))
    print(f"{llm.info()['model']}, {args.dtype}{' on AMX tiles' if llm.amx else ''}, {torch.get_num_threads()} threads; "
          f"medians of {args.rounds} rounds x {args.reps} passes")
    print("| rows x new tokens | cached tokens a row | fp32 cache (ms) | bf16 cache (ms) | bf16 / fp32, median (range) |")
    print("|---|---|---|---|---|")
    for case in CASES:
        a, b = took[(case, torch.float32)], took[(case, torch.bfloat16)]
        ratios = sorted(y / x for x, y in zip(a, b))
        print(f"| {case[0]} x {case[1]} | {case[2]} | {statistics.median(a) * 1e3:.2f} | {statistics.median(b) * 1e3:.2f} "
              f"| {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) |")


if __name__ == "__main__":
    main()
