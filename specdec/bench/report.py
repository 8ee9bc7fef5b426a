"""Summaries of the raw benchmark records, and the Markdown / JSON report.

Every figure is computed here from the raw records (kept in the JSON), never typed in:

    tokens/s (system, category, repeat)  = sum new tokens / sum wall seconds over the category's prompts
    speedup  (system, category, repeat)  = tokens/s / tokens/s of specdec:plain in the same repeat
    reported: the median over repeats, with the min-max spread
    decode tokens/s                      = sum (new tokens - first) / sum (seconds - time to first tokens)
    decode speedup                       = decode tokens/s / plain's decode tokens/s, same repeat
    tau                                  = 1 + accepted / drafting steps   (specdec methods)
    acceptance rate                      = accepted / drafted tokens
    tokens per pass                      = (new tokens - 1) / target passes after the prefill (all systems)
"""
from __future__ import annotations

import json
from pathlib import Path

from specdec.bench.outputs import outputs_line
from specdec.bench.systems import BASELINE
from specdec.model.output_dir import write_atomic
from specdec.spec.adaptive import MAX_MATCH_KEY
from specdec.spec.metrics import match_length_table


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _spread(xs: list[float]) -> dict:
    return {"median": _median(xs), "min": min(xs), "max": max(xs), "per_repeat": xs} if xs else {}


def _rate(recs: list[dict]) -> float:
    secs = sum(r["seconds"] for r in recs)
    return sum(r["new_tokens"] for r in recs) / secs if secs > 0 else 0.0


def _decode_rate(recs: list[dict]) -> float | None:
    usable = [r for r in recs if r["prefill_seconds"] is not None]
    secs = sum(r["seconds"] - r["prefill_seconds"] for r in usable)
    if not usable or secs <= 0:
        return None
    return sum(max(r["new_tokens"] - r.get("first_tokens", 1), 0) for r in usable) / secs


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for xs in lists:
        out.extend([0] * (len(xs) - len(out)))
        for i, v in enumerate(xs):
            out[i] += v
    return out


def summarize_cell(recs: list[dict], base: list[dict]) -> dict:
    """Figures for one system on one set of prompts; base: the baseline's records on the same prompts."""
    repeats = sorted({r["repeat"] for r in recs})
    tps, speedup, decode, decode_speedup = [], [], [], []
    for rep in repeats:
        mine = [r for r in recs if r["repeat"] == rep]
        theirs = [r for r in base if r["repeat"] == rep]
        tps.append(_rate(mine))
        if theirs and _rate(theirs) > 0:
            speedup.append(_rate(mine) / _rate(theirs))
        d, d_base = _decode_rate(mine), _decode_rate(theirs) if theirs else None
        if d is not None:
            decode.append(d)
            if d_base:
                decode_speedup.append(d / d_base)
    drafts = sum(r["num_drafts"] for r in recs)
    drafted = sum(r["num_draft_tokens"] for r in recs)
    accepted = sum(r["num_accepted_tokens"] for r in recs)
    passes = [r["target_passes"] for r in recs if r["target_passes"] is not None]
    acc_pos = _sum_lists([r["accepted_per_pos"] for r in recs])
    drf_pos = _sum_lists([r["drafted_per_pos"] for r in recs])
    by_match: dict[str, list[int]] = {}
    for r in recs:
        for n, row in (r.get("by_match_length") or {}).items():
            by_match[n] = [a + b for a, b in zip(by_match.get(n, [0, 0, 0]), row)]
    peaks = [r["peak_rss_mb"] for r in recs if r["peak_rss_mb"] is not None]
    extras = [r["extra_rss_mb"] for r in recs if r.get("extra_rss_mb") is not None]
    return {
        "tokens_per_s": _spread(tps), "speedup": _spread(speedup), "decode_tokens_per_s": _spread(decode),
        "decode_speedup": _spread(decode_speedup),
        "new_tokens_per_repeat": sum(r["new_tokens"] for r in recs) / max(len(repeats), 1),
        "tau": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_pass": (sum(max(r["new_tokens"] - 1, 0) for r in recs if r["target_passes"] is not None)
                            / sum(passes)) if passes and sum(passes) else None,
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(acc_pos, drf_pos)],
        "lookup_by_match_length": match_length_table(by_match),
        "draft_seconds": sum(r["draft_seconds"] for r in recs),
        "peak_rss_mb": max(peaks) if peaks else None,
        "extra_rss_mb": max(extras) if extras else None,
    }


def summarize_run(run: dict) -> dict:
    recs = run["records"]
    systems = [s["name"] for s in run["systems"] if s["ok"]]
    categories = list(dict.fromkeys(r["category"] for r in recs)) + ["all"]
    table: dict[str, dict[str, dict]] = {}
    for name in systems:
        table[name] = {}
        for cat in categories:
            mine = [r for r in recs if r["system"] == name and cat in ("all", r["category"])]
            base = [r for r in recs if r["system"] == BASELINE and cat in ("all", r["category"])]
            if mine:
                table[name][cat] = summarize_cell(mine, base)
    sweep = {}
    for name in dict.fromkeys(r["system"] for r in run.get("sweep_records", [])):
        if name == BASELINE:
            continue
        mine = [r for r in run["sweep_records"] if r["system"] == name]
        base = [r for r in run["sweep_records"] if r["system"] == BASELINE]
        method, k = name.split(":", 1)[1].rsplit("@k", 1)
        cell = summarize_cell(mine, base)
        sweep.setdefault(method, []).append({"k": int(k), "tokens_per_s": cell["tokens_per_s"]["median"],
                                             "speedup": cell["speedup"]["median"], "tau": cell["tau"]})
    base_sweep = [r for r in run.get("sweep_records", []) if r["system"] == BASELINE]
    return {"categories": categories, "systems": systems, "table": table, "sweep": sweep,
            "sweep_plain_tokens_per_s": _rate(base_sweep) if base_sweep else None,
            "foundation": foundation(run, table), "best": best_vs_peers(run, table, categories)}


def foundation(run: dict, table: dict) -> dict:
    bound = run["bandwidth_gb_s"] * 1e9 / run["weight_bytes_per_token"]
    plain = table.get(BASELINE, {}).get("all", {}).get("decode_tokens_per_s", {}).get("median")
    hf = table.get("transformers:greedy", {}).get("all", {}).get("decode_tokens_per_s", {}).get("median")
    return {"plain_decode_tokens_per_s": plain, "transformers_decode_tokens_per_s": hf,
            "plain_vs_transformers": plain / hf if plain and hf else None,
            "bandwidth_gb_s": run["bandwidth_gb_s"], "weight_mb_per_token": run["weight_bytes_per_token"] / 2**20,
            "bound_tokens_per_s": bound, "fraction_of_bound": plain / bound if plain else None,
            "cost_relative": dict(zip(run["cost_curve"]["ks"], run["cost_curve"]["relative"])),
            "load_seconds": run.get("load_seconds")}


def best_vs_peers(run: dict, table: dict, categories: list[str]) -> dict:
    """Per category: our best system against every peer's best, at our precision and at any."""
    by_name = {s["name"]: s["describe"] for s in run["systems"] if s["ok"]}
    ours = [n for n in table if by_name[n]["family"] == "specdec"]
    peers = [n for n in table if by_name[n]["family"] != "specdec"]
    out = {}
    for cat in categories:
        def tps(n):
            return table[n].get(cat, {}).get("tokens_per_s", {}).get("median", 0.0)
        best = max(ours, key=tps)
        row = {"ours": best, "ours_tokens_per_s": tps(best), "peers": {}}
        for fam in sorted({by_name[p]["family"] for p in peers}):
            for same in (True, False):
                group = [p for p in peers if by_name[p]["family"] == fam
                         and (by_name[p]["precision"] == run["dtype"]) == same]
                if group:
                    b = max(group, key=tps)
                    row["peers"][f"{fam} ({'same precision' if same else 'own precision'})"] = {
                        "system": b, "tokens_per_s": tps(b), "ours_over_peer": tps(best) / tps(b) if tps(b) else None}
        out[cat] = row
    return out


# ---------------------------------------------------------------- Markdown
def _f(x, nd=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{nd}f}{suffix}"


def _cell_speedup(c: dict, baseline: bool = False) -> str:
    s = c.get("speedup") or {}
    if not s:
        return "-"
    if baseline:
        return "1.00x (baseline)"
    if len(s["per_repeat"]) == 1:
        return f"{s['median']:.2f}x"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def _system_table(summary: dict, metric, pass_baseline: bool = False) -> list[str]:
    cats = summary["categories"]
    lines = ["| system | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name in summary["systems"]:
        extra = (name == BASELINE,) if pass_baseline else ()
        cells = [metric(summary["table"][name].get(c, {}), *extra) for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict, summaries: dict, plots: dict) -> str:
    cfg, env = result["config"], result["environment"]
    L = [f"# specdec benchmark ({result['started']})", "",
         f"Model `{cfg['model']}`; {decoding(cfg)}; {cfg['prompts_per_category']} prompts per category, up to "
         f"{cfg['max_tokens']} new tokens each, {cfg['repeats']} repeats (median, min-max across repeats).",
         f"CPU: {env['cpu']} ({env['cores']} cores; flags {', '.join(env['cpu_flags']) or '-'}); threads "
         f"{env['threads']}; torch {env['torch']}, transformers {env['transformers']}, llama-cpp-python "
         f"{env['llama_cpp_python'] or 'not installed'}; Python {env['python']}.",
         f"Load average at start {env['load_average']}, at end {env['load_average_end']}: the machine is shared, so "
         "absolute numbers are noisy; every ratio is measured inside one repeat with all systems interleaved "
         "prompt by prompt.", f"Wall time of the benchmark: {result['wall_seconds']:.0f} s.", "",
         "Regenerate: `specdec bench " + " ".join(_cli_flags(cfg)) + "`.", ""]
    for dt, run in result["runs"].items():
        s = summaries[dt]
        fd = s["foundation"]
        L += [f"## {dt}", "", outputs_line(run["records"], cfg.get("temperature") or 0.0), "",
              "### Foundation", "",
              "| figure | value |", "|---|---|",
              f"| plain decode, specdec (tokens/s, decode only) | {_f(fd['plain_decode_tokens_per_s'], 1)} |",
              f"| plain decode, transformers generate (same prompts) | {_f(fd['transformers_decode_tokens_per_s'], 1)} |",
              f"| specdec / transformers | {_f(fd['plain_vs_transformers'])}x |",
              f"| streaming-read bandwidth (GB/s) | {_f(fd['bandwidth_gb_s'], 1)} |",
              f"| weights read per token (MiB) | {_f(fd['weight_mb_per_token'], 1)} |",
              f"| bandwidth bound (tokens/s) | {_f(fd['bound_tokens_per_s'], 1)} |",
              f"| specdec plain, fraction of the bound | {_f(fd['fraction_of_bound'])} |",
              f"| model load from the conversion cache (s) | {_f(fd.get('load_seconds'))} |", "",
              "Cost of one target forward over k new tokens relative to k = 1 (prefix of "
              f"{run['cost_curve']['prefix_len']} tokens; median of 5):", "",
              "| k | " + " | ".join(str(k) for k in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32) if k in fd["cost_relative"]) + " |",
              "|---" * (1 + sum(k in fd["cost_relative"] for k in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32))) + "|",
              "| c(k)/c(1) | " + " | ".join(f"{fd['cost_relative'][k]:.2f}" for k in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
                                           if k in fd["cost_relative"]) + " |", ""]
        L += ["### Speedup over specdec plain decoding (tokens/s ratio, same run)", ""]
        L += _system_table(s, _cell_speedup, pass_baseline=True) + [""]
        L += ["### Speedup of the decode phase only (prefill excluded)", "",
              "Decode tokens/s = (new tokens - first tokens) / (wall - time to the first tokens), both timed inside "
              "the same generation (our decoder's prefill timer; a streamer on transformers; the first yielded "
              "token of llama.cpp). transformers' assisted generation verifies its first drafts in the prefill "
              "pass, so its first emission can hold several tokens.", ""]
        L += _system_table(s, lambda c, base: _cell_speedup({"speedup": c.get("decode_speedup")}, base),
                           pass_baseline=True) + [""]
        L += ["### Tokens/s (wall clock, prefill included; median over repeats)", ""]
        L += _system_table(s, lambda c: _f((c.get("tokens_per_s") or {}).get("median"), 1)) + [""]
        L += ["### tau (accepted + 1 per drafting step) / acceptance rate / tokens per target pass", "",
              "tau and acceptance come from our decoder's metrics; tokens per pass is counted for every system "
              "(forward hooks on the peers) and includes steps where nothing was drafted.", ""]
        L += _system_table(s, lambda c: f"{_f(c.get('tau'))} / {_f(c.get('acceptance_rate'))} / "
                                        f"{_f(c.get('tokens_per_pass'))}" if c else "-") + [""]
        L += _match_length_section(s)
        L += _systems_section(run, s)
        L += _best_section(s)
        for title, fname in plots.get(dt, {}).items():
            L += [f"![{title}]({fname})", ""]
    return "\n".join(L) + "\n"


def _match_length_section(s: dict) -> list[str]:
    """Acceptance of lookup chains by the length of the context match that found them, all categories."""
    rows = {name: cells["all"]["lookup_by_match_length"] for name, cells in s["table"].items()
            if (cells.get("all") or {}).get("lookup_by_match_length")}
    if not rows:
        return []
    lengths = sorted({int(n) for t in rows.values() for n in t})
    L = ["### Lookup chains by match length (all categories): acceptance rate (chains drafted)", "",
         "What adaptive k prices a lookup's chain by: the acceptance of chains found after a match of n context "
         f"tokens (n = {MAX_MATCH_KEY} counts matches of {MAX_MATCH_KEY} or more).", "",
         "| system | " + " | ".join(f"n = {n}" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name, t in rows.items():
        L.append(f"| {name} | " + " | ".join(
            f"{t[str(n)]['acceptance_rate']:.2f} ({t[str(n)]['drafts']})" if str(n) in t else "-" for n in lengths) + " |")
    return L + [""]


def _standalone_mb(run: dict, st: dict, cell: dict) -> float | None:
    """Estimated peak RSS of the system alone: runtime + its weights (ours: the target's and the
    drafter's) + its largest per-generation rise."""
    base, setup, gen = run.get("base_rss_mb"), st["setup_rss_mb"], cell.get("extra_rss_mb")
    if base is None or setup is None or gen is None:
        return None
    own = (run.get("target_rss_mb") or 0.0) if st["describe"]["family"] == "specdec" else 0.0
    return base + own + max(setup, 0.0) + gen


def _systems_section(run: dict, s: dict) -> list[str]:
    L = ["### Systems", "", "| system | precision | config | setup (s) | weights loaded (MB) | generation RSS (MB) | "
         "~ standalone peak RSS (MB) | new tokens / repeat | note |", "|---" * 9 + "|"]
    for st in run["systems"]:
        d = st["describe"]
        cell = s["table"].get(st["name"], {}).get("all", {})
        cfg = json.dumps(d["config"], sort_keys=True) if d["config"] else ""
        L.append(f"| {st['name']} | {d['precision']} | `{cfg}` | {st['setup_seconds']:.1f} | {_f(st['setup_rss_mb'], 0)} | "
                 f"{_f(cell.get('extra_rss_mb'), 0)} | {_f(_standalone_mb(run, st, cell), 0)} | "
                 f"{_f(cell.get('new_tokens_per_repeat'), 0)} | "
                 f"{'' if st['ok'] else 'SKIPPED: '}{st['note']} |")
    for sk in run["skipped"]:
        L.append(f"| {sk['name']} | | | | | | | | SKIPPED: {sk['reason']} |")
    peak = max((c.get("all", {}).get("peak_rss_mb") or 0.0 for c in s["table"].values()), default=0.0)
    L += ["", f"Every system lives in one process (peak RSS of the whole process: {peak:.0f} MB), so memory is "
          "given per system: the RSS its setup added (its weights; our methods share the target's "
          f"{_f(run.get('target_rss_mb'), 0)} MB), the largest rise during one of its generations (VmHWM reset "
          "before each: KV cache, activations), and an estimate of its peak alone = runtime "
          f"({_f(run.get('base_rss_mb'), 0)} MB before any model) + weights + that rise.", ""]
    if run.get("draft_model"):
        dm = run["draft_model"]
        layers = f"target layers {dm['layers']}" if dm.get("layers") else "a layer subset of the target"
        L += [f"Draft model (draft_model, transformers:assisted): `{dm['dir']}`" +
              (f" (made by the benchmark: {layers}, not distilled, so acceptance is low; pass a trained "
               "one with --draft-model)" if dm["auto"] else ""), ""]
    return L


def _best_section(s: dict) -> list[str]:
    L = ["### Our best vs each peer's best (tokens/s ratio, same run)", "",
         "| category | our best | " + " | ".join(next(iter(s["best"].values()))["peers"]) + " |",
         "|---" * (2 + len(next(iter(s["best"].values()))["peers"])) + "|"]
    for cat, row in s["best"].items():
        cells = [f"{v['system']}: {_f(v['ours_over_peer'])}x" for v in row["peers"].values()]
        L.append(f"| {cat} | {row['ours']} ({row['ours_tokens_per_s']:.1f} tok/s) | " + " | ".join(cells) + " |")
    return L + [""]


def decoding(cfg: dict) -> str:
    """How the run decoded: greedy, or sampled (every system, a seed per prompt)."""
    t, r = cfg.get("temperature") or 0.0, cfg.get("repetition_penalty") or 1.0
    how = "greedy" if t == 0 else f"sampled at temperature {t:g} (a seed per prompt, the same for every system)"
    how = how if r == 1.0 else f"{how}, repetition penalty {r:g}"
    how = f"{how}; bf16 decode and verify matmuls on AMX tiles (--amx)" if cfg.get("amx") else how
    kv = cfg.get("kv_cache_dtype", "auto")
    return how if kv == "auto" else f"{how}; KV caches in {kv} (--kv-cache-dtype)"


def _cli_flags(cfg: dict) -> list[str]:
    flags = [f"--model {cfg['model']}", f"--dtype {','.join(cfg['dtypes'])}",
             f"--prompts-per-category {cfg['prompts_per_category']}", f"--max-tokens {cfg['max_tokens']}",
             f"--repeats {cfg['repeats']}"]
    if cfg.get("temperature"):
        flags.append(f"--temperature {cfg['temperature']:g}")
    if (cfg.get("repetition_penalty") or 1.0) != 1.0:
        flags.append(f"--repetition-penalty {cfg['repetition_penalty']:g}")
    if cfg.get("threads"):
        flags.append(f"--threads {cfg['threads']}")
    if cfg.get("amx"):
        flags.append("--amx")
    if cfg.get("kv_cache_dtype", "auto") != "auto":
        flags.append(f"--kv-cache-dtype {cfg['kv_cache_dtype']}")
    if cfg.get("categories"):
        flags.append(f"--categories {','.join(cfg['categories'])}")
    if cfg.get("methods") is not None:
        flags.append(f"--methods {','.join(cfg['methods'])}")
    if cfg.get("peers") is not None:
        flags.append(f"--peers {','.join(cfg['peers']) or 'none'}")
    if cfg.get("draft_model") != "auto":
        flags.append(f"--draft-model {cfg.get('draft_model') or 'none'}")
    if list(cfg.get("sweep_ks") or []) != [1, 2, 4, 8]:
        flags.append(f"--sweep-k {','.join(map(str, cfg['sweep_ks'])) or 'none'}")
    if cfg.get("sweep_methods"):
        flags.append(f"--sweep-methods {','.join(cfg['sweep_methods'])}")
    if list(cfg.get("sweep_categories") or []) not in ([], ["chat", "summarization", "rag", "code"]):
        flags.append(f"--sweep-categories {','.join(cfg['sweep_categories'])}")
    return flags + ["--out DIR"]


def compact_table(result: dict, summaries: dict) -> str:
    """The README's table: speedup over plain decoding per system and category (median of repeats),
    with the setting it was measured in."""
    cfg, env = result["config"], result["environment"]
    out = []
    for dt, s in summaries.items():
        fd = s["foundation"]
        out += [f"Measured {result['started'][:10]} on {env['cpu']} ({env['threads']} threads, {dt}, load average "
                f"{env['load_average'][0]:.1f}); `{cfg['model']}`, {decoding(cfg)}, {cfg['prompts_per_category']} prompts per "
                f"category, {cfg['max_tokens']} new tokens, {cfg['repeats']} repeats. Plain decoding "
                f"{_f(fd['plain_decode_tokens_per_s'], 1)} tok/s ({_f(fd['fraction_of_bound'])} of the "
                f"bandwidth bound), transformers {_f(fd['transformers_decode_tokens_per_s'], 1)} tok/s.", ""]
        out += _system_table(s, lambda c, base=False: "1.00x" if base else
                             (f"{c['speedup']['median']:.2f}x" if c.get("speedup") else "-"), pass_baseline=True)
        out.append("")
    out.append("Regenerate: `specdec bench " + " ".join(_cli_flags(cfg)) + "` (full report: "
               "docs/benchmarks/).")
    return "\n".join(out) + "\n"


def write_report(result: dict, out_dir: Path, stem: str = "report", plots: bool = True) -> dict[str, Path]:
    """NAME.md + NAME.json + NAME-table.md (the README table) (+ PNG plots) in out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {dt: summarize_run(run) for dt, run in result["runs"].items()}
    figs: dict[str, dict[str, str]] = {}
    if plots:
        from specdec.bench.plots import make_plots
        figs = {dt: make_plots(result["runs"][dt], summaries[dt], out_dir, f"{stem}-{dt}") for dt in summaries}
    # each file whole or not at all: `bench --from-json X/report.json --out X` rewrites the run's only raw data
    md, js, table = out_dir / f"{stem}.md", out_dir / f"{stem}.json", out_dir / f"{stem}-table.md"
    texts = {md: markdown(result, summaries, figs), table: compact_table(result, summaries),
             js: json.dumps(dict(result, summary=summaries), indent=1, default=str)}
    for path, text in texts.items():
        write_atomic(path, text)
    return {"markdown": md, "json": js, "table": table, **{f"{dt}:{k}": out_dir / v for dt, f in figs.items() for k, v in f.items()}}
