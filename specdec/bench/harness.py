"""The benchmark harness: every system x every prompt, interleaved, in one process and one run.

    specdec bench --prompts-per-category 3 --max-tokens 96 --repeats 3 --out docs/benchmarks/x

A *system* is one way to generate: our plain decoding (the baseline), each registered speculative
method, and the peers (specdec.bench.peers). For each repeat, each prompt is run by every system
back to back, the order rotated from prompt to prompt, so that the load of a shared machine hits
every system alike; speedups are ratios of tokens/s measured inside the same repeat.

Times are wall clock around one generation (prefill + decode), tokens are the new tokens generated
(each system stops at EOS or max_tokens; greedy lossless systems make the same tokens, and with
--temperature every system samples the target's distribution with the same seed per prompt).
Proposers are rebuilt at every repeat, so no drafter can remember a previous repeat's output.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.bench.costs import PeakRSS, rss_mb
from specdec.bench.systems import BASELINE, Generated, SpecdecSystem, System
from specdec.cache.kv_cache import kv_cache_dtype_named
from specdec.config import HEAD_SHAPE_KEYS, ConfigError, SpeculativeConfig, check_method_name, split_method
from specdec.train.make_draft import cached_draft_dir, draft_dir_layers



@dataclass
class RunRecord:
    repeat: int
    category: str
    prompt: int  # index into the prompt list
    system: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    prefill_seconds: float | None
    target_passes: int | None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    peak_rss_mb: float | None = None  # whole process, during this generation
    extra_rss_mb: float | None = None  # peak minus the RSS before this generation
    phase: str = "main"  # "main" | "sweep"
    first_tokens: int = 1  # tokens emitted by the time prefill_seconds was taken
    by_match_length: dict = field(default_factory=dict)  # lookup steps: "n" -> [drafts, drafted, accepted]
    output_digest: str = ""  # of the new token ids: greedy systems must match plain decoding's (bench/outputs.py)


# ---------------------------------------------------------------- the run loop
@dataclass
class SystemStatus:
    name: str
    ok: bool
    setup_seconds: float = 0.0
    setup_rss_mb: float | None = None  # RSS growth while setting up (weights it loaded)
    note: str = ""
    describe: dict = field(default_factory=dict)


RUN_ERRORS = (ConfigError, FileNotFoundError, ImportError, RuntimeError, ValueError, OSError)


def _rotated(items: list, shift: int) -> list:
    if not items:
        return items
    shift %= len(items)
    return items[shift:] + items[:shift]


def setup_systems(systems: list[System], warmup_ids: list[int], log=print) -> tuple[list[System], list[SystemStatus]]:
    """Set up and warm up each system; a system that fails is dropped with its reason."""
    ready, status = [], []
    for s in systems:
        before = rss_mb()
        t0 = time.perf_counter()
        try:
            s.setup()
            s.generate(warmup_ids, 8)  # first-call allocations, cost profiles, drafter calibration
        except RUN_ERRORS as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            log(f"  skip {s.name}: {msg}")
            status.append(SystemStatus(s.name, False, note=msg, describe=s.describe()))
            s.close()
            continue
        after = rss_mb()
        dt = time.perf_counter() - t0
        log(f"  ready {s.name} ({dt:.1f} s)")
        status.append(SystemStatus(s.name, True, dt, None if before is None or after is None else after - before,
                                   s.note, s.describe()))
        ready.append(s)
    return ready, status


def _record(g: Generated, repeat: int, prompt, idx: int, system: System, mem: PeakRSS, phase: str) -> RunRecord:
    spec = g.spec or {}
    return RunRecord(repeat, prompt.category, idx, system.name, len(prompt.token_ids), len(g.token_ids), g.seconds,
                     g.prefill_seconds, g.target_passes,
                     spec.get("num_drafts", 0), spec.get("num_draft_tokens", 0), spec.get("num_accepted_tokens", 0),
                     spec.get("drafted_per_pos", []), spec.get("accepted_per_pos", []),
                     spec.get("draft_seconds", 0.0), mem.peak_mb, mem.extra_mb, phase, g.first_tokens,
                     spec.get("by_match_length", {}), _digest(g.token_ids))


def _digest(token_ids) -> str:
    return hashlib.sha1(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()[:16]


def run_interleaved(systems: list[System], prompts: list, max_tokens: int, repeats: int, phase: str = "main",
                    log=print, failed: dict[str, str] | None = None) -> list[RunRecord]:
    """repeats x prompts x systems, systems in a rotating order. A system that raises is dropped (its
    records too, so every remaining system covers the same prompts) and its error is put in `failed`."""
    records: list[RunRecord] = []
    failed = {} if failed is None else failed
    total = repeats * len(prompts)
    for r in range(repeats):
        if r > 0:
            for s in systems:
                s.new_repeat()
        for i, p in enumerate(prompts):
            for s in _rotated(systems, r + i):
                if s.name in failed:
                    continue
                try:
                    with PeakRSS() as mem:
                        g = s.generate(p.token_ids, max_tokens)
                except RUN_ERRORS as e:
                    why = str(e).splitlines()[0] if str(e) else type(e).__name__
                    failed[s.name] = f"failed on a {p.category} prompt: {why}"
                    if log:
                        log(f"  drop {s.name}: {failed[s.name]}")
                    continue
                records.append(_record(g, r, p, i, s, mem, phase))
            done = r * len(prompts) + i + 1
            if log and (done % max(1, total // 10) == 0 or done == total):
                log(f"  {phase}: {done}/{total} prompt runs")
    return [rec for rec in records if rec.system not in failed]


def records_to_dicts(records: list[RunRecord]) -> list[dict]:
    out = []
    for rec in records:
        d = asdict(rec)
        d["seconds"] = round(d["seconds"], 6)
        if d["prefill_seconds"] is not None:
            d["prefill_seconds"] = round(d["prefill_seconds"], 6)
        d["draft_seconds"] = round(d["draft_seconds"], 6)
        for key in ("peak_rss_mb", "extra_rss_mb"):
            if d[key] is not None:
                d[key] = round(d[key], 1)
        out.append(d)
    return out


def set_threads(threads: int | None) -> int:
    import os
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


# ---------------------------------------------------------------- the whole benchmark
DEFAULT_METHOD_CONFIGS: dict[str, dict] = {"draft_model": {}, "ngram": {}, "suffix": {}, "layerskip": {},
                                           "lookahead": {}, "recycle": {}}
DEFAULT_PAIRS = ("qdraft+ngram",)  # model drafter + lookup pairs run by default beside the methods


@dataclass(frozen=True)
class BenchConfig:
    model: str = "smollm2-135m"
    dtypes: tuple[str, ...] = ("float32",)
    categories: tuple[str, ...] | None = None  # None: all (specdec.bench.prompts.CATEGORIES)
    prompts_per_category: int = 3
    max_tokens: int = 96
    repeats: int = 3
    threads: int | None = None
    methods: tuple[str, ...] | None = None  # None: every registered speculative method
    method_configs: dict = field(default_factory=dict)  # method -> extra speculative_config keys
    peers: tuple[str, ...] | None = None  # None: all peers; (): none; else names or families
    draft_model: str | None = "auto"  # "auto": a layer-truncated copy of the target; None: no draft model
    draft_layers: int = 8
    sweep_ks: tuple[int, ...] = (1, 2, 4, 8)  # (): no k sweep
    sweep_methods: tuple[str, ...] | None = None  # None: every method that ran
    sweep_categories: tuple[str, ...] = ("chat", "summarization", "rag", "code")  # first prompt of each
    cost_ks: tuple[int, ...] = tuple(range(1, 33))
    bandwidth_mb: int = 512  # buffer of the streaming-read bandwidth measurement
    first_turn_tokens: int = 48
    max_prompt_tokens: int = 1536
    temperature: float = 0.0  # > 0: every system samples, a seed per prompt (our systems only: peers run greedy)
    repetition_penalty: float = 1.0  # != 1: every system applies it (our systems only)
    amx: bool = False  # bf16 on an AMX CPU: every model of ours on AMX tiles (quant/bf16.py use_amx_tiles)
    kv_cache_dtype: str = "auto"  # every model of ours keeps its keys/values in this (LLM(kv_cache_dtype=...))

    def __post_init__(self):
        from specdec.bench.peers import PEER_FAMILIES

        # named systems checked before anything loads: a typo fails now, not after minutes of measuring
        for name in (self.methods or ()) + tuple(self.method_configs) + (self.sweep_methods or ()):
            check_method_name(name)
        for peer in self.peers or ():
            if peer.split(":")[0].split("-")[0] not in PEER_FAMILIES:
                raise ConfigError(f"unknown peer {peer!r}; choose {', '.join(PEER_FAMILIES)} (or one of their "
                                  f"systems, e.g. transformers:assisted), or 'none'")
        if any(k < 1 for k in self.sweep_ks):
            raise ConfigError(f"sweep k values must be >= 1, got {list(self.sweep_ks)}")
        kv_cache_dtype_named(self.kv_cache_dtype)  # a ConfigError for another name

    @property
    def decoding(self) -> dict:
        """How every one of our systems decodes (SpecdecSystem's keyword arguments)."""
        return {"temperature": self.temperature, "repetition_penalty": self.repetition_penalty}


def _cached_loader(dtype, max_len, amx: bool = False, kv_cache_dtype: str = "auto"):
    from specdec.model.loader import load_model, resolve_model
    from specdec.model.tokenizer import Tokenizer
    from specdec.quant.bf16 import use_amx_tiles
    loaded: dict[str, tuple] = {}

    def load(name: str):
        if name not in loaded:
            src = resolve_model(name, progress=False)
            model = load_model(src.directory, dtype, max_len)
            use_amx_tiles(model, amx)
            model.kv_cache_dtype = kv_cache_dtype_named(kv_cache_dtype)
            loaded[name] = (model, Tokenizer(src.directory), src)
        return loaded[name]
    return load


def _answer_fn(plain: SpecdecSystem, tokenizer, max_tokens: int):
    from specdec.bench.prompts import render

    def answer(messages: list[dict]) -> str:
        _, ids = render(tokenizer, messages)
        g = plain.generate(ids, max_tokens, greedy=True)  # the prompt's own first answer: greedy at any temperature
        return tokenizer.decode(g.token_ids).strip() or "OK."
    return answer


def step_k(method: str, lookup: str | None, spec: dict, k: int) -> int:
    """k, or at most what a learned head drafts a step where its spec gives the head's shape (without one,
    EAGLE's k is its chain's length and Medusa's its tree's nodes: SpeculativeConfig.from_dict)."""
    if lookup is not None or not any(key in spec for key in HEAD_SHAPE_KEYS):
        return k
    shape = {key: v for key, v in spec.items() if key not in ("num_speculative_tokens", "method")}
    try:
        limit = SpeculativeConfig.from_dict({"method": method, **shape}).step_limit
    except ConfigError:
        return k  # (its setup says what is wrong)
    return k if limit is None else min(k, limit)


def our_systems(cfg: BenchConfig, target, tokenizer, source_dir: Path, draft_dir: Path | None, load_aux,
                k: int | None = None) -> tuple[list[System], list[tuple[str, str]]]:
    from specdec.spec.proposer import available_methods

    methods = available_methods() + list(DEFAULT_PAIRS) if cfg.methods is None else list(cfg.methods)
    systems: list[System] = [] if k is not None else [SpecdecSystem(target, tokenizer, source_dir, **cfg.decoding)]
    skipped = []
    for name in methods:
        m, _ = split_method(name)
        spec = dict(DEFAULT_METHOD_CONFIGS.get(m, {}), **cfg.method_configs.get(name, {}))
        if m == "draft_model" and "model" not in spec:
            if draft_dir is None:
                skipped.append((f"specdec:{name}", "no draft model available (--draft-model)"))
                continue
            spec["model"] = str(draft_dir)
        label = name
        if k is not None:
            spec["num_speculative_tokens"] = step_k(m, split_method(name)[1], spec, k)
            label = f"{name}@k{spec['num_speculative_tokens']}"
        systems.append(SpecdecSystem(target, tokenizer, source_dir, name, spec, load_aux, label, **cfg.decoding))
    return systems, skipped


def run_dtype(cfg: BenchConfig, dtype_name: str, prompts: list | None, log=print) -> tuple[dict, list]:
    """Everything measured at one dtype. Builds the prompts on first use (multi-turn answers are the
    target's own) and returns them for the next dtype."""
    from specdec.bench.costs import measure_bandwidth, measure_cost_curve, weight_bytes_per_token
    from specdec.bench.peers import make_peers
    from specdec.bench.prompts import CATEGORIES, build_prompts
    from specdec.model.loader import load_model, resolve_dtype, resolve_model
    from specdec.model.tokenizer import Tokenizer
    from specdec.quant.bf16 import use_amx_tiles

    threads = set_threads(cfg.threads)
    dtype = resolve_dtype(dtype_name)
    t0 = time.perf_counter()  # a load from the conversion cache (the first conversion ran before, if ever)
    source = resolve_model(cfg.model, progress=False)
    max_len = cfg.max_prompt_tokens + cfg.max_tokens + 160
    base_rss = rss_mb()
    target = load_model(source.directory, dtype, max_len)
    amx_tiles = use_amx_tiles(target, cfg.amx)
    target.kv_cache_dtype = kv_cache_dtype_named(cfg.kv_cache_dtype)
    target_rss = None if base_rss is None else rss_mb() - base_rss
    tokenizer = Tokenizer(source.directory)
    load_seconds = time.perf_counter() - t0
    plain = SpecdecSystem(target, tokenizer, source.directory, **cfg.decoding)
    plain.setup()
    if prompts is None:
        log("building prompts ...")
        prompts = build_prompts(tokenizer, cfg.prompts_per_category, cfg.categories or CATEGORIES,
                                _answer_fn(plain, tokenizer, cfg.first_turn_tokens), cfg.max_prompt_tokens)
    log(f"[{dtype_name}] cost curve and memory bandwidth ...")
    curve = measure_cost_curve(target, cfg.cost_ks)
    result = {"dtype": str(dtype).replace("torch.", ""), "threads": threads, "model_dir": str(source.directory),
              "cost_curve": curve.to_dict(), "bandwidth_gb_s": round(measure_bandwidth(cfg.bandwidth_mb), 2),
              "weight_bytes_per_token": weight_bytes_per_token(target), "base_rss_mb": base_rss,
              "target_rss_mb": target_rss, "load_seconds": round(load_seconds, 3), "amx_tiles": amx_tiles > 0}
    draft_dir = None
    if cfg.draft_model == "auto":
        draft_dir = cached_draft_dir(source.directory, target, cfg.draft_layers)
    elif cfg.draft_model:
        draft_dir = resolve_model(cfg.draft_model, progress=False).directory
    result["draft_model"] = None if draft_dir is None else {"dir": str(draft_dir), "auto": cfg.draft_model == "auto",
                                                             "layers": draft_dir_layers(draft_dir)}
    load_aux = _cached_loader(dtype, max_len, cfg.amx, cfg.kv_cache_dtype)
    ours, skipped = our_systems(cfg, target, tokenizer, source.directory, draft_dir, load_aux)
    peers, peer_skips = ([], []) if cfg.peers == () else make_peers(
        source.directory, dtype, threads, max_len + 64, sorted(tokenizer.eos_token_ids), draft_dir, cfg.peers)
    warm = prompts[0].token_ids[:64]
    log(f"[{dtype_name}] setting up {len(ours) + len(peers)} systems ...")
    systems, status = setup_systems(ours + peers, warm, log)
    if BASELINE not in {s.name for s in systems}:
        raise ConfigError("plain decoding failed to run; nothing to compare against")
    failed: dict[str, str] = {}
    records = run_interleaved(systems, prompts, cfg.max_tokens, cfg.repeats, "main", log, failed=failed)
    if BASELINE in failed:
        raise ConfigError(f"plain decoding {failed[BASELINE]}")
    for st in status:
        if st.name in failed:
            st.ok, st.note = False, failed[st.name]
    for s in peers:
        s.close()
    sweep: list[RunRecord] = []
    ready_methods = tuple(s.method for s in systems if s.family == "specdec" and s.method != "plain"
                          and s.name not in failed
                          and (cfg.sweep_methods is None or s.method in cfg.sweep_methods))
    if cfg.sweep_ks and ready_methods:
        firsts = {c: next((p for p in prompts if p.category == c), None) for c in cfg.sweep_categories}
        sub = [p for p in firsts.values() if p is not None] or prompts[:1]
        sweep_cfg = BenchConfig(**{**cfg.__dict__, "methods": ready_methods})
        sweep_systems = [plain]
        for k in cfg.sweep_ks:  # (a head's k capped at its step's drafts: one system a label)
            seen = {s.name for s in sweep_systems}
            sweep_systems += [s for s in our_systems(sweep_cfg, target, tokenizer, source.directory, draft_dir,
                                                     load_aux, k)[0] if s.name not in seen]
        log(f"[{dtype_name}] k sweep: {len(sweep_systems)} systems x {len(sub)} prompts ...")
        ready, _ = setup_systems(sweep_systems[1:], warm, log)
        sweep = run_interleaved([plain] + ready, sub, cfg.max_tokens, 1, "sweep", log)
        result["sweep_prompts"] = [prompts.index(p) for p in sub]
    result.update(systems=[s.__dict__ for s in status], skipped=[{"name": n, "reason": r} for n, r in skipped + peer_skips],
                  records=records_to_dicts(records), sweep_records=records_to_dicts(sweep))
    return result, prompts


def run_benchmark(cfg: BenchConfig, log=print) -> dict:
    """The full benchmark: environment, prompts, and per dtype the foundation figures, every system x
    category and the k sweep (raw records included; summaries come from specdec.bench.report)."""
    from specdec.bench.costs import environment

    if not 0.0 <= cfg.temperature <= 2.0:
        raise ConfigError("--temperature must be in [0, 2]")
    if cfg.temperature > 0 and cfg.peers != ():
        raise ConfigError("--temperature > 0 samples with our systems only: add --peers none (the peers run greedy)")
    if not 0.0 < cfg.repetition_penalty <= 2.0:
        raise ConfigError("--repetition-penalty must be in (0, 2]")
    if cfg.repetition_penalty != 1.0 and cfg.peers != ():
        raise ConfigError("--repetition-penalty applies to our systems only: add --peers none")
    started = time.time()
    threads = set_threads(cfg.threads)
    env_before = environment()
    load = env_before["load_average"][0]
    if threads > 1 and load > (env_before["cores"] or 1):
        log(f"warning: the machine is busy (load {load:.1f} on {env_before['cores']} cores); with {threads} threads "
            "per process the timings are dominated by thread scheduling: consider --threads 1")
    prompts, runs = None, {}
    for dt in cfg.dtypes:
        runs[dt], prompts = run_dtype(cfg, dt, prompts, log)
    env = dict(env_before, load_average_end=environment()["load_average"])
    return {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "environment": env, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "wall_seconds": round(time.time() - started, 1),
            "prompts": [p.to_dict() for p in prompts], "runs": runs}
