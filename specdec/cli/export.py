"""`specdec export`: write a learned head in the layout vLLM or SGLang loads, and print the serve command.

    specdec export specdec/assets/smollm2-135m-eagle3 --format vllm --out /tmp/eagle3-vllm
    specdec export specdec/assets/smollm2-135m-eagle3 --format sglang --out /tmp/eagle3-sglang
"""
from __future__ import annotations

from pathlib import Path

from specdec.cli._common import at_least
from specdec.model.output_dir import write_atomic


def register(sub) -> None:
    p = sub.add_parser("export", help="export a draft head for vLLM / SGLang (+ the serve command line)")
    p.add_argument("head", type=Path, help="head directory (config.json + model.safetensors)")
    p.add_argument("--format", required=True, choices=("vllm", "sglang"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m", help="the target the head drafts for")
    p.add_argument("--num-speculative-tokens", type=at_least(1), default=5, help="vLLM chain length")
    p.add_argument("--num-steps", type=at_least(1), default=5, help="SGLang --speculative-num-steps")
    p.add_argument("--eagle-topk", type=at_least(1), default=4, help="SGLang --speculative-eagle-topk")
    p.add_argument("--num-draft-tokens", type=at_least(2), default=8, help="SGLang --speculative-num-draft-tokens")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.model.loader import resolve_model
    from specdec.train.export import export_head

    target = resolve_model(args.model, progress=False).directory
    cmd = export_head(args.head, args.format, args.out, target, args.num_speculative_tokens, args.num_steps,
                      args.eagle_topk, args.num_draft_tokens)
    write_atomic(args.out / "serve_command.sh", cmd + "\n")
    print(f"wrote {args.format} head to {args.out}")
    print(cmd)
    return 0
