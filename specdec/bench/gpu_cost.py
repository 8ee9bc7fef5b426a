"""GPU cost probe (`python -m specdec.bench.gpu_cost --out DIR [--tiny] [--budget-s 90]`), on a CUDA device:
1. verify cost: our LlamaModel with random bf16 weights at real shapes, a 512-token prefix cached, one forward
   over T = 1..64 new tokens (all T logits): ms and c(T)/c(1), eager and (T = 1, 8) as a CUDA graph;
2. GEMMs x [M, K] @ W[N, K]^T at the 8B's shapes, M = 1..16: bf16, FP8 e4m3 (torch._scaled_mm), int8 weight-only
   (torch._weight_int8pack_mm): time per call after an L2 flush, weight GB/s, error vs bf16.
The budget is checked between measurements (the rest is skipped and listed); DIR/gpu_cost.json and .md are
rewritten after every step. --tiny: a tiny model and small matrices on the CPU in float32 (tests the script).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import distributions
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.model.config import ModelConfig
from specdec.model.registry import architecture

Row = dict[str, Any]


def hf_config(arch: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **extra: Any) -> Row:
    return {"architectures": [arch], "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab, **extra}


# the keys of each model's config.json that set its cost (llama3 RoPE scaling left out: the same cost)
MODELS = {"SmolLM2-135M": hf_config("LlamaForCausalLM", 576, 1536, 30, 9, 3, 49152, rope_theta=100000.0,
                                    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True),
          "Llama-3.1-8B": hf_config("LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0,
                                    rms_norm_eps=1e-5, max_position_embeddings=131072),
          "Qwen2.5-7B": hf_config("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064, rope_theta=1000000.0,  # qkv bias
                                  rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False)}
TINY_MODEL = hf_config("LlamaForCausalLM", 64, 128, 2, 4, 2, 256, max_position_embeddings=512)
ORDER = ("SmolLM2-135M", "Llama-3.1-8B", "gemm", "Qwen2.5-7B")  # cheap and most wanted first
GEMM_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # W [N, K] of the 8B: o_proj, MLP up, MLP down
GEMM_ROWS, GRAPH_TS, FP8_MAX = (1, 4, 8, 16), (1, 8), 448.0  # 448: e4m3's largest finite value
PACKAGES = ("transformers", "triton", "nvidia-cublas", "nvidia-cublas-cu12", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13")
VERIFY_COLUMNS = ("mode", "T", "ms_median", "ms_min", "ms_max", "ratio", "note", "error")  # ratio: c(T) / c(1)
GEMM_COLUMNS = ("N", "K", "M", "kind", "us_median", "us_min", "gb_s", "rel_err", "note", "error")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:400]


def _log(msg: str) -> None:
    try:
        print(f"[gpu_cost] {msg}", flush=True)
    except OSError:  # stdout gone (a closed pipe): measuring and writing the report go on
        pass


def _cell(v: Any) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows: list[Row], columns: tuple[str, ...]) -> list[str]:
    return [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)] + [
        f"| {' | '.join(_cell(r.get(k)) for k in columns)} |" for r in rows] + [""]


class Report:
    """Everything measured, rewritten to DIR/gpu_cost.json and DIR/gpu_cost.md on every save()."""

    def __init__(self, out: Path, meta: Row, budget_s: float):
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.data: Row = {"meta": meta, "verify_cost": {}, "gemm": [], "skipped": [], "errors": []}
        out.mkdir(parents=True, exist_ok=True)
        self.save()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self, what: str) -> bool:  # and then lists `what` as skipped
        if self.elapsed() <= self.budget_s:
            return False
        self.data["skipped"].append(what)
        _log(f"over budget, skipped: {what}")
        return True

    def error(self, what: str, e: BaseException) -> str:
        self.data["errors"].append({"what": what, "error": _err(e)})
        _log(f"{what}: {_err(e)}")
        return _err(e)

    def save(self) -> None:
        self.data["meta"]["elapsed_s"] = round(self.elapsed(), 2)
        for name, text in (("gpu_cost.json", json.dumps(self.data, indent=1)), ("gpu_cost.md", self.markdown())):
            (self.out / (name + ".tmp")).write_text(text)
            os.replace(self.out / (name + ".tmp"), self.out / name)  # whole files only, even if killed

    def markdown(self) -> str:
        m, d = self.data["meta"], self.data
        keys = ("device_name", "capability", "torch", "cuda", "dtype", "date", "elapsed_s", "budget_s")
        lines = ["# GPU cost probe", "", ", ".join(f"{k}: {m.get(k)}" for k in keys), "",
                 "## 1. Verify cost: one forward over T new tokens after a cached prefix (logits for all T)", ""]
        for name, r in d["verify_cost"].items():
            keys = ("params_m", "prefix", "prefill_ms", "error")
            lines += [f"### {name}", "", ", ".join(f"{k}: {_cell(r[k])}" for k in keys if r.get(k) is not None), ""]
            lines += _table([{"mode": mode, **x} for mode in ("eager", "cuda_graph") for x in r[mode]], VERIFY_COLUMNS)
        lines += ["## 2. GEMMs y = x [M, K] @ W[N, K]^T", "", "CUDA: one call after an L2 flush; "
                  "rel_err: max |y - y_bf16| / max |y_bf16|", ""] + _table(d["gemm"], GEMM_COLUMNS)
        lines += ["## Skipped (over budget)", "", ", ".join(d["skipped"]) or "nothing", "", "## Errors", ""]
        return "\n".join(lines + ([f"- {e['what']}: {e['error']}" for e in d["errors"]] or ["none"]) + [""])


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
               before: Callable[[], object] | None = None) -> Row:
    """Median / min / max ms of `repeats` calls after `warmup`; before() runs untimed ahead of each. CUDA: stream
    drained, before() enqueued (then no launch gap is timed), events around the call (eager launches count)."""
    cuda, ms = device.type == "cuda", []
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    for _ in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize(device)
        if before is not None:
            before()
        if cuda:
            start.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            end.record()
            end.synchronize()
        ms.append(start.elapsed_time(end) if cuda else 1000 * (time.perf_counter() - t0))
    ms = ms[warmup:]
    return {"ms_median": round(statistics.median(ms), 5), "ms_min": round(min(ms), 5), "ms_max": round(max(ms), 5)}


def build_model(raw: Row, max_len: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """As the loader builds one, with random weights made on the device: normal(0, 0.02), RMSNorm gains 1."""
    cfg = ModelConfig.from_hf(raw)
    arch = architecture(cfg)
    with torch.device("meta"):
        model = arch.model_cls(cfg, max_len)
    gen, sd = torch.Generator(device=device).manual_seed(0), {}
    for name, t in model.state_dict().items():
        if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            w = torch.empty(t.shape, dtype=dtype, device=device)
            sd[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0.0, 0.02, generator=gen)
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    arch.init_rotary(model, max_len)
    return model.to(device).eval()


def graph_cost(model: torch.nn.Module, cache: Any, prefix: int, ids: torch.Tensor, pos: torch.Tensor) -> Row:
    """A forward over ids [1, T] as a CUDA graph, timed by replays (each rewrites slots prefix..prefix+T-1)."""
    cache.rollback(prefix)
    ref = model(ids, pos, cache).logits.float()  # a copy (bf16 logits)
    side = torch.cuda.Stream(ids.device)
    side.wait_stream(torch.cuda.current_stream(ids.device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            cache.rollback(prefix)
            model(ids, pos, cache)
    torch.cuda.current_stream(ids.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    cache.rollback(prefix)
    try:
        with torch.cuda.graph(graph):
            out = model(ids, pos, cache)
    finally:
        cache.rollback(prefix)
    row = time_calls(graph.replay, ids.device, 3, 10)  # (the replays leave their logits in `out`)
    return {**row, "note": f"max abs diff vs eager {float((out.logits.float() - ref).abs().max()):.3g}"}


@torch.inference_mode()
def verify_cost(name: str, raw: Row, prefix: int, ts: tuple[int, ...], device: torch.device, dtype: torch.dtype,
                report: Report) -> None:
    """Section 1 for one model, into report.data["verify_cost"][name] (saved after every measurement)."""
    res: Row = {"config": raw, "prefix": prefix, "eager": [], "cuda_graph": []}
    report.data["verify_cost"][name], cuda = res, device.type == "cuda"
    _log(f"{name}: building ({report.elapsed():.0f} s)")
    model = build_model(raw, prefix + max(ts), device, dtype)
    res["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    cache, vocab = model.new_cache(prefix + max(ts)), model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prefix), device=device), torch.arange(prefix, device=device)[None]
    blocks = {T: (torch.randint(0, vocab, (1, T), device=device), torch.arange(prefix, prefix + T, device=device)[None])
              for T in ts}  # token ids and positions of each block after the prefix
    res["prefill_ms"] = time_calls(lambda: model(*prompt, cache, num_logits=1, prefill=True), device, 1, 3,
                                   cache.reset)["ms_median"]  # the last prefill leaves the prefix in the cache
    for mode, T in [("eager", t) for t in ts] + [("cuda_graph", t) for t in GRAPH_TS if cuda and t in ts]:
        if report.over_budget(f"{name} {mode} T={T}"):
            continue
        try:
            row = {"T": T, **(graph_cost(model, cache, prefix, *blocks[T]) if mode == "cuda_graph" else time_calls(
                lambda: model(*blocks[T], cache), device, 3, 10, lambda: cache.rollback(prefix)))}
            base = (res[mode] or [row])[0].get("ms_median")  # c(1): T = 1 comes first
            row["ratio"] = round(row["ms_median"] / base, 4) if base else None
            _log(f"{name} {mode} T={T}: {row['ms_median']:.3f} ms")
        except Exception as e:  # a failed capture (or OOM) is a finding to record, not the end of the run
            row = {"T": T, "error": report.error(f"{name} {mode} T={T}", e)}
        res[mode].append(row)
        report.save()


def gemm_call(fn: Callable[[], torch.Tensor], ref: torch.Tensor, weight_bytes: int, flush: torch.Tensor | None) -> Row:
    """One GEMM kind: time per call (median of 50), weight GB/s and max |y - ref| / max |ref|; or its error."""
    try:
        err = float((fn()[: ref.shape[0]].float() - ref).abs().max() / ref.abs().max())
        st = time_calls(fn, ref.device, 10, 50, None if flush is None else flush.zero_)
        return {"us_median": 1000 * st["ms_median"], "us_min": 1000 * st["ms_min"], "us_max": 1000 * st["ms_max"],
                "gb_s": weight_bytes / st["ms_median"] / 1e6, "rel_err": err}
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as e:  # an API torch lacks
        return {"error": _err(e)}


def gemm_section(tiny: bool, device: torch.device, report: Report) -> None:
    """Section 2: per weight shape and row count M, one row per kind (with "error" where it does not run)."""
    from specdec.quant.fp8 import Fp8Weight  # ours: e4m3 [N, K], per-channel scales; x quantized per token
    cuda, mb, bf16 = device.type == "cuda", int(max(256, 4 * (report.data["meta"]["l2_mb"] or 64))), torch.bfloat16
    flush = torch.empty(mb * 2**20, dtype=torch.int8, device=device) if cuda else None  # > L2: weights from HBM
    for N, K in [(256, 256), (512, 256), (256, 512)] if tiny else GEMM_SHAPES:
        w = torch.randn(N, K, device=device, dtype=bf16) * 0.02
        fw = Fp8Weight.from_float(w, bf16)
        wq_t, sw = fw.qweight.t(), fw.scales[None, :]  # W^T [K, N] column-major and [1, N], as _scaled_mm wants
        s8 = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)  # int8 per output channel
        w8, s8 = torch.round(w.float() / s8[:, None]).clamp(-127, 127).to(torch.int8), s8.to(w.dtype)
        for M in GEMM_ROWS:
            if report.over_budget(f"gemm {N}x{K} M={M}"):
                continue
            x = torch.randn(M, K, device=device, dtype=bf16)
            ref, xp, pad = (x @ w.t()).float(), x, ""
            try:
                if cuda:
                    fw.linear(x)
            except (RuntimeError, TypeError, ValueError) as e:  # some versions want M a multiple of 16 as well
                xp, pad = torch.cat([x, x.new_zeros((-M) % 16, K)]), f"M padded to 16 (unpadded: {_err(e)}); "
            sx = (xp.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [M, 1] per token
            xq = (xp.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            kinds = {"bf16": (lambda: x @ w.t(), 2 * N * K, ""),
                     "fp8 _scaled_mm": (lambda: torch._scaled_mm(xq, wq_t, scale_a=sx, scale_b=sw, out_dtype=bf16),
                                        N * K + 4 * N, pad + "rowwise scales, x pre-quantized"),
                     "fp8 Fp8Weight.linear": (lambda: fw.linear(xp), N * K + 4 * N, pad + "ours: x quantized per call"),
                     "int8 weight-only": (lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8), N * K + 2 * N, "")}
            rows = [{"N": N, "K": K, "M": M, "kind": kind, "note": note, **(
                gemm_call(fn, ref, nbytes, flush) if cuda or kind == "bf16" else {"error": "needs CUDA"})}
                for kind, (fn, nbytes, note) in kinds.items()]
            report.data["gemm"] += rows
            done = ", ".join(f"{r['kind']} {_cell(r.get('us_median', 'n/a'))}" for r in rows)
            _log(f"gemm {N}x{K} M={M}, us: {done}")
            report.save()


def main(argv: list[str] | None = None) -> Row:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and small matrices on the CPU (a test)")
    ap.add_argument("--budget-s", type=float, default=90.0)
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("gpu_cost: no CUDA device (--tiny runs the CPU test mode)")
    device, dtype = torch.device("cpu" if args.tiny else "cuda"), torch.float32 if args.tiny else torch.bfloat16
    props = None if args.tiny else torch.cuda.get_device_properties(device)
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device), "tiny": args.tiny,
            "device_name": props.name if props else platform.machine(), "dtype": str(dtype).removeprefix("torch."),
            "capability": list(torch.cuda.get_device_capability(device)) if props else None,
            "l2_mb": getattr(props, "L2_cache_size", 0) / 2**20 if props else None, "budget_s": args.budget_s,
            "python": platform.python_version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **{n: d.version for d in distributions() if (n := (d.metadata["Name"] or "").lower()) in PACKAGES}}
    report = Report(args.out, meta, args.budget_s)
    prefix, ts = (32, (1, 2, 4)) if args.tiny else (512, (1, 2, 4, 8, 16, 32, 64))
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if args.tiny else threads)  # a shared CPU: 2 threads wait on each other (T=1: 68 ms)
    for what in ("tiny", "gemm") if args.tiny else ORDER:
        if not report.over_budget(what):
            try:
                if what == "gemm":
                    gemm_section(args.tiny, device, report)
                else:
                    verify_cost(what, TINY_MODEL if args.tiny else MODELS[what], prefix, ts, device, dtype, report)
            except Exception as e:  # a model or section failing (OOM, an op torch lacks) must not end the run
                report.error(what, e)
                report.data["verify_cost"].get(what, {})["error"] = _err(e)
        gc.collect()  # frees the model before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.save()
    torch.set_num_threads(threads)
    _log(f"done in {report.elapsed():.1f} s: {args.out}/gpu_cost.json and gpu_cost.md")
    return report.data


if __name__ == "__main__":
    main()
