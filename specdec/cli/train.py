"""`specdec train`: data for learned drafters and the training of Medusa / EAGLE / EAGLE-3 heads and
of distilled draft models. Every stage is seeded and resumable: rerun the same command (a rerun with other
settings is refused).

    specdec train data smollm2-135m --out runs/data --num-prompts 960 --max-new-tokens 128
    specdec train data smollm2-135m --out runs/data_tf --teacher-forced 1024
    specdec train eagle3 smollm2-135m --data runs/data --data runs/data_tf --out runs/eagle3
    specdec train medusa smollm2-135m --data runs/data --out runs/medusa
    specdec train draft-model smollm2-135m --draft drafts/smollm2-8l --data runs/data --out runs/draft
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from specdec.cli._common import at_least
from specdec.model.output_dir import write_atomic

KINDS = ("medusa", "eagle", "eagle3")


def register(sub) -> None:
    p = sub.add_parser("train", help="train learned drafters (data, medusa, eagle, eagle3, draft-model)")
    tsub = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    d = tsub.add_parser("data", help="regenerate ShareGPT answers with the target and store its features")
    _common(d)
    d.add_argument("--num-prompts", type=int, default=960)
    d.add_argument("--num-heldout", type=int, default=32)
    d.add_argument("--max-prompt-tokens", type=int, default=192)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--later-turn-tokens", type=int, default=0, metavar="N",
                   help="also ShareGPT's later human turns as train prompts, with the conversation so far, "
                        "where that fits N tokens (held-out stays first turns)")
    d.add_argument("--heldout-from", type=Path, default=None, metavar="HEAD_DIR",
                   help="the held-out split is the prompts this head was held out from (its config's "
                        "record; in place of --num-heldout), so a fine-tune from it is measured on prompts it "
                        "never trained on")
    d.add_argument("--batch-size", type=int, default=48)
    d.add_argument("--max-batches", type=int, default=None, help="stop after N train batches (rerun to extend)")
    d.add_argument("--teacher-forced", type=at_least(0), default=0, metavar="N",
                   help="instead: N ShareGPT answers as they are (one target pass each, no generation)")
    d.add_argument("--online", action="store_true",
                   help="store tokens only (disk short): the trainer computes the target's features per batch")
    d.add_argument("--scan", type=int, default=20000, help="ShareGPT conversations read to pick prompts from")
    d.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="candidate prompts from --write-prompts (a JSON list, .gz allowed) instead of ShareGPT")
    d.add_argument("--write-prompts", type=Path, default=None, metavar="FILE",
                   help="only save the candidate prompts (for a machine without the ShareGPT package)")
    d.add_argument("--max-seconds", type=float, default=None, help="start no train batch after this long")
    d.add_argument("--generator", choices=("specdec", "transformers"), default="specdec",
                   help="who regenerates the answers: our runtime (CUDA graphs on a GPU) or transformers")
    _device(d)
    d.set_defaults(func=run_data)
    for kind in KINDS:
        h = tsub.add_parser(kind, help=f"train a {kind} head on stored features")
        _common(h)
        _train_args(h)
        _device(h)
        h.set_defaults(func=run_head, kind=kind)
    dm = tsub.add_parser("draft-model", help="distill a small draft model (e.g. a truncated copy) on target data")
    _common(dm)
    dm.add_argument("--data", action="append", required=True)
    dm.add_argument("--draft", type=Path, default=None, help="draft model dir (default: make one from --layers)")
    dm.add_argument("--layers", default=None,
                    help="target layers of the truncated copy when --draft is absent, e.g. 0,1,2,3,29 (default: "
                         "make-draft's first-last choice of 5)")
    dm.add_argument("--epochs", type=float, default=1.0)
    dm.add_argument("--lr", type=float, default=1e-4)
    dm.set_defaults(func=run_distill)


def _common(p) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m", help="the target model")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(0), default=1, help="CPU threads (default 1: the machine is shared; 0: all cores)")
    p.add_argument("--no-progress", action="store_true")


def _device(p) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (data and heads; draft-model: cpu)")


def _train_args(p) -> None:
    p.add_argument("--data", action="append", required=True, help="dataset dir from `train data` (repeatable)")
    p.add_argument("--epochs", type=float, default=2.0,
                   help="0 with --init-from: no training, the head it starts from (vocabulary grown) exported")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="warmup steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=2, help="training-time-test unroll depth (eagle, eagle3)")
    p.add_argument("--max-len", type=int, default=512, help="tokens of each sequence trained on")
    p.add_argument("--draft-vocab-size", type=int, default=4096, help="0: the full vocabulary")
    p.add_argument("--intermediate-size", type=int, default=0, help="head MLP width (0: the target's)")
    p.add_argument("--medusa-heads", type=int, default=4)
    p.add_argument("--max-train-seqs", type=int, default=None)
    p.add_argument("--eval-depth", type=at_least(1), default=5, help="drafted tokens a held-out chain is scored over")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--max-seconds", type=float, default=None,
                   help="fit the schedule to this time budget (measured over the first steps)")
    p.add_argument("--init-from", type=Path, default=None, metavar="HEAD_DIR",
                   help="fine-tune this trained head (its weights and draft vocabulary) instead of a fresh one; "
                        "an EAGLE-3 head with fewer draft tokens than --draft-vocab-size grows its vocabulary")


def _hardware(device) -> dict:
    import torch

    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, **gpu}


def run_data(args) -> int:
    import torch
    from specdec.config import ConfigError

    if args.teacher_forced:  # ShareGPT's own answers, its first conversations: these choose prompts, not them
        given = [flag for flag, value in (("--heldout-from", args.heldout_from), ("--prompts", args.prompts),
                                          ("--later-turn-tokens", args.later_turn_tokens)) if value]
        if given:
            raise ConfigError(f"{', '.join(given)} do not apply to --teacher-forced data (ShareGPT's own answers)")

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    from specdec.model.loader import resolve_device
    from specdec.train.data import DataSpec, build_dataset
    from specdec.train.teacher_forced import build_teacher_forced

    spec = DataSpec(args.num_prompts, args.num_heldout, args.max_prompt_tokens, args.max_new_tokens,
                    args.batch_size, args.seed, scan=args.scan, max_batches=args.max_batches, online=args.online,
                    prompts_file=str(args.prompts) if args.prompts else None, max_seconds=args.max_seconds,
                    generator=args.generator, later_turn_tokens=args.later_turn_tokens,
                    heldout_prompts=_heldout_of(args.heldout_from) if args.heldout_from else None)
    if args.write_prompts:
        from specdec.model.loader import resolve_model
        from specdec.model.tokenizer import Tokenizer
        from specdec.train.data import candidate_prompts, write_prompts

        prompts = candidate_prompts(Tokenizer(resolve_model(args.model).directory), spec)
        write_prompts(args.write_prompts, prompts)
        print(f"{len(prompts)} candidate prompts -> {args.write_prompts}")
        return 0
    if args.teacher_forced:
        stats = build_teacher_forced(args.model, args.out, args.teacher_forced, progress=not args.no_progress,
                                     online=args.online)
    else:
        stats = build_dataset(args.model, args.out, spec, progress=not args.no_progress,
                              device=resolve_device(args.device))
    print(json.dumps(stats, indent=2, default=str))
    return 0


def _heldout_of(head_dir: Path) -> tuple[str, ...]:
    """The held-out prompt digests a trained head's config.json records."""
    from specdec.config import ConfigError, read_json_object

    block = read_json_object(head_dir / "config.json").get("specdec")
    record = block.get("training") if isinstance(block, dict) else None
    digests = record.get("heldout_prompts") if isinstance(record, dict) else None
    if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
        raise ConfigError(f"{head_dir}: its config.json records no held-out prompts "
                          "(specdec.training.heldout_prompts)")
    return tuple(digests)


def run_head(args) -> int:
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    from specdec.llm import load_target
    from specdec.train.evaluate import chain_acceptance, medusa_rank_accuracy
    from specdec.train.trainer import TrainSpec, Trainer

    _, target, _ = load_target(args.model, "float32", None, progress=not args.no_progress, device=args.device)
    if target.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the head's matmuls; the features are stored already
    spec = TrainSpec(kind=args.kind, data=tuple(args.data), out=str(args.out), epochs=args.epochs, lr=args.lr, warmup=args.warmup,
                     batch_size=args.batch_size, max_len=args.max_len, ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                     intermediate_size=args.intermediate_size, medusa_heads=args.medusa_heads, seed=args.seed,
                     eval_every=args.eval_every, ckpt_every=args.ckpt_every, max_train_seqs=args.max_train_seqs, save_dtype=args.save_dtype,
                     init_from=str(args.init_from) if args.init_from else None, max_seconds=args.max_seconds)
    trainer = Trainer(spec, target, progress=not args.no_progress)
    held = trainer.heldout
    depth = min(args.eval_depth, args.medusa_heads) if args.kind == "medusa" else args.eval_depth

    def evaluate(t):
        return chain_acceptance(t.head, target, held, depth, t.aux_layers) if held else {}

    t0 = time.perf_counter()
    stats = trainer.run(evaluate)
    final = evaluate(trainer)
    if args.kind == "medusa" and held:
        from dataclasses import replace
        acc = medusa_rank_accuracy(trainer.head, target, held)
        trainer.head.cfg = replace(trainer.head.cfg, medusa_accuracy=tuple(tuple(round(a, 4) for a in r) for r in acc))
    report = {"kind": args.kind, "train_sequences": len(trainer.train),
              "train_tokens_per_epoch": sum(len(s.tokens) for s in trainer.train),
              "steps": trainer.total_steps, "wall_seconds_this_run": round(time.perf_counter() - t0, 1),
              **stats, "heldout": final, "hardware": _hardware(target.device)}
    path = trainer.export(report)
    write_atomic(args.out / "train_report.json", json.dumps(report, indent=2, default=str))
    print(json.dumps({"head": str(path), **report}, indent=2, default=str))
    return 0


def _draft_layers(text: str | None, num_layers: int) -> list[int]:
    from specdec.config import ConfigError
    from specdec.train.make_draft import draft_layers

    if text is None:
        return draft_layers(num_layers, min(5, num_layers))
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--layers: comma-separated layer indices, got {text!r}") from None
    if sorted(set(layers)) != layers or not 0 <= layers[0] <= layers[-1] < num_layers:
        raise ConfigError(f"--layers: ascending distinct indices in [0, {num_layers}) for this model, got {text!r}")
    return layers


def run_distill(args) -> int:
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    from specdec.llm import load_target
    from specdec.model.loader import load_model, save_model_dir
    from specdec.train.distill import distill

    source, target, _ = load_target(args.model, "float32", None, progress=not args.no_progress, device="cpu")
    draft_dir = args.draft
    if draft_dir is None:
        draft_dir = args.out / "init"
        save_model_dir(target, source.directory, draft_dir, _draft_layers(args.layers, target.config.num_hidden_layers))
    draft = load_model(draft_dir, torch.float32)
    report = distill(target, draft, args.data, args.out, args.epochs, args.lr, seed=args.seed,
                     progress=not args.no_progress)
    save_model_dir(draft, draft_dir, args.out / "model")
    report["model"] = str(args.out / "model")
    print(json.dumps(report, indent=2))
    return 0
