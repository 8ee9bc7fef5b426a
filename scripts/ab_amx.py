"""A/B of bf16 decoding on AMX tiles against vdpbf16ps, in one process (the two alternate, so the
machine's drift falls on both): a forward's cost by new tokens, offline decoding per method, and the
serving engine's tokens/s by concurrency. Needs a CPU with AMX (Intel Sapphire Rapids on).

    python scripts/ab_amx.py [--methods ngram,qdraft+ngram,eagle3] [--categories rag,chat,summarization,qa]

Each run checks that every method's output equals plain decoding under the same kernel. Figures of
session 31: docs/benchmarks/methods.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.prompts import build_prompts  # noqa: E402
from specdec.config import SpeculativeConfig, split_method  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from specdec.kernels import amx_active  # noqa: E402
from specdec.llm import LLM  # noqa: E402
from specdec.quant.bf16 import Bf16Weight, use_amx_tiles  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402
from specdec.spec.decoder import SpeculativeDecoder  # noqa: E402
from specdec.spec.proposer import ProposerContext, make_proposer  # noqa: E402

KERNELS = ("vdpbf16ps", "amx")


class KernelSwitch:
    """Packs the model's tiles once (use_amx_tiles) and switches every weight between them and none: a
    switch costs nothing (repacking 270 MB per switch would also stir the caches before each measurement)."""

    def __init__(self, model):
        use_amx_tiles(model, True)
        self.tiles = [(w, w.tiles) for w in model.modules() if isinstance(w, Bf16Weight) and w.tiles is not None]
        assert self.tiles, "no weight was packed"

    def __call__(self, kernel: str) -> None:
        for w, tiles in self.tiles:
            w.tiles = tiles if kernel == "amx" else None


def cost_curve(llm: LLM, switch: KernelSwitch, contexts=(128, 900), widths=(1, 2, 4, 8, 12, 16), repeats: int = 11) -> None:
    model = llm.model
    for ctx in contexts:
        cache = model.new_cache(ctx + max(widths) + 1)
        model(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], cache, num_logits=1, prefill=True)
        seconds = {k: {T: [] for T in widths} for k in KERNELS}
        for T in widths:
            for _ in range(repeats):
                for kernel in KERNELS:
                    switch(kernel)
                    ids = torch.randint(0, 1000, (1, T))
                    t = time.perf_counter()
                    model(ids, torch.arange(ctx, ctx + T)[None], cache)
                    seconds[kernel][T].append(time.perf_counter() - t)
                    cache.rollback(ctx)
        for kernel in KERNELS:
            med = {T: statistics.median(v) for T, v in seconds[kernel].items()}
            row = " ".join(f"{T}: {med[T] * 1e3:.2f} ms ({med[T] / med[widths[0]]:.2f}x)" for T in widths)
            print(f"forward after {ctx} tokens, {kernel}: {row}")


def _decoder(llm: LLM, method: str | None) -> SpeculativeDecoder:
    if method is None:
        return SpeculativeDecoder(llm.model, llm.tokenizer)
    name, lookup = split_method(method)
    spec = SpeculativeConfig.from_dict({"method": name, **({"lookup": lookup} if lookup else {})})
    ctx = ProposerContext(llm.model, llm.tokenizer, spec, llm.source.directory, llm.dtype, llm.model.max_len,
                          llm._load_aux)
    return SpeculativeDecoder(llm.model, llm.tokenizer, make_proposer(ctx), spec)


def offline(llm: LLM, switch: KernelSwitch, methods: list[str], categories: tuple[str, ...], per_category: int, max_tokens: int) -> None:
    prompts = build_prompts(llm.tokenizer, per_category, categories)
    decoders = {m: _decoder(llm, None if m == "plain" else m) for m in ["plain"] + methods}
    decode = {(k, m): 0.0 for k in KERNELS for m in decoders}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for p in prompts:
        for kernel in KERNELS:
            switch(kernel)
            outputs = {}
            for m, dec in decoders.items():
                r = dec.generate(p.token_ids, params)
                outputs[m] = r.token_ids
                decode[(kernel, m)] += r.decode_time
            bad = [m for m, out in outputs.items() if out != outputs["plain"]]
            assert not bad, f"{kernel}: {bad} left plain decoding on {p.source}"
    base = decode[("vdpbf16ps", "plain")]
    print(f"offline decode-only tokens/s over plain on vdpbf16ps ({len(prompts)} prompts: {', '.join(categories)}):")
    for (kernel, m), seconds in decode.items():
        print(f"  {kernel:10s} {m:14s} {base / seconds:.2f}x")


def serving(llm: LLM, switch: KernelSwitch, concurrency: list[int], max_tokens: int, repeats: int = 2) -> None:
    # short prompts (MT-bench first turns, translations): the decode steps' batching, not prefill, is measured
    prompts = [p.token_ids for p in build_prompts(llm.tokenizer, 8, ("qa", "math", "code", "translation", "multi_turn"))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(c: int) -> float:
        engine = Engine(llm, EngineConfig(max_num_seqs=c))
        for i, ids in enumerate(prompts[:2 * c]):
            engine.add_request(EngineRequest(str(i), ids, params))
        t, n = time.perf_counter(), 0
        while engine.has_unfinished():
            n += sum(len(o.token_ids) for o in engine.step())
        return n / (time.perf_counter() - t)

    for c in concurrency:
        rates = {k: [] for k in KERNELS}
        for _ in range(repeats):
            for kernel in KERNELS:
                switch(kernel)
                rates[kernel].append(run(c))
        vdp, amx = (statistics.median(rates[k]) for k in KERNELS)
        print(f"engine, {c} sequences, {2 * c} requests of {max_tokens} tokens: vdpbf16ps {vdp:.1f} tok/s, "
              f"amx {amx:.1f} tok/s ({amx / vdp:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="ngram,qdraft+ngram,eagle3")
    ap.add_argument("--categories", default="rag,chat,summarization,qa")
    ap.add_argument("--prompts-per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--parts", default="cost,offline,serving", help="which comparisons to run")
    args = ap.parse_args()
    if not amx_active():
        print("this CPU has no AMX tiles (or SPECDEC_AMX=0): nothing to compare", file=sys.stderr)
        return 1
    llm = LLM(args.model, dtype="bfloat16", num_threads=args.threads, progress=False, enable_prefix_caching=False)
    switch, parts = KernelSwitch(llm.model), args.parts.split(",")
    if "cost" in parts:
        cost_curve(llm, switch)
    if "offline" in parts:
        offline(llm, switch, args.methods.split(","), tuple(args.categories.split(",")), args.prompts_per_category,
                args.max_tokens)
    if "serving" in parts:
        serving(llm, switch, [int(c) for c in args.concurrency.split(",")], args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
