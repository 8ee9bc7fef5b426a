"""The engine against single-request decoding: continuous batching, chunked prefill, preemption,
batched speculation, abort, per-request speculation and structured output (tiny random model)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.engine.grammar import MAX_WAITING_COMPILES, CompilerBusy, GrammarCompiler, available
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

PROMPTS = ["The cat sat on the mat. The cat sat on the", "Hello world, hello world, hello", "1 2 3 4 5 6 7 8",
           "a", "Once upon a time there was a little robot who loved to count: one, two, three,",
           "x y z x y z x y"]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=160, progress=False, num_threads=1)


@pytest.fixture(scope="module")
def ngram(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=160, progress=False, num_threads=1,
               speculative_config={"method": "ngram"})


_REFS: dict = {}


def reference(llm, prompt_ids, params):
    """Single-request decoding (specdec.spec.decoder), cached across tests."""
    key = (id(llm), tuple(prompt_ids), params)
    if key not in _REFS:
        _REFS[key] = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs
    return _REFS[key]


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[tuple[str, int], dict]:
    for r in reqs:
        engine.add_request(r)
    res: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished():
        for o in engine.step():
            d = res.setdefault((o.request_id, o.index), {"ids": [], "text": "", "lps": [], "prompt_lps": None})
            if o.prompt_logprobs is not None:
                assert d["prompt_lps"] is None  # delivered once
                d["prompt_lps"] = o.prompt_logprobs
            d["ids"] += o.token_ids
            d["text"] += o.text
            d["lps"] += o.logprobs or []
            if o.finished:
                d["out"] = o
    assert engine.blocks.num_used == 0  # nothing leaked
    return res


def memory_bound(engine: Engine) -> Engine:
    """The engine priced as on a memory-bound machine: a pass over any number of rows costs what one
    row's does and steps cost nothing outside their passes, so K follows acceptance alone, not this
    machine's timings. A tiny model's pass costs about what its bookkeeping does: on a slower CI
    machine the measured costs priced the n-gram drafter out of a test that checks it drafts."""
    engine.spec.cost.seconds = {1: 1.0, 4096: 1.0}
    engine.spec.cost.observe = lambda n, seconds: None
    engine.spec.observe_overhead = lambda rows, drafted, seconds: None
    return engine


def greedy_reqs(llm, max_tokens=40):
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [EngineRequest(str(i), llm.tokenizer.encode(t), p) for i, t in enumerate(PROMPTS)]


@pytest.mark.parametrize("spec_k", [None, 3])
def test_greedy_batched_speculation_equals_single_request(plain, ngram, spec_k):
    reqs = greedy_reqs(ngram)
    if spec_k:
        for r in reqs:
            r.speculative = {"method": "ngram", "num_speculative_tokens": spec_k}
    engine = memory_bound(Engine(ngram, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=8)))
    packed = []  # decode passes whose rows drafted different lengths ran packed (layer.c, real tokens only)
    real_run = engine.runner.run
    engine.runner.run = lambda rows, *a, **kw: packed.append(real_run(rows, *a, **kw)) or packed[-1]
    res = run(engine, reqs)
    drafted = 0
    for r in reqs:
        got = res[(r.request_id, 0)]
        assert got["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids, r.request_id
        drafted += got["out"].metrics.num_draft_tokens
    assert drafted > 0
    assert any(out.packed for out in packed)


def test_a_drafter_that_raises_leaves_its_row_decoding_without_it(plain, ngram, monkeypatch):
    """A drafter's exception (a draft model whose vocabulary is smaller than the target's, meeting an id
    past it) failed the whole step, and the async engine then aborted every request in flight. Now the row
    it drafts for decodes on without drafts, its output plain decoding's, and the other rows go on drafting.
    Its output still names the method, with what the drafter raised; the engine counts the failure."""
    real = ngram.proposer.propose_lookup
    calls = {"0-0": 0}

    def lookup(state, cap):
        if state.request_id == "0-0":
            calls["0-0"] += 1
            if calls["0-0"] >= 3:
                raise IndexError("index out of range in self")
        return real(state, cap)

    monkeypatch.setattr(ngram.proposer, "propose_lookup", lookup)
    engine = memory_bound(Engine(ngram, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=8)))
    reqs = greedy_reqs(ngram)
    res = run(engine, reqs)  # (no abort; every block back)
    for r in reqs:
        out = res[(r.request_id, 0)]
        assert out["out"].finish_reason == "length"
        assert out["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids, r.request_id
    assert calls["0-0"] == 3  # not asked again after it raised
    assert sum(res[(r.request_id, 0)]["out"].metrics.num_draft_tokens for r in reqs[1:]) > 0
    failed = res[("0", 0)]["out"]
    assert failed.method == "ngram" and failed.drafter_error == "IndexError: index out of range in self"
    assert all(res[(r.request_id, 0)]["out"].drafter_error is None for r in reqs[1:])
    assert engine.stats().drafter_failures == 1


def test_preemption_by_recompute_keeps_outputs(plain, ngram):
    eng = Engine(ngram, EngineConfig(max_num_seqs=6, max_num_batched_tokens=32, block_size=8, num_kv_blocks=21))
    reqs = greedy_reqs(ngram)
    res = run(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    for r in reqs:
        assert res[(r.request_id, 0)]["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids


def test_prefix_cache_hit_gives_same_output(plain):
    eng = Engine(plain, EngineConfig(block_size=4))
    ids = plain.tokenizer.encode(PROMPTS[4])
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = run(eng, [EngineRequest("a", ids, p)])[("a", 0)]
    second = run(eng, [EngineRequest("b", ids, p)])[("b", 0)]
    salted = run(eng, [EngineRequest("c", ids, p, cache_salt="other-tenant")])[("c", 0)]
    assert first["out"].num_cached_tokens == 0 and second["out"].num_cached_tokens > 0
    assert salted["out"].num_cached_tokens == 0
    assert first["ids"] == second["ids"] == salted["ids"]


def test_seeded_sampling_n_stop_and_logprobs(plain, ngram):
    ids = plain.tokenizer.encode(PROMPTS[0])
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=24, logprobs=3, ignore_eos=True)
    res = run(Engine(plain, EngineConfig()), [EngineRequest("s", ids, p)])
    ref = reference(plain, ids, p)
    for i in range(2):
        assert res[("s", i)]["ids"] == ref[i].token_ids
        got, want = res[("s", i)]["lps"], ref[i].logprobs
        assert [g["token_id"] for g in got] == [w["token_id"] for w in want]
        assert [t for t, _ in got[0]["top"]] == [t for t, _ in want[0]["top"]]
        assert max(abs(g["logprob"] - w["logprob"]) for g, w in zip(got, want)) < 1e-3
    # stop strings cut the text exactly where the single-request decoder does, drafts or not
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = reference(plain, ids, greedy)[0].text
    stop = full[10:14]
    ps = SamplingParams(temperature=0, max_tokens=40, stop=(stop,), ignore_eos=True)
    out = run(Engine(ngram, EngineConfig()), [EngineRequest("t", ids, ps)])[("t", 0)]
    assert out["text"] == reference(plain, ids, ps)[0].text == full[:full.index(stop)]
    assert out["out"].finish_reason == "stop" and out["out"].stop_reason == stop


def test_greedy_logprobs_with_speculation_equal_plain_ones(plain, ngram):
    ids = ngram.tokenizer.encode(PROMPTS[5])
    p = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
    got = run(memory_bound(Engine(ngram, EngineConfig())), [EngineRequest("lp", ids, p)])[("lp", 0)]
    want = reference(plain, ids, p)[0].logprobs
    assert got["out"].metrics.num_accepted_tokens > 0  # some logprobs came from verified drafts
    assert [g["token_id"] for g in got["lps"]] == [w["token_id"] for w in want]
    for g, w in zip(got["lps"], want):
        assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(g["top"], w["top"])) < 1e-3


def test_per_request_speculation_off_and_abort(ngram):
    eng = memory_bound(Engine(ngram, EngineConfig(block_size=8)))
    ids = ngram.tokenizer.encode(PROMPTS[1])
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    res = run(eng, [EngineRequest("off", ids, p, speculative={"method": None}), EngineRequest("on", ids, p)])
    assert res[("off", 0)]["out"].metrics.num_drafts == 0 and res[("off", 0)]["out"].method is None
    assert res[("on", 0)]["out"].metrics.num_drafts > 0
    assert res[("off", 0)]["ids"] == res[("on", 0)]["ids"]
    for i in range(3):
        eng.add_request(EngineRequest(f"x{i}", ids, SamplingParams(temperature=0, max_tokens=100)))
    eng.step(), eng.step()
    assert eng.blocks.num_used > 0
    for i in range(3):
        outs = eng.abort(f"x{i}")
        assert outs and outs[0].finish_reason == "abort"
    assert eng.blocks.num_used == 0 and not eng.has_unfinished()


@pytest.mark.skipif(not available(), reason="outlines-core is not installed")
def test_structured_output_with_speculation_is_valid_and_exact(plain, ngram):
    gc = GrammarCompiler(ngram.tokenizer, ngram.model.config.vocab_size)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    regex = {"type": "regex", "regex": r"(yes|no)( (yes|no)){2,5}\."}
    p = SamplingParams(temperature=0, max_tokens=60)
    outs = {}
    for name, llm in (("plain", plain), ("spec", ngram)):
        eng = Engine(llm, EngineConfig())
        reqs = [EngineRequest("json", llm.tokenizer.encode(PROMPTS[0]), p, grammar=gc.compile(fmt)),
                EngineRequest("re", llm.tokenizer.encode(PROMPTS[2]), p, grammar=gc.compile(regex))]
        outs[name] = run(eng, reqs)
    for name in outs:
        obj = json.loads(outs[name][("json", 0)]["text"])
        assert set(obj) == {"ok", "color"} and isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")
        assert re.fullmatch(r"(yes|no)( (yes|no)){2,5}\.", outs[name][("re", 0)]["text"])
        assert outs[name][("json", 0)]["out"].finish_reason == "stop"
    assert outs["plain"][("json", 0)]["ids"] == outs["spec"][("json", 0)]["ids"]
    assert outs["plain"][("re", 0)]["ids"] == outs["spec"][("re", 0)]["ids"]


@pytest.mark.skipif(not available(), reason="outlines-core is not installed")
def test_grammar_warm_up_compiles_json_object_in_the_background(plain):
    """The server warms json_object's grammar at start (its first compile took ~5 s on the real vocabulary),
    on a thread at the lowest CPU priority (nice 19, so that it takes no core from the engine's kernels);
    a request then gets the compiled one. A regex too large to compile is refused before compiling."""
    import os
    import threading
    from specdec.config import ConfigError
    gc = GrammarCompiler(plain.tokenizer, plain.model.config.vocab_size)
    gc.warm_up()
    warming = [t for t in threading.enumerate() if t.name == "grammar-warm-up"]
    assert warming
    niceness = []
    while warming[0].is_alive() and not niceness:  # (the thread lowers its own priority as it starts)
        try:
            nice = os.getpriority(os.PRIO_PROCESS, warming[0].native_id)
        except OSError:  # it ended meanwhile
            break
        if nice == 19:
            niceness.append(nice)
    for t in warming:
        t.join(120)
    assert niceness == [19] or os.name != "posix"
    warmed = gc._cached(gc.regex_for({"type": "json_object"}))
    assert warmed is not None and gc.compile({"type": "json_object"}) is warmed
    with pytest.raises(ConfigError, match="too large"):
        gc.compile({"type": "regex", "regex": "(a|b)*c{20000}"})


@pytest.mark.skipif(not available(), reason="outlines-core is not installed")
def test_requests_waiting_to_compile_are_bounded(plain):
    """Compiles run one at a time; while one runs, at most MAX_WAITING_COMPILES requests wait for it
    (each holds an executor thread) and the next is told to retry (the server's 429), not queued."""
    import threading
    import time
    gc = GrammarCompiler(plain.tokenizer, plain.model.config.vocab_size)
    errors = []

    def compile_one(i):
        try:
            gc.compile({"type": "regex", "regex": f"(yes|no){{{i + 1}}}"})
        except CompilerBusy as e:
            errors.append(e)

    with gc._compiling:  # a compile in progress
        waiting = [threading.Thread(target=compile_one, args=(i,)) for i in range(MAX_WAITING_COMPILES)]
        for t in waiting:
            t.start()
        while gc._waiting < MAX_WAITING_COMPILES:
            time.sleep(0.01)
        with pytest.raises(CompilerBusy):
            gc.compile({"type": "regex", "regex": "maybe"})
    for t in waiting:
        t.join(60)
    assert not errors and gc._waiting == 0 and gc.compile({"type": "regex", "regex": "(yes|no){1}"}) is not None


def test_request_methods_are_built_with_the_engine_and_others_refused(plain):
    """A request picks among the methods built at start (EngineConfig.request_methods): resolving one
    builds nothing and never waits for a step in progress (building a method on the request path held the
    engine's passes for its layer search or model load, a stall of every stream); another valid method is a
    ConfigError that names the enabled ones, and it is not built."""
    import threading

    from specdec.config import ConfigError
    eng = Engine(plain, EngineConfig(request_methods=("ngram",)))
    ngram = eng.spec.proposers["ngram"]  # built at start
    resolved = threading.Event()
    with eng.passes:  # a step in progress on this thread
        t = threading.Thread(target=lambda: eng.resolve_spec({"method": "ngram"}) and resolved.set())
        t.start()
        t.join(5)
        assert resolved.is_set()
    assert eng.resolve_spec({"method": "ngram", "num_speculative_tokens": 2}).proposer is ngram
    assert eng.resolve_spec({"method": None}).proposer is None
    with pytest.raises(ConfigError, match="'suffix' is not enabled on this server.*off, ngram"):
        eng.resolve_spec({"method": "suffix"})
    with pytest.raises(ConfigError, match="not enabled"):
        eng.add_request(EngineRequest("r", [5, 6], SamplingParams(max_tokens=2), speculative={"method": "qdraft"}))
    assert set(eng.spec.proposers) == {"ngram"} and not eng.has_unfinished()
    with pytest.raises(ConfigError, match="no speculative method of its own"):  # k alone: the default's method
        eng.resolve_spec({"num_speculative_tokens": 2})
    assert eng.resolve_spec({}).proposer is None  # nothing asked: the server's default (here none)
    assert set(Engine(plain, EngineConfig(request_methods=())).spec.proposers) == set()
    for bad in ("ngram", ("nope",), ("ngram+suffix",), None, (1,)):
        with pytest.raises(ConfigError):
            EngineConfig(request_methods=bad)
    assert EngineConfig(request_methods=("ngram+", "suffix", "ngram")).request_methods == ("ngram", "suffix")
    with pytest.raises(ConfigError, match="request method 'draft_model' .--request-speculative-methods.: .*model"):
        Engine(plain, EngineConfig(request_methods=("draft_model",)))  # no draft model to build it from


def test_too_long_prompt_is_refused(plain):
    eng = Engine(plain, EngineConfig())
    with pytest.raises(ValueError):
        eng.add_request(EngineRequest("long", [5] * 200, SamplingParams()))
    assert torch.get_num_threads() >= 1


@pytest.fixture(scope="module")
def qdraft(plain):
    return LLM(str(plain.source.directory), dtype="float32", max_model_len=160, progress=False, num_threads=1,
               speculative_config={"method": "qdraft"})


def test_qdraft_in_the_engine_reads_the_target_blocks(plain, qdraft):
    """One request at a time too, the quantized self-draft keeps no cache of its own: it reads the
    target's keys/values in the sequence's blocks (no int4 prefill of the prompt: every drafter forward
    takes one token) and writes its drafts where the verify pass writes next; output stays exact."""
    engine = Engine(qdraft, EngineConfig(max_num_seqs=1, max_num_batched_tokens=16, block_size=8))
    drafter = engine.spec.proposer("qdraft")
    shapes = []
    real = drafter.model.forward
    drafter.model.forward = lambda ids, *a, **kw: shapes.append(tuple(ids.shape)) or real(ids, *a, **kw)
    drafter.model.new_cache = lambda *a, **kw: pytest.fail("the engine's drafter made a cache of its own")
    reqs = greedy_reqs(qdraft, max_tokens=24)[:3]
    for r in reqs:
        r.speculative = {"method": "qdraft", "num_speculative_tokens": 3}
    res = run(engine, reqs)
    for r in reqs:
        assert res[(r.request_id, 0)]["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids
    assert shapes and set(shapes) == {(1, 1)}


def test_qdraft_drafts_the_decode_batch_in_one_forward_per_step(plain, qdraft):
    """Rows of a decode batch draft together: every drafter forward of a 4-row batch takes several
    rows of one token each (drafting straight in the sequences' blocks), outputs equal plain decoding,
    and sampling rows return their draft distributions q."""
    engine = Engine(qdraft, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8))
    drafter = engine.spec.proposer("qdraft")
    shapes = []
    real = drafter.model.forward
    drafter.model.forward = lambda ids, *a, **kw: shapes.append(tuple(ids.shape)) or real(ids, *a, **kw)
    reqs = greedy_reqs(qdraft, max_tokens=24)[:4]
    sampled = EngineRequest("s", reqs[0].prompt_ids, SamplingParams(temperature=0.8, max_tokens=24, seed=3,
                                                                     ignore_eos=True))
    for r in reqs + [sampled]:
        r.speculative = {"method": "qdraft", "num_speculative_tokens": 3}
    res = run(engine, reqs + [sampled])
    for r in reqs:
        assert res[(r.request_id, 0)]["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids
    assert len(res[("s", 0)]["ids"]) == 24
    assert max(b for b, _ in shapes) >= 3 and all(t == 1 for _, t in shapes)
