"""Host-side costs of a small GPU step: a kernel launch, a wait, and small copies each way.

    python -m specdec.bench.gpu_host --out runs/gpu

At batch 1 a decode step moves a few bytes each way and launches hundreds of small kernels, so what
it costs is mostly the host's: session 24's engine decoded at ~49 ms a token against an ~11 ms eager
forward on a lent H200 in a sandboxed VM. This probe times, by the host's clock, each primitive a
step uses: a launch (1,000 in a row, then one wait), a wait on an idle stream, 8 int64 to the device
from pageable and from pinned memory, 8 back by `.tolist()` and through a pinned buffer, and 600 tiny
kernels eager against the same 600 replayed as one CUDA graph. Medians of `--repeats` in microseconds.
Without CUDA (a test) it reports what a CPU can: nothing but the launch row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

KERNELS = 600  # ~ the 135M model's eager forward: 30 layers x ~20 ops


def host_us(fn: Callable[[], object], repeats: int, warmup: int = 3) -> dict:
    """Median / min / max host microseconds of fn() (which ends with whatever wait it needs)."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(1e6 * (time.perf_counter() - t0))
    return {"us_median": round(statistics.median(times), 2), "us_min": round(min(times), 2),
            "us_max": round(max(times), 2)}


def probe(device: torch.device, repeats: int) -> dict[str, dict]:
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    x = torch.zeros(1, device=device)
    rows: dict[str, dict] = {}

    def launches():
        for _ in range(1000):
            x.add_(1)
        sync()
    r = host_us(launches, max(3, repeats // 10))
    rows["launch (per kernel, 1000 then one wait)"] = {k: round(v / 1000, 3) for k, v in r.items()}
    if not cuda:
        return rows
    rows["wait on an idle stream"] = host_us(sync, repeats)
    ids = list(range(8))
    pinned = torch.zeros(8, dtype=torch.long, pin_memory=True)
    on_dev = torch.zeros(8, dtype=torch.long, device=device)
    rows["8 int64 to the device, pageable (torch.tensor(list, device=))"] = host_us(
        lambda: (torch.tensor(ids, device=device), sync()), repeats)
    rows["8 int64 to the device, pinned, non_blocking + wait"] = host_us(
        lambda: (pinned.copy_(torch.tensor(ids)), on_dev.copy_(pinned, non_blocking=True), sync()), repeats)
    rows["8 int64 to the host, .tolist()"] = host_us(lambda: on_dev.tolist(), repeats)
    rows["8 int64 to the host, pinned buffer, non_blocking + wait"] = host_us(
        lambda: (pinned.copy_(on_dev, non_blocking=True), sync(), pinned.tolist()), repeats)

    def many():
        for _ in range(KERNELS):
            x.add_(1)
    rows[f"{KERNELS} tiny kernels, eager, then a wait"] = host_us(lambda: (many(), sync()), max(3, repeats // 5))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        many()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        many()
    rows[f"{KERNELS} tiny kernels, one graph replay, then a wait"] = host_us(lambda: (graph.replay(), sync()), repeats)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "repeats": args.repeats, "rows": probe(device, args.repeats)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_host.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Host-side costs on {report['device']} (torch {report['torch']}, median of {args.repeats})", "",
             "| what | us median | min | max |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['us_median']} | {v['us_min']} | {v['us_max']} |" for k, v in report["rows"].items()]
    (args.out / "gpu_host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return report


if __name__ == "__main__":
    main()
