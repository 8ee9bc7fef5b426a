"""`specdec generate`: a prompt (or a file of prompts, one per line) in, text out, with speed figures."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.cli._common import StreamPrinter, add_model_args, add_spec_args, make_llm
from specdec.config import ConfigError
from specdec.sampling_params import SamplingParams


def add_sampling_args(p) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide (multiply, if negative) the logits of prompt and output tokens by this, in [0.01, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this x each token's count in the output, in [-2, 2]")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from every token already in the output, in [-2, 2]")


def sampling_from_args(args) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                              repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty, min_tokens=args.min_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(p)
    add_spec_args(p)
    add_sampling_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        prompts = [l for l in args.prompt_file.read_text().splitlines() if l.strip()]
    if not prompts or any(not p.strip() for p in prompts):
        raise ConfigError("the prompt is empty")
    return prompts


def run(args) -> int:
    prompts = _prompts(args)
    params = sampling_from_args(args)
    llm = make_llm(args)
    for prompt in prompts:
        tok = llm.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if args.chat else tok.encode(prompt)
        stream = None if args.json else StreamPrinter(params.stop)
        r = llm.generate_one(ids, params, on_delta=stream)
        if stream is not None:
            stream.finish(r.text)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                              "finish_reason": r.finish_reason, "metrics": r.metrics_dict()}))
        else:
            m = r.metrics_dict()
            spec = m["speculative"]
            extra = (f", tau {spec['mean_acceptance_length']:.2f}, acceptance {spec['acceptance_rate']:.2f}"
                     if spec["num_drafts"] else "")
            print(f"\n[{len(r.token_ids)} tokens, prefill {m['prefill_time_s']*1000:.0f} ms, decode "
                  f"{m['decode_tokens_per_s']:.1f} tok/s, {m['target_forward_passes']} target passes{extra}, "
                  f"finish: {r.finish_reason}]", file=sys.stderr)
    return 0
