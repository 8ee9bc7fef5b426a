"""Quality and speed of quantized models next to fp32, and the qdraft speed-up; writes the report.

    python -m specdec.quant.evaluate --out docs/benchmarks/quantization.md
    python -m specdec.quant.evaluate --schemes int8-g128,int4-g32 --rounds 3 --skip-qdraft

Quality (1 thread, no timing): perplexity of held-out ShareGPT chats (conversations never used for
AWQ calibration), teacher-forced top-1 agreement with fp32 on that text, and the common prefix of
64-token greedy continuations of chat prompts. Speed (all threads): plain greedy decode tok/s of
every model, interleaved round by round in one process, and the median of per-round ratios to
fp32; qdraft: fp32 plain vs fp32 + qdraft on chat prompts, interleaved the same way.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.cache.kept_prefix import common_prefix
from specdec.config import ConfigError
from specdec.kernels import MAX_ROWS
from specdec.model.loader import load_model, resolve_model
from specdec.model.tokenizer import Tokenizer
from specdec.quant.bf16 import Bf16Scheme, to_cpu_bf16
from specdec.quant.fp8 import Fp8Scheme
from specdec.quant.qmodel import describe, quantize_model, scheme_named, weight_bytes
from specdec.quant.schemes import QuantScheme
from specdec.sampling_params import SamplingParams
from specdec.spec.decoder import SpeculativeDecoder

CHAT = ["What is the capital of France? Answer in one sentence.",
        "Write a Python function that returns the n-th Fibonacci number.",
        "Explain in three sentences why the sky is blue.",
        "Give me three tips for writing a good cover letter."]


@dataclass
class Variant:
    name: str  # e.g. "int4-g128 awq"
    scheme: QuantScheme | Fp8Scheme | Bf16Scheme | None  # None: fp32
    method: str = "rtn"


def parse_variants(spec: str) -> list[Variant]:
    """'int8-g128,int4-g128-awq,fp8' -> variants (fp32 always first)."""
    out = [Variant("fp32", None)]
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split("-")
        grouped = len(parts) > 1 and parts[1][:1] == "g"
        scheme = scheme_named(parts[0], int(parts[1][1:]) if grouped else 128)
        rest = parts[2:] if grouped else parts[1:]  # ("int4-awq" ran RTN under an RTN label)
        if any(x != "awq" for x in rest):
            raise ConfigError(f"{item!r}: a variant is SCHEME[-gGROUP][-awq], e.g. int4-g128-awq")
        method = "awq" if rest else "rtn"
        if method == "awq" and not isinstance(scheme, QuantScheme):  # (fp8 reached AWQ's int-group search)
            raise ConfigError(f"{item!r}: AWQ searches scales for int8/int4 groups, not {scheme.name}")
        out.append(Variant(f"{scheme.name} {method}", scheme, method))
    return out


@torch.inference_mode()
def nll_and_argmax(model, seq: list[int], block: int = MAX_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position NLL of seq[1:] [T-1] and the argmax predictions [T-1], teacher-forced in blocks of
    `block` tokens: the decode/verify kernels' path (quantized activations included), as decoding runs,
    not the long-prompt path (dequantize + BLAS)."""
    cache = model.new_cache(len(seq))
    logits = torch.cat([model(torch.tensor([seq[i:i + block]]), torch.arange(i, min(i + block, len(seq)))[None],
                              cache).logits[0] for i in range(0, len(seq), block)])[:-1]
    return F.cross_entropy(logits.float(), torch.tensor(seq[1:]), reduction="none"), logits.argmax(-1)


def quality(model, ref_preds: list[torch.Tensor] | None, seqs: list[list[int]]) -> tuple[float, float, list]:
    """(perplexity, top-1 agreement with ref_preds, this model's predictions)."""
    nll, agree, n, preds = 0.0, 0, 0, []
    for i, seq in enumerate(seqs):
        loss, pred = nll_and_argmax(model, seq)
        nll, n = nll + float(loss.sum()), n + loss.numel()
        preds.append(pred)
        if ref_preds is not None:
            agree += int((pred == ref_preds[i]).sum())
    return float(torch.tensor(nll / n).exp()), agree / n if ref_preds is not None else 1.0, preds


def greedy(decoder: SpeculativeDecoder, ids: list[int], n: int):
    return decoder.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def build(variant: Variant, directory: Path, calib: list[list[int]] | None, max_len: int):
    model = load_model(directory, torch.float32, max_len)
    if variant.scheme is None:
        return model
    if variant.method == "awq":
        from specdec.quant.awq import apply_awq
        apply_awq(model, calib, variant.scheme)
    if isinstance(variant.scheme, Bf16Scheme):  # as --dtype bfloat16 loads it on this CPU
        return to_cpu_bf16(model)
    return quantize_model(model, variant.scheme)


def interleaved_speed(decoders: dict[str, SpeculativeDecoder], prompts: list[list[int]], n: int, rounds: int):
    """name -> (median tok/s, median ratio to the first decoder, mean acceptance)."""
    per = {k: [] for k in decoders}
    acc = {k: [] for k in decoders}
    first = next(iter(decoders))
    for _ in range(rounds):
        rates = {}
        for name, dec in decoders.items():
            toks = secs = 0.0
            for ids in prompts:
                r = greedy(dec, ids, n)
                toks, secs = toks + len(r.token_ids) - 1, secs + r.decode_time
                if r.metrics.num_draft_tokens:
                    acc[name].append(r.metrics.acceptance_rate)
            rates[name] = toks / secs
        for name in decoders:
            per[name].append((rates[name], rates[name] / rates[first]))
    return {k: (statistics.median(r for r, _ in v), statistics.median(q for _, q in v),
                statistics.mean(acc[k]) if acc[k] else None) for k, v in per.items()}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _torch_int8_dynamic(w: torch.Tensor):
    import torch.ao.nn.quantized.dynamic as nnqd
    m = nnqd.Linear(w.shape[1], w.shape[0], bias_=False)
    scale = w.abs().amax(1) / 127
    m.set_weight_bias(torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0,
                                                 torch.qint8), None)
    return m


def _torch_int4pack(w: torch.Tensor, G: int = 32):
    N, K = w.shape
    wg = w.view(N, K // G, G)
    lo, s = wg.amin(-1), (wg.amax(-1) - wg.amin(-1)) / 15
    q = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([s.T, (lo + 8 * s).T], -1).contiguous()  # w = (q - 8) * s + zero
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz)


@torch.inference_mode()
def kernel_paths(model, repeats: int = 7) -> list[tuple[str, float, float]]:
    """Every decoder linear of `model` at T=1 through each candidate path, interleaved:
    [(path, median ms for all layers, relative error of layer 0's qkv output vs fp32)]."""
    from specdec.kernels import linear
    from specdec.quant.qlinear import QuantizedWeight
    from specdec.quant.schemes import quantize

    ws = [getattr(L, n).weight.detach() for L in model.layers for n in ("qkv", "o_proj", "gate_up", "down")]
    paths = {"fp32, gemv.c (ours)": [lambda x, w=w: linear(x, w) for w in ws],
             "fp32, F.linear (MKL)": [lambda x, w=w: F.linear(x, w) for w in ws]}
    for bits, G in ((8, 64), (4, 32)):
        qs = [QuantizedWeight(quantize(w, QuantScheme.named(f"int{bits}", G))) for w in ws]
        paths[f"int{bits}-g{G}, qgemv.c (ours)"] = [lambda x, q=q: linear(x, q) for q in qs]
    i8 = [(torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8), w.abs().amax(1) / 127) for w in ws]
    paths["int8 per-channel, torch _weight_int8pack_mm"] = [
        lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in i8]
    paths["int4-g32, torch _weight_int4pack_mm_for_cpu"] = [_torch_int4pack(w) for w in ws]
    paths["int8 dynamic (int8 activations), torch fbgemm"] = [_torch_int8_dynamic(w) for w in ws]
    xs = {k: torch.randn(1, k) for k in {w.shape[1] for w in ws}}
    times = {k: [] for k in paths}
    for _ in range(repeats):
        for name, fns in paths.items():
            t0 = time.perf_counter()
            for w, f in zip(ws, fns):
                f(xs[w.shape[1]])
            times[name].append(time.perf_counter() - t0)
    x, ref = xs[ws[0].shape[1]], F.linear(xs[ws[0].shape[1]], ws[0])
    return [(name, 1000 * statistics.median(times[name]),
             float((fns[0](x) - ref).norm() / ref.norm())) for name, fns in paths.items()]


def qdraft_decoders(fp, tok, ks: list[int | None]) -> dict[str, SpeculativeDecoder]:
    from specdec.config import SpeculativeConfig
    from specdec.proposers.qdraft import QDraftProposer
    from specdec.spec.proposer import ProposerContext

    out = {"fp32 plain": SpeculativeDecoder(fp, tok)}
    proposer = None
    for k in ks:
        cfg = SpeculativeConfig("qdraft", num_speculative_tokens=k)
        proposer = proposer or QDraftProposer(ProposerContext(fp, tok, cfg, None, torch.float32, fp.max_len))
        out[f"fp32 + qdraft (k={k or 'adaptive'})"] = SpeculativeDecoder(fp, tok, proposer, cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemes", default="int8-g128,int4-g32,int4-g128,int4-g128-awq")
    ap.add_argument("--eval-seqs", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per prompt in the speed runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads of the speed runs (quality runs use 1)")
    ap.add_argument("--qdraft-k", default="adaptive,4,8")
    ap.add_argument("--skip-qdraft", action="store_true")
    ap.add_argument("--skip-paths", action="store_true", help="skip the per-path kernel comparison")
    ap.add_argument("--speed-only", action="store_true", help="skip perplexity and agreement")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the C kernels' own OpenMP runtime
    torch.set_num_threads(1)
    directory = resolve_model(args.model).directory
    tok = Tokenizer(directory)
    from specdec.quant.data import calibration_sequences, heldout_sequences
    evals = [] if args.speed_only else heldout_sequences(tok, args.eval_seqs, args.seq_len)
    variants = parse_variants(args.schemes)
    calib = calibration_sequences(tok, args.calib_tokens) if any(v.method == "awq" for v in variants) else None
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT[:2]]
    rows, models, ref_preds, ref_cont = [], {}, None, None
    for v in variants:
        t0 = time.perf_counter()
        model = build(v, directory, calib, 2048)
        if args.speed_only:
            rows.append({"name": v.name, "desc": describe(model), "mib": weight_bytes(model) / 2**20})
            models[v.name] = model
            continue
        ppl, agree, preds = quality(model, ref_preds, evals)
        conts = [greedy(SpeculativeDecoder(model, tok), ids, 64).token_ids for ids in prompts]
        if ref_preds is None:
            ref_preds, ref_cont = preds, conts
        prefix = statistics.mean(common_prefix(a, b) for a, b in zip(conts, ref_cont))
        rows.append({"name": v.name, "desc": describe(model), "ppl": ppl, "agree": agree, "prefix": prefix,
                     "mib": weight_bytes(model) / 2**20})
        models[v.name] = model
        print(f"{v.name}: ppl {ppl:.3f} agree {agree:.4f} prefix {prefix:.1f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    paths = None if args.skip_paths else kernel_paths(models["fp32"])
    speed = interleaved_speed({n: SpeculativeDecoder(m, tok) for n, m in models.items()}, prompts, args.tokens,
                              args.rounds)
    qd = None
    from specdec.spec.adaptive import CostModel
    cost = CostModel(9)
    cost.profile(models["fp32"], repeats=5)
    if not args.skip_qdraft:
        ks = [None if k == "adaptive" else int(k) for k in args.qdraft_k.split(",")]
        qd = interleaved_speed(qdraft_decoders(models["fp32"], tok, ks), prompts, max(args.tokens, 64), args.rounds)
    load_after = os.getloadavg()
    text = report(args, rows, speed, qd, paths, cost, evals, calib, load_before, load_after)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


def report(args, rows, speed, qd, paths, cost, evals, calib, load_before, load_after) -> str:
    fp = rows[0]
    n_eval = sum(len(s) - 1 for s in evals) if evals else 0
    lines = [
        "# Quantization: quality, speed and memory (int8 / int4 weights, int8 activations in the decode kernels; qdraft)", "",
        f"- Date: {datetime.date.today().isoformat()}; machine: {machine()}; model: {args.model} "
        f"(SmolLM2-135M-Instruct from its Q4_1 GGUF, run in fp32).",
        f"- Threads: quality runs 1; speed runs {args.threads} (torch and the C kernels' OpenMP). The machine is "
        f"shared: load average {load_before[0]:.1f} before the speed runs, {load_after[0]:.1f} after.",
        f"- Perplexity: {len(evals)} held-out ShareGPT conversations (chat template, first {args.seq_len} "
        f"tokens each, {n_eval} predicted tokens; never used for calibration), teacher-forced in blocks of "
        f"{MAX_ROWS} tokens (the decode/verify kernels, int8 activations included).",
        "- Agreement: share of those positions where the model's argmax equals fp32's argmax. Greedy prefix: "
        "mean number of leading tokens of a 64-token greedy continuation (2 chat prompts) identical to fp32's.",
        f"- Speed: plain greedy decoding, {args.tokens} new tokens on each of 2 chat prompts, every model in "
        f"turn, {args.rounds} rounds in one process; median tok/s and median of per-round ratios to fp32.",
        f"- AWQ calibration: {sum(len(s) for s in calib) if calib else 0} tokens of other ShareGPT "
        "conversations, alpha grid 20; lm_head and tied embedding int8-g32 in every scheme.",
        "- Memory: bytes of all weights and buffers (each storage once).", "",
        "| scheme | weights | perplexity | vs fp32 | top-1 agreement | greedy prefix (of 64) | decode tok/s | speed vs fp32 | weights MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps, ratio, _ = speed[r["name"]]
        q = (f"{r['ppl']:.3f} | {100 * (r['ppl'] / fp['ppl'] - 1):+.2f}% | {100 * r['agree']:.2f}% | {r['prefix']:.1f}"
             if "ppl" in r else "- | - | - | -")
        lines.append(f"| {r['name']} | {r['desc']} | {q} | {tps:.2f} | {ratio:.2f}x | {r['mib']:.0f} |")
    if paths:
        base = paths[0][1]
        lines += ["", "## Matmul paths at T = 1 (decode), every decoder linear of the model once", "",
                  "Candidates for the quantized decode matmul, interleaved in one run, median of 7; relative "
                  "error of one qkv output against fp32.", "",
                  "| path | ms per token (all layers) | speed vs gemv.c | rel. error |", "|---|---|---|---|"]
        lines += [f"| {n} | {ms:.1f} | {base / ms:.2f}x | {err:.4f} |" for n, ms, err in paths]
    if qd:
        lines += ["", "## qdraft: the int4-g32 copy drafting for the fp32 target", "",
                  f"Greedy, {max(args.tokens, 64)} new tokens on each of 2 chat prompts, {args.rounds} rounds "
                  "interleaved with plain fp32 decoding; output identical to plain decoding (tests assert it).", "",
                  "| decoder | tok/s | speed-up | acceptance rate |", "|---|---|---|---|"]
        for name, (tps, ratio, acc) in qd.items():
            lines.append(f"| {name} | {tps:.2f} | {ratio:.2f}x | {'-' if acc is None else f'{acc:.3f}'} |")
        lines += ["", "fp32 target forward time over T new tokens relative to T = 1 (what a verify pass of k = T - 1 "
                  "drafts costs; specdec's CostModel profile, median of 5): " +
                  ", ".join(f"T={t}: {cost.relative(t):.2f}" for t in range(1, 10))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
