"""`specdec quantize`: write an int8/int4 weight-only copy of a model (RTN or AWQ), or an FP8 (e4m3)
one for GPUs, as a directory that every other command loads like any model.

    specdec quantize smollm2-135m --scheme int8 --out ./smollm2-int8              (group size 128)
    specdec quantize smollm2-135m --scheme int4 --out ./smollm2-int4              (group size 32)
    specdec quantize smollm2-135m --scheme int4 --method awq --group-size 128 --out ./smollm2-int4-awq
    specdec quantize smollm2-135m --scheme fp8 --lm-head fp8 --out ./smollm2-fp8  (torch._scaled_mm)
    specdec generate ./smollm2-int4-awq --prompt "Hello"
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specdec.cli._common import at_least
from specdec.config import ConfigError


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write an int8/int4 (RTN or AWQ) or fp8 copy of a model")
    p.add_argument("model", help="alias (smollm2-135m), HF directory, .gguf file or hub id in the local cache")
    p.add_argument("--scheme", choices=("int8", "int4", "fp8"), default="int4",
                   help="int8/int4: group-wise, fast on CPUs (qgemv.c); fp8: e4m3 with per-channel scales, "
                        "for GPUs (torch._scaled_mm; exact but slow on a CPU)")
    p.add_argument("--method", choices=("rtn", "awq"), default="rtn",
                   help="rtn: round to nearest; awq: activation-aware scales searched on calibration text")
    p.add_argument("--group-size", type=at_least(1), default=None,
                   help="weights per scale along the input dim, a multiple of 32 (default: int8 128, int4 32)")
    p.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="zero-point-free groups (default: int8 symmetric, int4 asymmetric)")
    p.add_argument("--lm-head", choices=("int8", "int4", "fp8", "none"), default="int8",
                   help="scheme of the lm_head and a tied embedding (none: keep full precision)")
    p.add_argument("--lm-head-group-size", type=at_least(1), default=32)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--calib-tokens", type=int, default=512, help="AWQ calibration tokens")
    p.add_argument("--calib-file", default=None, help="AWQ calibration text file (default: ShareGPT chats)")
    p.add_argument("--awq-grid", type=at_least(1), default=20, help="AWQ: alpha grid points in [0, 1]")
    p.add_argument("--threads", type=at_least(1), default=None, help="CPU threads (default: all cores)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from specdec.model.loader import load_model, read_config, resolve_model
    from specdec.model.output_dir import check_new_dir
    from specdec.model.tokenizer import Tokenizer
    from specdec.quant.io import is_quantized, require_llama_layout, save_quantized
    from specdec.quant.qmodel import quantize_model, scheme_named, weight_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    group = args.group_size or (128 if args.scheme == "int8" else 32)
    scheme = scheme_named(args.scheme, group, args.symmetric)
    head = None if args.lm_head == "none" else scheme_named(args.lm_head, args.lm_head_group_size)
    if args.scheme == "fp8" and args.method == "awq":
        raise ConfigError("--method awq searches int8/int4 group scales; fp8 takes --method rtn")
    if args.calib_tokens < 16:
        raise ConfigError("--calib-tokens must be at least 16")
    source = resolve_model(args.model)
    if is_quantized(source.directory):
        raise ConfigError(f"{args.model} is already quantized; quantize the full-precision model")
    require_llama_layout(read_config(source.directory))
    out = Path(args.out)
    if out.resolve() == Path(source.directory).resolve():
        raise ConfigError("--out must differ from the model's own directory")
    check_new_dir(out)  # before the load and the AWQ search, not after
    if args.calib_file:
        try:
            Path(args.calib_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--calib-file {args.calib_file}: {e}") from None
    t0 = time.perf_counter()
    model = load_model(source.directory, torch.float32)
    before = weight_bytes(model)
    extra = {}
    if args.method == "awq":
        from specdec.quant.awq import apply_awq
        from specdec.quant.data import calibration_sequences

        seqs = calibration_sequences(Tokenizer(source.directory), args.calib_tokens,
                                     text_file=Path(args.calib_file) if args.calib_file else None)
        n = sum(len(s) for s in seqs)
        print(f"AWQ: searching scales on {n} calibration tokens ({len(seqs)} sequences)", file=sys.stderr)
        alphas = apply_awq(model, seqs, scheme, args.awq_grid,
                           progress=lambda msg: print(f"\r{msg}", end="", file=sys.stderr, flush=True))
        print(file=sys.stderr)
        extra = {"calibration": {"tokens": n, "source": args.calib_file or "sharegpt", "grid": args.awq_grid},
                 "awq_mean_alpha": round(sum(alphas.values()) / len(alphas), 3)}
    quantize_model(model, scheme, head)
    save_quantized(model, source.directory, out, scheme, head, args.method, extra)
    after = weight_bytes(model)
    print(f"wrote {out}: {scheme.name} ({args.method}), lm_head {head.name if head else 'fp32'}; "
          f"weights {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s")
    return 0
