"""`specdec bench`: the benchmark (our methods x prompt categories, with peers, in one run).

    specdec bench --out docs/benchmarks/latest                       # defaults: fp32, 3 prompts/category
    specdec bench --prompts-per-category 2 --max-tokens 64 --repeats 2 --bf16 --out /tmp/b
    specdec bench --methods ngram,suffix --peers transformers --sweep-k none --json
    specdec bench --from-json docs/benchmarks/x/report.json --out docs/benchmarks/x   # re-render only
    specdec bench serve ...                                          # the serving benchmark (if installed)
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from specdec.cli._common import at_least, json_object
from specdec.config import KV_CACHE_DTYPES, ConfigError


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark speculative methods and peers (Markdown + JSON + plots)",
                       description="Every speculative method x prompt category against plain decoding and "
                                   "peers (transformers, llama.cpp), interleaved in one run.")
    p.add_argument("--model", default="smollm2-135m", help="target model (alias, HF dir, .gguf)")
    p.add_argument("--dtype", default="float32", help="comma list: float32,bfloat16 (default float32)")
    p.add_argument("--bf16", action="store_true", help="also run everything in bfloat16")
    p.add_argument("--threads", type=at_least(0), default=None,
                   help="CPU threads for every system (default, 0: all cores)")
    p.add_argument("--prompts-per-category", type=int, default=3)
    p.add_argument("--categories", default=None, help="comma list (default: all)")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt (EOS may stop earlier)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0: every system samples at it, a seed per prompt (--peers none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="every system decodes with this repetition penalty (default 1: none; --peers none)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--amx", action="store_true",
                   help="bf16 on an Intel CPU with AMX: every system of ours on AMX tiles (plain included)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what every system of ours keeps its keys/values in (auto: the model's dtype)")
    p.add_argument("--methods", default=None, help="comma list of speculative methods (default: every registered one)")
    p.add_argument("--method-config", action="append", default=[], metavar="METHOD=JSON",
                   help="extra speculative_config keys for one method, e.g. ngram='{\"prompt_lookup_max\": 3}'")
    p.add_argument("--peers", default=None, help="comma list of peers or families (transformers, llama.cpp); 'none'")
    p.add_argument("--draft-model", default="auto",
                   help="draft model for draft_model and transformers' assisted generation: a path/alias, 'auto' "
                        "(a layer-truncated copy of the target) or 'none'")
    p.add_argument("--draft-layers", type=int, default=8, help="layers of the 'auto' draft model")
    p.add_argument("--sweep-k", default="1,2,4,8", help="fixed k values for the tokens/s-vs-k sweep, or 'none'")
    p.add_argument("--sweep-methods", default=None, help="comma list of methods in the k sweep (default: all that ran)")
    p.add_argument("--sweep-categories", default="chat,summarization,rag,code",
                   help="the sweep runs the first prompt of each of these categories")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the report and plots")
    p.add_argument("--name", default="report", help="file stem of the report (NAME.md, NAME.json, NAME-*.png)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, metavar="REPORT.json",
                   help="re-render the report (Markdown, table, plots) from a saved JSON instead of measuring")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=run)
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE")
    s = modes.add_parser("serve", help="the serving benchmark (specdec.bench.serve_bench)", add_help=False,
                        prefix_chars="+")  # every flag after "serve" belongs to the serving benchmark
    s.add_argument("serve_argv", nargs=argparse.REMAINDER, help="arguments for the serving benchmark")
    s.set_defaults(func=run_serve)


def run_serve(args) -> int:
    if importlib.util.find_spec("specdec.bench.serve_bench") is None:
        raise ConfigError("the serving benchmark is not available in this build (specdec/bench/serve_bench.py "
                          "is missing)")
    mod = importlib.import_module("specdec.bench.serve_bench")
    if not hasattr(mod, "run_serve_bench"):
        raise ConfigError("specdec.bench.serve_bench has no run_serve_bench(args)")
    if hasattr(mod, "add_arguments"):  # let the serving benchmark parse its own flags
        parser = argparse.ArgumentParser(prog="specdec bench serve")
        mod.add_arguments(parser)
        vars(args).update(vars(parser.parse_args(args.serve_argv)))
    return int(mod.run_serve_bench(args) or 0)


def _method_configs(items: list[str]) -> dict[str, dict]:
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--method-config wants METHOD=JSON, got {item!r}")
        out[name.strip()] = json_object(raw, f"--method-config {name}")
    return out


def config_from_args(args):
    from specdec.bench.harness import BenchConfig

    dtypes = _csv(args.dtype) + (("bfloat16",) if args.bf16 and "bfloat16" not in _csv(args.dtype) else ())
    for name, value in (("--prompts-per-category", args.prompts_per_category), ("--max-tokens", args.max_tokens),
                        ("--repeats", args.repeats)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1")
    peers = None if args.peers is None else (() if args.peers.strip() == "none" else _csv(args.peers))
    try:
        sweep = () if args.sweep_k.strip() == "none" else tuple(int(k) for k in _csv(args.sweep_k))
    except ValueError:
        raise ConfigError(f"--sweep-k wants comma-separated integers or 'none', got {args.sweep_k!r}") from None
    draft = None if args.draft_model == "none" else args.draft_model
    return BenchConfig(model=args.model, dtypes=dtypes, categories=_csv(args.categories) if args.categories else None,
                       prompts_per_category=args.prompts_per_category, max_tokens=args.max_tokens,
                       repeats=args.repeats, threads=args.threads,
                       methods=_csv(args.methods) if args.methods else None,
                       method_configs=_method_configs(args.method_config), peers=peers, draft_model=draft,
                       draft_layers=args.draft_layers, sweep_ks=sweep,
                       sweep_methods=_csv(args.sweep_methods) if args.sweep_methods else None,
                       sweep_categories=_csv(args.sweep_categories), temperature=args.temperature,
                       repetition_penalty=args.repetition_penalty, amx=args.amx, kv_cache_dtype=args.kv_cache_dtype)


def print_summary(summaries: dict, file=sys.stderr) -> None:
    for dt, s in summaries.items():
        fd = s["foundation"]
        print(f"\n[{dt}] plain decode {fd['plain_decode_tokens_per_s'] or 0:.1f} tok/s "
              f"(bound {fd['bound_tokens_per_s']:.1f}, fraction {fd['fraction_of_bound'] or 0:.2f}); "
              f"c(8)/c(1) = {fd['cost_relative'].get(8, float('nan')):.2f}", file=file)
        cats = s["categories"]
        print(f"{'speedup':32s}" + "".join(f"{c[:12]:>13s}" for c in cats), file=file)
        for name in s["systems"]:
            row = [(s["table"][name].get(c, {}).get("speedup") or {}).get("median") for c in cats]
            print(f"{name:32s}" + "".join(f"{'-' if v is None else f'{v:.2f}x':>13s}" for v in row), file=file)


def run(args) -> int:
    from specdec.bench.harness import run_benchmark
    from specdec.bench.report import summarize_run, write_report

    if args.from_json is not None:
        try:
            result = json.loads(args.from_json.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {args.from_json}: {e}") from None
        runs = result.get("runs") if isinstance(result, dict) else None
        if (not isinstance(runs, dict) or not runs or not all(isinstance(result.get(k), dict) for k in ("config", "environment"))
                or not all(isinstance(r, dict) and isinstance(r.get("records"), list) for r in runs.values())):
            raise ConfigError(f"{args.from_json} is not a bench report's report.json (it needs config, environment "
                              "and runs with their records)")
        result.pop("summary", None)
        args.out.mkdir(parents=True, exist_ok=True)
    else:
        cfg = config_from_args(args)
        args.out.mkdir(parents=True, exist_ok=True)  # a directory it cannot write fails now, not after the run
        result = run_benchmark(cfg, log=lambda *a: print(*a, file=sys.stderr, flush=True))
    try:
        paths = write_report(result, args.out, args.name, plots=not args.no_plots)
    except (KeyError, TypeError) as e:
        if args.from_json is None:
            raise
        raise ConfigError(f"{args.from_json} is not a bench report's report.json (no {e})") from None
    summaries = {dt: summarize_run(run) for dt, run in result["runs"].items()}
    print_summary(summaries)
    print(f"\nreport: {paths['markdown']}  (raw data: {paths['json']})", file=sys.stderr)
    if args.json:
        print(json.dumps({"config": result["config"], "environment": result["environment"], "summary": summaries},
                         default=str))
    return 0
