"""Arguments shared by subcommands: the model, its dtype, and vLLM-style speculative flags."""
from __future__ import annotations

import argparse
import json

from specdec.config import KV_CACHE_DTYPES, SPEC_METHODS, ConfigError


class StreamPrinter:
    """Prints a request's text as the decoder streams it, holding back the tail that a stop string could
    still begin: the decoder's deltas are not held back, and its final text is cut where a stop string
    starts. Call as on_delta, then finish(final text)."""

    def __init__(self, stop: tuple[str, ...]):
        self.hold = max(map(len, stop), default=1) - 1
        self.text, self.printed = "", 0

    def __call__(self, delta: str, toks) -> None:
        self.text += delta
        if len(self.text) - self.hold > self.printed:
            print(self.text[self.printed:len(self.text) - self.hold], end="", flush=True)
            self.printed = len(self.text) - self.hold

    def finish(self, text: str) -> None:
        print(text[self.printed:], end="", flush=True)


def at_least(least: int):
    """An argparse type: an integer >= least (a size, a count), else argparse's one-line usage error."""
    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse's "invalid int value"
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def add_model_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("model", nargs="?", default="smollm2-135m",
                       help="alias (smollm2-135m), HF directory, .gguf file or hub id in the local cache")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (auto: bf16 where the CPU has AMX/AVX512-BF16)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's, capped at 8192)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda (auto: CUDA when available)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every pass eagerly (default: generate/chat replay CUDA graphs for decode and verify; the serving engine is eager)")
    p.add_argument("--pass-width", type=int, default=1,
                   help="CUDA graphs: compute every decode/verify pass at least this many rows wide, so plain and "
                        "speculative passes run the same GPU kernels (the CPU kernels agree at any width)")
    p.add_argument("--amx", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 on an Intel CPU with AMX: prompt, decode and verify passes on AMX tiles (cheap "
                        "multi-token passes, a single token 5-10%% slower; default: on for serve, off elsewhere; "
                        "serve without them runs prompts on vdpbf16ps, slower, since oneDNN's are not row-invariant there)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what the KV cache stores (auto: the model's dtype; a CPU bf16 model computes in fp32). "
                        "bfloat16 halves the cache's memory and what a pass reads from it, and rounds each key and "
                        "value once: a precision choice like --dtype (plain and speculative decoding stay equal)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="never reuse an earlier request's keys/values for a shared prompt prefix (generate/chat: "
                        "the previous request's, where exact; serve: the engine's block cache)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (vLLM names)")
    g.add_argument("--speculative-method", choices=SPEC_METHODS, default=None)
    g.add_argument("--speculative-model", default=None, help="draft model for draft_model")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="fix k (default: adaptive)")
    g.add_argument("--prompt-lookup-min", type=int, default=None)
    g.add_argument("--prompt-lookup-max", type=int, default=None)
    g.add_argument("--speculative-lookup", choices=("ngram", "suffix"), default=None,
                   help="try this lookup first at every step, the method's model drafter when it finds no match")
    g.add_argument("--speculative-config", default=None, help="JSON with vLLM's keys, e.g. '{\"method\": \"ngram\"}'")


def json_object(text: str, flag: str) -> dict:
    """A flag's JSON object (--speculative-config's), or a ConfigError naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    return value


def spec_config_from_args(args) -> dict | None:
    cfg = json_object(args.speculative_config, "--speculative-config") if args.speculative_config else {}
    flags = {"method": args.speculative_method, "model": args.speculative_model,
             "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
             "lookup": args.speculative_lookup}
    cfg.update({k: v for k, v in flags.items() if v is not None})
    if cfg and "method" not in cfg:
        raise ConfigError("speculative flags given without --speculative-method")
    return cfg or None


def make_llm(args, speculative: bool = True):
    from specdec.llm import LLM
    return LLM(args.model, speculative_config=spec_config_from_args(args) if speculative else None,
               dtype=args.dtype, max_model_len=args.max_model_len, num_threads=args.threads, device=args.device,
               enforce_eager=getattr(args, "enforce_eager", False), pass_width=getattr(args, "pass_width", 1),
               enable_prefix_caching=not getattr(args, "no_prefix_caching", False), amx=bool(getattr(args, "amx", False)),
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
