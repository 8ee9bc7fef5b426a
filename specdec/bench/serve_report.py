"""What a serving benchmark's runs become: each run's summary (percentiles, throughput, acceptance, tokens a
pass), the off / on TPOT ratio of each repeat, the markdown tables and the plot (specdec/bench/serve_bench.py
drives the servers)."""
from __future__ import annotations

import statistics
from pathlib import Path

PCTS = (50, 90, 99)


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {f"p{p}": None for p in PCTS}
    xs = sorted(xs)
    return {f"p{p}": round(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] * 1000, 2) for p in PCTS}


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    drafted = sum((r["spec"] or {}).get("num_draft_tokens", 0) for r in ok)
    accepted = sum((r["spec"] or {}).get("num_accepted_draft_tokens", 0) for r in ok)
    passes = sum((r["spec"] or {}).get("target_forward_passes", 0) for r in ok)  # decode passes (speculating requests)
    decoded = sum(r["tokens"] - 1 for r in ok if r["spec"])  # their tokens after the prompt pass's first
    return {"requests": len(results), "failed": len(results) - len(ok), "duration_s": round(duration, 2),
            "output_tokens": tokens, "output_tok_s": round(tokens / duration, 2),
            "requests_per_s": round(len(ok) / duration, 3),
            "ttft_ms": _pcts([r["ttft"] for r in ok]), "tpot_ms": _pcts([r["tpot"] for r in ok if r["tpot"]]),
            "itl_ms": _pcts([x for r in ok for x in r["itl"]]), "e2e_ms": _pcts([r["e2e"] for r in ok]),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_pass": round(decoded / passes, 3) if passes else None,
            "drafted_per_pass": round(drafted / passes, 3) if passes else None,
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}  # what failed, not only how many


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for setting in sorted({r["setting"] for r in rows}):
        rs = sorted((r for r in rows if r["setting"] == setting and r["rate"] == "inf" and not r.get("repeat")),
                    key=lambda r: r["concurrency"])  # the first repeat
        c = [r["concurrency"] for r in rs]
        a.plot(c, [r["tpot_ms"]["p50"] for r in rs], "o-", label=f"speculation {setting}")
        b.plot(c, [r["output_tok_s"] for r in rs], "o-", label=f"speculation {setting}")
    for ax, title in ((a, "TPOT p50 (ms, lower is better)"), (b, "output tokens/s (higher is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(rows: list[dict]) -> str:
    head = ("| setting | conc. | rate | req | failed | out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | "
            "ITL p50/p90/p99 ms | e2e p50/p90/p99 ms | accept | tokens / drafted a pass |\n|" + "---|" * 12)
    fmt = lambda d: "/".join("-" if d[f"p{p}"] is None else f"{d[f'p{p}']:.0f}" for p in PCTS)  # noqa: E731
    lines = [f"| {r['setting']} | {r['concurrency']} | {r['rate']} | {r['requests']} | {r['failed']} | "
             f"{r['output_tok_s']:.1f} | "
             f"{fmt(r['ttft_ms'])} | {fmt(r['tpot_ms'])} | {fmt(r['itl_ms'])} | {fmt(r['e2e_ms'])} | "
             f"{'-' if r['acceptance_rate'] is None else r['acceptance_rate']} | {_per_pass(r)} |" for r in rows]
    return "\n".join([head, *lines])


def _per_pass(row: dict) -> str:
    """Tokens and drafted tokens a decode pass of the speculating requests ('-' for none; rows before S47 lack them)."""
    if row.get("tokens_per_pass") is None:
        return "-"
    return f"{row['tokens_per_pass']:.2f} / {row['drafted_per_pass']:.2f}"


def tpot_ratios(rows: list[dict]) -> list[dict]:
    """Per concurrency and rate: off / on TPOT p50 of each repeat that both settings ran with no request failed
    (percentiles over the survivors of one side only would compare other requests), their median and range."""
    by_run: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["tpot_ms"]["p50"] is not None and not r.get("failed"):
            by_run.setdefault((r["concurrency"], r["rate"], r.get("repeat", 0)), {})[r["setting"]] = r["tpot_ms"]["p50"]
    out: dict[tuple, list[float]] = {}
    for (c, rate, _), tpot in by_run.items():  # in the order the runs ran
        if "off" in tpot and "on" in tpot:
            out.setdefault((c, rate), []).append(round(tpot["off"] / tpot["on"], 3))
    return [{"concurrency": c, "rate": rate, "ratios": xs, "median": statistics.median(xs), "min": min(xs),
             "max": max(xs)} for (c, rate), xs in out.items()]


def _ratio_table(ratios: list[dict]) -> str:
    lines = [f"| {r['concurrency']} | {r['rate']} | {len(r['ratios'])} | **{r['median']:.3f}x** | "
             f"{r['min']:.3f}-{r['max']:.3f}x | {', '.join(f'{x:.3f}' for x in r['ratios'])} |" for r in ratios]
    return "\n".join(["| conc. | rate | runs | TPOT off / on, median | range | each run |", "|" + "---|" * 6, *lines])


def report_tables(rows: list[dict], ratios: list[dict]) -> str:
    """The runs' table, then (where both settings ran) the TPOT ratios'."""
    return _table(rows) + ("\n\n" + _ratio_table(ratios) if ratios else "")
