"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed).

    speedup by category and system (median, min-max error bars), acceptance by draft position,
    tokens/s vs k (the k sweep), and the target's cost curve c(k)/c(1).
"""
from __future__ import annotations

from pathlib import Path

from specdec.bench.systems import BASELINE


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _speedup(plt, summary: dict, path: Path) -> None:
    cats = summary["categories"]
    systems = [n for n in summary["systems"] if n != BASELINE]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cats) + 2), 5))
    width = 0.8 / max(len(systems), 1)
    for j, name in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(cats):
            s = summary["table"][name].get(c, {}).get("speedup") or {}
            if s:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], label=name, capsize=2)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("speedup over specdec plain (tokens/s ratio)")
    ax.set_title("Speedup by category and system (median, min-max over repeats)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positions(plt, summary: dict, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drew = False
    for name in summary["systems"]:
        acc = summary["table"][name].get("all", {}).get("acceptance_by_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            drew = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate at this position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all categories)")
    if drew:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def _sweep(plt, summary: dict, path: Path) -> bool:
    if not summary["sweep"]:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, pts in summary["sweep"].items():
        pts = sorted(pts, key=lambda p: p["k"])
        ax.plot([p["k"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o", label=method)
    if summary["sweep_plain_tokens_per_s"]:
        ax.axhline(summary["sweep_plain_tokens_per_s"], color="k", ls="--", lw=0.8, label="plain")
    ax.set_xlabel("k (drafted tokens per step, fixed)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Tokens/s vs k (sweep prompts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cost(plt, run: dict, path: Path) -> None:
    cc = run["cost_curve"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(cc["ks"], cc["relative"], marker="o", ms=3, label="measured c(k)/c(1)")
    ax.plot(cc["ks"], cc["ks"], ls=":", color="gray", label="linear (compute-bound)")
    ax.axhline(1.0, ls="--", color="k", lw=0.8, label="flat (memory-bound)")
    ax.set_xlabel("k: new tokens in one target forward")
    ax.set_ylabel("cost relative to k = 1")
    ax.set_ylim(0, max(cc["relative"]) * 1.15)
    ax.set_title(f"Target forward cost curve ({run['dtype']}, {run['threads']} threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(run: dict, summary: dict, out_dir: Path, prefix: str) -> dict[str, str]:
    """Write the PNGs; returns {title: file name relative to out_dir}."""
    plt = _plt()
    out: dict[str, str] = {}
    name = f"{prefix}-speedup.png"
    _speedup(plt, summary, out_dir / name)
    out["Speedup by category and system"] = name
    name = f"{prefix}-acceptance-by-position.png"
    if _positions(plt, summary, out_dir / name):
        out["Acceptance by draft position"] = name
    name = f"{prefix}-tokens-vs-k.png"
    if _sweep(plt, summary, out_dir / name):
        out["Tokens/s vs k"] = name
    name = f"{prefix}-cost-curve.png"
    _cost(plt, run, out_dir / name)
    out["Cost curve"] = name
    return out
