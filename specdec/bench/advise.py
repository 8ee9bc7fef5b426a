"""`specdec advise`: should speculation be on for this model, machine and these prompts, and how?

Measures, on the user's prompts and this machine:
    c(T)        the target's forward cost over T new tokens (the cost curve), T up to B * (k_max + 1)
    per method  a probe run at fixed k = k_max: how often draft position j is proposed / accepted per
                target step, and the draft cost per drafted token c_draft
and predicts for every k (docs/algorithms.md, the cost model; B = batch size):

    tokens(k)  = 1 + sum_{j<=k} P(position j accepted)            per target step (tau incl. plain steps)
    cost(k)    = E[c(B (L_k + 1))] / c(B) + E[L_k] * B * c_draft / c(B)     L_k = min(proposal length, k)
    speedup(k) ~= tokens(k) / cost(k)

A batch of B requests verifying T tokens each is costed as one forward over B * T tokens (the matmuls
dominate; attention is per request). Then it recommends the best (method, k) -- or plain decoding when nothing beats it by 5% -- with the reason
(latency-bound vs throughput-bound, batch, acceptance), and checks the recommendation by measuring it
against plain decoding on the same prompts, at that k and (batch 1) with adaptive k, which chooses k
per step and prices a lookup's chains by their match length; the faster of the two is recommended.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec.bench.costs import CostCurve, measure_cost_curve
from specdec.bench.systems import SpecdecSystem
from specdec.config import HEAD_SHAPE_KEYS, ConfigError, SpeculativeConfig
from specdec.engine.speculation import TREE_MAX_ROWS

MIN_GAIN = 1.05


@dataclass
class MethodEstimate:
    method: str
    config: dict
    best_k: int
    expected_speedup: float  # at best_k
    tokens_per_step: float  # at best_k
    acceptance_rate: float  # of drafted tokens in the probe
    draft_cost_rel: float  # c_draft / c_1, per drafted token
    tree_size: float | None = None  # mean nodes per proposal, for tree proposers
    per_k: list[dict] = field(default_factory=list)  # {"k", "expected_speedup", "tokens_per_step", "cost"}


@dataclass
class Advice:
    model: str
    dtype: str
    threads: int
    batch_size: int
    num_prompts: int
    regime: str  # "latency-bound" | "throughput-bound" | "in between"
    verify_cost_ratio: float  # c(B (k_max+1)) / c(B)
    # method (None = plain), k (None: adaptive), tree_size, expected_speedup, measured_speedup, speculative_config,
    # adaptive, measured ({"fixed": x, "adaptive": y}: each against plain decoding on the same prompts)
    recommendation: dict
    reason: str
    candidates: list[MethodEstimate]
    skipped: list[dict]
    cost_curve: dict
    decoding: dict = field(default_factory=dict)  # temperature, repetition_penalty the prompts were run at

    def to_dict(self) -> dict:
        return asdict(self)


def _rel(curve: CostCurve, batch: int, tokens_per_request: int) -> float:
    """c(B * T) / c(B): a batched verify step relative to a batched plain step (T = 1)."""
    return curve.relative(batch * tokens_per_request) / curve.relative(batch)


def estimate(drafted_per_pos: list[int], accepted_per_pos: list[int], steps: int, draft_cost_rel: float,
             curve: CostCurve, batch: int, k: int) -> dict:
    """Expected tokens, cost and speedup per target step at chain length k, from a probe at k >= this k."""
    if steps <= 0:
        return {"k": k, "tokens_per_step": 1.0, "cost": 1.0, "expected_speedup": 1.0}
    ge = [1.0] + [d / steps for d in drafted_per_pos[:k]] + [0.0] * max(0, k - len(drafted_per_pos))
    tokens = 1.0 + sum(a / steps for a in accepted_per_pos[:k])
    verify = 0.0
    for L in range(k + 1):  # P(min(len, k) = L) * relative cost of verifying L drafts
        p_len = ge[L] - (ge[L + 1] if L < k else 0.0)
        verify += max(p_len, 0.0) * _rel(curve, batch, L + 1)
    mean_len = sum(ge[1:k + 1])
    cost = verify + mean_len * draft_cost_rel * batch / curve.relative(batch)
    return {"k": k, "tokens_per_step": tokens, "cost": cost, "expected_speedup": tokens / cost}


def _probe(system: SpecdecSystem, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run a method at fixed k over the prompts; collect per-position stats, draft cost, tree sizes."""
    proposer = system.decoder.proposer
    nodes: list[int] = []
    trees = [False]
    inner = proposer.propose

    def propose(state, k):
        p = inner(state, k)
        if len(p):
            nodes.append(len(p))
            trees[0] = trees[0] or p.is_tree
        return p

    proposer.propose = propose  # observe proposals without changing them
    stats = {"steps": 0, "drafted": [], "accepted": [], "draft_s": 0.0, "draft_tokens": 0, "acc_tokens": 0,
             "tokens": 0, "seconds": 0.0}
    for ids in prompts:
        g = system.generate(ids, max_tokens)
        s = g.spec
        stats["steps"] += g.target_passes
        for key, src in (("drafted", s["drafted_per_pos"]), ("accepted", s["accepted_per_pos"])):
            stats[key] = [a + b for a, b in zip(stats[key] + [0] * len(src), src + [0] * len(stats[key]))]
        stats["draft_s"] += s["draft_seconds"]
        stats["draft_tokens"] += s["num_draft_tokens"]
        stats["acc_tokens"] += s["num_accepted_tokens"]
        stats["tokens"] += len(g.token_ids)
        stats["seconds"] += g.seconds
    proposer.propose = inner
    stats["tree"] = trees[0]
    stats["mean_nodes"] = sum(nodes) / len(nodes) if nodes else 0.0
    return stats


def _regime(ratio: float, batch: int, k: int) -> str:
    if ratio <= 3.0:
        return "latency-bound"
    return "throughput-bound" if ratio >= 0.6 * (k + 1) else "in between"


def _reason(regime: str, ratio: float, batch: int, k_max: int, best: MethodEstimate | None,
            rec: dict, n_prompts: int) -> str:
    where = f"batch {batch}" if batch > 1 else "batch 1"
    parts = [f"At {where} a target forward over {k_max + 1} tokens per request costs {ratio:.2f}x a plain step "
             f"({regime}: " + ("verifying drafts is nearly free, speculation pays whenever drafts are accepted)"
                               if regime == "latency-bound" else
                               "every rejected draft token costs real compute, so only high acceptance pays)"
                               if regime == "throughput-bound" else
                               "verification is neither free nor proportional to its size)")]
    if best is None:
        parts.append("no speculative method could run here")
    else:
        parts.append(f"the best method on your {n_prompts} prompts, {best.method}, had {best.acceptance_rate:.0%} of "
                     f"its drafted tokens accepted, {best.tokens_per_step:.2f} tokens per target step at k={best.best_k}, "
                     f"drafting costing {best.draft_cost_rel:.3f}x a target step per token")
    if rec.get("slower"):
        parts.append(f"{rec['slower']} was expected at {best.expected_speedup:.2f}x but measured " + ", ".join(
            f"{v:.2f}x {'at k=' + str(best.best_k) if name == 'fixed' else 'with adaptive k'}"
            for name, v in rec["measured"].items()) + " against plain decoding on the same prompts: keep plain decoding")
    elif rec["method"] is None:
        parts.append(f"the best expected gain is {best.expected_speedup if best else 1.0:.2f}x, under the "
                     f"{MIN_GAIN:.2f}x bar: keep plain decoding")
    else:
        meas = rec.get("measured") or {}
        parts.append(f"expected speedup {rec['expected_speedup']:.2f}x at k={best.best_k}" + "".join(
            f", measured {v:.2f}x {'at that k' if name == 'fixed' else 'with adaptive k'}" for name, v in meas.items())
            + (" against plain decoding on the same prompts" if meas else "")
            + (f" (measured one request at a time: the check does not run a batch of {batch})" if meas and batch > 1
               else ""))
        if rec.get("adaptive"):
            parts.append("adaptive k measured faster than the best fixed k: leave num_speculative_tokens unset")
    return "; ".join(parts) + "."


def _verify(plain: SpecdecSystem, best: MethodEstimate, spec: dict, batch_size: int, prompts: list[list[int]],
            max_tokens: int, log, make_system) -> dict:
    """Measure the recommendation against plain decoding: at its fixed k and, for one request at a time,
    with adaptive k too (per step and per match length for lookups, which a single k cannot follow);
    the recommendation becomes the faster of the two."""
    measured = {}
    adaptive_spec = {k: v for k, v in spec.items() if k != "num_speculative_tokens"}
    if not any(key in spec for key in (*HEAD_SHAPE_KEYS, "lookup")):
        # a learned head's shape came from k alone (an EAGLE chain of k, a Medusa tree of k): the same head, adaptive
        full = SpeculativeConfig.from_dict(spec)
        if full.method in ("eagle", "eagle3"):
            adaptive_spec["num_steps"] = full.num_steps
        elif full.method == "medusa":
            adaptive_spec["num_draft_tokens"] = full.num_draft_tokens
    options = [("fixed", spec)] + ([("adaptive", adaptive_spec)] if batch_size == 1 else [])
    for name, option in options:
        config = {k: v for k, v in option.items() if k != "method"}
        log(f"checking {best.method} ({name} k{'=' + str(best.best_k) if name == 'fixed' else ''}) against plain decoding ...")
        system = make_system(config)
        system.setup()
        system.generate(prompts[0][:32], 4)  # warm-up: adaptive k profiles the cost curve on first use
        measured[name] = round(_measure_pair(plain, system, prompts, max_tokens), 3)
    out = {"measured_speedup": measured["fixed"], "measured": measured, "adaptive": False}
    if measured.get("adaptive", 0.0) > measured["fixed"]:
        out.update(measured_speedup=measured["adaptive"], adaptive=True, k=None, speculative_config=adaptive_spec)
    return out


def _measure_pair(plain: SpecdecSystem, chosen: SpecdecSystem, prompts: list[list[int]], max_tokens: int) -> float:
    t = {"plain": [0, 0.0], "chosen": [0, 0.0]}
    for i, ids in enumerate(prompts):
        order = [("plain", plain), ("chosen", chosen)][:: 1 if i % 2 == 0 else -1]
        for name, s in order:
            g = s.generate(ids, max_tokens)
            t[name][0] += len(g.token_ids)
            t[name][1] += g.seconds
    return (t["chosen"][0] / t["chosen"][1]) / (t["plain"][0] / t["plain"][1])


def typical_context(prompts: list[list[int]], max_tokens: int) -> int:
    """The context a decode or verify pass typically sees on these prompts: the median prompt plus half
    the answer. The cost curve is measured after that many cached tokens, since attention over a long
    context makes a verify pass dearer (bf16 SmolLM2-135M, 8 tokens: ~1.0x one token after 128 cached,
    ~1.3x after 1024; methods.md session 27)."""
    lengths = sorted(len(p) for p in prompts)
    return max(1, lengths[len(lengths) // 2] + max_tokens // 2)


def advise(model: str, prompts: list[list[int]], dtype: str = "auto", threads: int | None = None,
           batch_size: int = 1, max_tokens: int = 64, k_max: int = 8, methods: tuple[str, ...] | None = None,
           method_configs: dict | None = None, draft_model: str | None = None, verify: bool = True,
           log=None, temperature: float = 0.0, repetition_penalty: float = 1.0, amx: bool = False,
           kv_cache_dtype: str = "auto") -> Advice:
    """temperature, repetition_penalty: how the requests will decode (every system measured so; sampled
    runs seed each prompt, the same seed for every system). amx: bf16 on AMX tiles (LLM(amx=True), the
    server's default), where verify passes cost far less than on vdpbf16ps. kv_cache_dtype: the caches'
    (LLM(kv_cache_dtype=...)), for the target and its drafters."""
    from specdec.bench.harness import BenchConfig, _cached_loader, our_systems, set_threads
    from specdec.cache.kv_cache import kv_cache_dtype_named
    from specdec.model.loader import load_model, resolve_dtype, resolve_model
    from specdec.model.tokenizer import Tokenizer
    from specdec.quant.bf16 import use_amx_tiles

    if not prompts:
        raise ConfigError("no prompts to advise on")
    if batch_size < 1 or k_max < 1:
        raise ConfigError("--batch-size and --k-max must be >= 1")
    if not 0.0 <= temperature <= 2.0 or not 0.0 < repetition_penalty <= 2.0:
        raise ConfigError("--temperature must be in [0, 2] and --repetition-penalty in (0, 2]")
    log = log or (lambda *a: None)
    n_threads = set_threads(threads)
    source = resolve_model(model, progress=False)
    dt = resolve_dtype(dtype)
    top = batch_size * (k_max + 1)  # the widest pass the cost curve measures, after `context` cached tokens
    max_len = max(len(p) for p in prompts) + max_tokens + 2 * k_max + top + 64
    target = load_model(source.directory, dt, max_len)
    use_amx_tiles(target, amx)
    target.kv_cache_dtype = kv_cache_dtype_named(kv_cache_dtype)
    tokenizer = Tokenizer(source.directory)
    context = min(typical_context(prompts, max_tokens), max_len - top - 1)
    log(f"measuring the cost curve after {context} cached tokens ...")
    curve = measure_cost_curve(target, sorted(set(range(1, k_max + 2)) | {batch_size * j for j in range(1, k_max + 2)}
                                              | {top}), prefix_len=context)
    ratio = _rel(curve, batch_size, k_max + 1)
    regime = _regime(ratio, batch_size, k_max)
    cfg = BenchConfig(model=model, methods=methods, method_configs=method_configs or {}, temperature=temperature,
                      repetition_penalty=repetition_penalty)
    plain = SpecdecSystem(target, tokenizer, source.directory, **cfg.decoding)
    plain.setup()
    plain.generate(prompts[0][:32], 4)
    c1 = curve.seconds[0]
    draft_dir = resolve_model(draft_model, progress=False).directory if draft_model else None
    load_aux = _cached_loader(dt, max_len, amx, kv_cache_dtype)  # the probes' drafters, reused by the check
    probes, skipped = our_systems(cfg, target, tokenizer, source.directory, draft_dir, load_aux,
                                  k=k_max)
    skipped = [{"method": n.split(":", 1)[1], "reason": r} for n, r in skipped]
    candidates: list[MethodEstimate] = []
    for system in probes:
        log(f"probing {system.method} ...")
        try:
            system.setup()
            stats = _probe(system, prompts, max_tokens)
        except (ConfigError, FileNotFoundError, ImportError, RuntimeError, ValueError, OSError) as e:
            skipped.append({"method": system.method, "reason": str(e).splitlines()[0] if str(e) else type(e).__name__})
            continue
        draft_rel = stats["draft_s"] / stats["draft_tokens"] / c1 if stats["draft_tokens"] else 0.0
        if stats["tree"] and batch_size > TREE_MAX_ROWS:  # (its full trees' tokens and pass priced a pass it never runs)
            skipped.append({"method": system.method, "reason": f"a tree drafter: the serving engine verifies trees "
                            f"at up to {TREE_MAX_ROWS} row(s), and at {batch_size} each tree's first path alone; "
                            "not estimated"})
            continue
        if stats["tree"]:
            steps = max(stats["steps"], 1)
            tokens = 1.0 + stats["acc_tokens"] / steps
            cost = _rel(curve, batch_size, int(round(stats["mean_nodes"])) + 1) + \
                stats["draft_tokens"] / steps * draft_rel * batch_size / curve.relative(batch_size)
            per_k = [{"k": k_max, "tokens_per_step": tokens, "cost": cost, "expected_speedup": tokens / cost}]
        else:
            per_k = [estimate(stats["drafted"], stats["accepted"], stats["steps"], draft_rel, curve, batch_size, k)
                     for k in range(1, k_max + 1)]
        best = max(per_k, key=lambda e: e["expected_speedup"])
        acc = stats["acc_tokens"] / stats["draft_tokens"] if stats["draft_tokens"] else 0.0
        candidates.append(MethodEstimate(system.method, {k: v for k, v in system.config.items()
                                                         if k != "num_speculative_tokens"},
                                         best["k"], best["expected_speedup"], best["tokens_per_step"], acc, draft_rel,
                                         stats["mean_nodes"] if stats["tree"] else None,
                                         [{k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()}
                                          for e in per_k]))
    best = max(candidates, key=lambda c: c.expected_speedup, default=None)
    rec = {"method": None, "k": None, "tree_size": None, "expected_speedup": 1.0, "measured_speedup": None,
           "speculative_config": None, "adaptive": False, "measured": {}}
    if best is not None and best.expected_speedup >= MIN_GAIN:
        spec = dict(best.config, num_speculative_tokens=best.best_k)
        rec.update(method=best.method, k=best.best_k, tree_size=best.tree_size,
                   expected_speedup=round(best.expected_speedup, 3), speculative_config=spec)
        if verify:
            rec.update(_verify(plain, best, spec, batch_size, prompts, max_tokens, log,
                               lambda config: SpecdecSystem(target, tokenizer, source.directory, best.method, config,
                                                            load_aux, **cfg.decoding)))
            if rec["measured_speedup"] < 1.0:  # the estimate promised a gain the measurement did not see
                rec.update(method=None, k=None, tree_size=None, speculative_config=None, adaptive=False,
                           slower=best.method)
    reason = _reason(regime, ratio, batch_size, k_max, best, rec, len(prompts))
    return Advice(model, str(dt).replace("torch.", ""), n_threads, batch_size, len(prompts), regime, round(ratio, 3),
                  rec, reason, candidates, skipped, curve.to_dict(), cfg.decoding)
