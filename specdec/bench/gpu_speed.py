"""Single-request decode speed on a GPU (or any device): plain decoding against speculative methods.

    python -m specdec.bench.gpu_speed --out runs/gpu --head specdec/assets/smollm2-135m-eagle3

One target at one dtype, greedy, batch 1, MT-bench first turns (or `--prompts FILE`, a JSON list of
strings, for a machine without the MT-bench package). Methods run one after the other, each after an
untimed run of the first prompt (its CUDA graphs captured), in two modes on a GPU: eager (`enforce_eager`, the first `--eager-prompts` prompts, as
eager decoding is slow there) and with CUDA graphs (model/cuda_graph.py, all prompts); each row is
compared with plain decoding of its mode on the same prompts; the "(width 16)" rows compute every pass 16 rows
wide (`pass_width`), so a 16-node tree's verify and the plain steps run the same kernels. Speculation is not adaptive here (fixed
k, fixed tree), so the figures are the methods' own. Reported per method: decode tokens per second
(all prompts' tokens over all their decode time), its ratio to plain, tokens per target pass, how many
outputs equal plain decoding's token for token (on a GPU in bf16 a verify pass over k tokens need not
sum in the order of a one-token pass, so an early tie can flip: the count says how often it did), and
the graphs' replay counts. Results are rewritten after every method (`gpu_speed.json`, `gpu_speed.md`),
so a time box that ends the run early still leaves what was measured. `--profile N` first profiles N
tokens of plain decoding, eager and graphed (`gpu_profile.txt`: the Python functions by cumulative and
own time, then torch's operators by CPU and device time), to find where a step goes besides the
model's kernels.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path
from typing import NamedTuple

import torch

from specdec.config import ConfigError


WIDE = 16  # the pass width of the "(width 16)" rows: a 16-node tree's verify


class Row(NamedTuple):
    config: dict | None  # speculative_config (None: plain decoding)
    eager: bool = False  # no CUDA graphs (on a CPU every row is eager: the graphs apply to CUDA only)
    pass_width: int = 1  # LLM(pass_width=): every pass at least this many rows wide


def methods(head: str | None) -> dict[str, Row]:
    """name -> how the row runs; graphed rows first (the eager ones are slow on a GPU)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    chain = {"method": "eagle3", "model": head, "num_steps": 5, "eagle_topk": 1, "adaptive": False}
    tree = {"method": "eagle3", "model": head, "num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 16,
            "adaptive": False}
    table = {"plain (eager)": Row(None, True), "plain": Row(None), "ngram k4": Row(ngram)}
    if head:
        table.update({"eagle3 chain 5": Row(chain), "eagle3 tree 5x4 (16)": Row(tree),
                      "eagle3 chain 3": Row({**chain, "num_steps": 3}),
                      "eagle3 tree 4x2 (8)": Row({**tree, "num_steps": 4, "eagle_topk": 2, "num_draft_tokens": 8}),
                      # the n-gram lookup first (free), the head's chain where it finds no match
                      "eagle3+ngram chain 3": Row({**chain, "num_steps": 3, "lookup": "ngram"})})
    table["ngram (adaptive)"] = Row({"method": "ngram"})  # what a user gets without flags
    if head:
        table["eagle3 (adaptive)"] = Row({"method": "eagle3", "model": head})
        # every pass as wide as the tree's verify: the same kernels for plain and speculative passes
        table[f"plain (width {WIDE})"] = Row(None, pass_width=WIDE)
        table[f"eagle3 tree 5x4 (16) (width {WIDE})"] = Row(tree, pass_width=WIDE)
    table["ngram k4 (eager)"] = Row(ngram, True)
    if head:
        table["eagle3 tree 5x4 (16) (eager)"] = Row(tree, True)
    return table


def baseline(name: str) -> str:
    """The plain row a method is compared with: the one of its own mode."""
    if name.endswith("(eager)"):
        return "plain (eager)"
    return f"plain (width {WIDE})" if name.endswith(f"(width {WIDE})") else "plain"


def load_prompts(path: Path | None, n: int) -> list[str]:
    if path is not None:
        from specdec.train.data import read_prompts
        return read_prompts(path)[:n]
    from specdec.bench.prompts import mtbench_questions
    return [q["turns"][0] for q in mtbench_questions()[:n]]


def run_method(model: str, config: dict | None, prompts: list[str], max_tokens: int, dtype: str,
               device: str, eager: bool = False, pass_width: int = 1) -> dict:
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    llm = LLM(model, speculative_config=config, dtype=dtype, device=device, progress=False, enforce_eager=eager,
              pass_width=pass_width)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    # warm-up, untimed: kernels, the allocator, and the CUDA graphs of the shapes this method's steps take
    # (a graph is captured on first use; timed, a 16-node tree's 17 graphs weighed on its row, session 32)
    llm.chat([{"role": "user", "content": prompts[0]}], params)
    outputs, tokens, seconds, passes, per_prompt = [], 0, 0.0, 0, []
    for p in prompts:
        out = llm.chat([{"role": "user", "content": p}], params)[0].outputs[0]
        m = out.metrics
        n = max(len(out.token_ids) - 1, 0)
        outputs.append(out.token_ids)
        tokens, seconds, passes = tokens + n, seconds + m["decode_time_s"], passes + m["target_forward_passes"] - 1
        per_prompt.append(m["decode_tokens_per_s"])
    graphs = llm.model.stats() if hasattr(llm.model, "stats") else None
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"decode_tokens": tokens, "decode_seconds": round(seconds, 4),
            "decode_tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "per_prompt_tokens_per_s": {"median": round(statistics.median(per_prompt), 2), "min": min(per_prompt),
                                        "max": max(per_prompt)},
            "tokens_per_target_pass": round(tokens / passes, 3) if passes else 1.0, "cuda_graphs": graphs,
            "outputs": outputs}


def profile_plain(model: str, prompt: str, max_tokens: int, dtype: str, device: str, path: Path) -> None:
    """cProfile and torch.profiler over one plain request (after a warm-up one), eager and (on CUDA) with
    graphs: the top rows of each, to find where a step goes besides the model's kernels."""
    import cProfile
    import io
    import pstats

    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    text = io.StringIO()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chat = [{"role": "user", "content": prompt}]
    for eager in (True, False) if device.startswith("cuda") else (True,):
        llm = LLM(model, dtype=dtype, device=device, progress=False, enforce_eager=eager)
        llm.chat(chat, params)
        prof = cProfile.Profile()
        prof.enable()
        out = llm.chat(chat, params)[0].outputs[0]
        prof.disable()
        text.write(f"## plain decoding, {'eager' if eager else 'CUDA graphs'}: {len(out.token_ids)} tokens, "
                   f"{out.metrics['decode_tokens_per_s']} tok/s\n\n")
        for order in ("cumulative", "tottime"):
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(25)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as tp:
            llm.chat(chat, params)
        text.write(tp.key_averages().table(sort_by="cpu_time_total", row_limit=25) + "\n")
        if device.startswith("cuda"):
            text.write(tp.key_averages().table(sort_by="cuda_time_total", row_limit=15) + "\n")
        del llm
    path.write_text(text.getvalue())


def render(report: dict) -> str:
    lines = [f"# Decode speed at batch 1 on {report['device_name']} ({report['date']})", "",
             f"Model `{report['model']}`, {report['dtype']}, greedy, {report['num_prompts']} prompts "
             f"({report.get('eager_prompts', report['num_prompts'])} for the eager rows), up to "
             f"{report['max_tokens']} new tokens; torch {report['torch']}. Each row is compared with plain "
             f"decoding of its own mode (eager, or CUDA graphs where the device has them).", "",
             "| method | decode tok/s | vs plain | per-prompt tok/s median (min-max) | tokens/target pass | "
             "outputs equal to plain |", "|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | | |")
            continue
        base = report["results"].get(baseline(name), {}).get("decode_tokens_per_s")
        pp = r["per_prompt_tokens_per_s"]
        ratio = f"{r['decode_tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {name} | {r['decode_tokens_per_s']:.1f} | {ratio} | {pp['median']:.1f} "
                     f"({pp['min']:.1f}-{pp['max']:.1f}) | {r['tokens_per_target_pass']:.2f} | {r['equal_to_plain']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="an EAGLE-3 head directory (default: none, eagle3 not run)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--eager-prompts", type=int, default=4, help="prompts for the eager rows (slow on a GPU)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="start no method after this long")
    ap.add_argument("--methods", default=None, help="comma-separated row names (default: all; plain rows first "
                    "where speculative rows are to be compared)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="first profile N tokens of plain decoding")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from specdec.model.loader import resolve_device

    device = resolve_device(args.device)
    prompts = load_prompts(args.prompts, args.num_prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "dtype": args.dtype, "device": device, "date": date.today().isoformat(),
              "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "num_prompts": len(prompts), "eager_prompts": min(args.eager_prompts, len(prompts)),
              "max_tokens": args.max_tokens, "results": {}}
    if args.profile:
        profile_plain(args.model, prompts[0], args.profile, args.dtype, device, args.out / "gpu_profile.txt")
    t0, plain = time.perf_counter(), {}
    table = methods(args.head)
    wanted = args.methods.split(",") if args.methods else list(table)
    unknown = [m for m in wanted if m not in table]
    if unknown:
        raise SystemExit(f"gpu_speed: unknown methods {unknown}; choose from {list(table)}")
    for name in wanted:
        config, eager, width = table[name]
        if time.perf_counter() - t0 > args.budget_s:
            report["results"][name] = {"error": "skipped: over the time budget"}
            continue
        subset = prompts[:args.eager_prompts] if eager else prompts
        try:
            r = run_method(args.model, config, subset, args.max_tokens, args.dtype, device, eager, width)
        except (RuntimeError, ConfigError, ValueError) as e:  # one method failing leaves the others' figures
            report["results"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        else:
            outputs = r.pop("outputs")
            if name == baseline(name):
                plain[name] = outputs
            ref = plain.get(baseline(name))
            r["equal_to_plain"] = (f"{sum(a == b for a, b in zip(outputs, ref))}/{len(outputs)}"
                                   if ref is not None else "-")
            report["results"][name] = r
        print(name, json.dumps(report["results"][name]), flush=True)
        (args.out / "gpu_speed.json").write_text(json.dumps(report, indent=2))
        (args.out / "gpu_speed.md").write_text(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
