"""The drafters of issue 4 (draft_model, layerskip, suffix, lookahead, recycle; ngram for comparison): greedy
output equals plain greedy decoding token for token (tiny random models and the real default model,
fixed k and adaptive k), draft == target accepts everything, EOS and max_tokens inside an accepted
block, seeded sampling is reproducible; plus unit tests of each drafter's own structure."""
import json
import shutil
from dataclasses import replace

import pytest
import torch

from specdec import SamplingParams
from specdec.config import ConfigError, SpeculativeConfig
from specdec.llm import LLM
from specdec.spec.decoder import SpeculativeDecoder

from conftest import CHAT_PROMPTS, substring_counts

REPEAT = "one two three four five six. one two three four five six. one two three"
VARIED = "The quick brown fox"
METHODS = ["draft_model", "ngram", "suffix", "layerskip", "lookahead", "recycle"]


def greedy(max_tokens=64, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def spec_config(method, draft_dir, **kw):
    cfg = {"method": method, **kw}
    if method == "draft_model":
        cfg["model"] = str(draft_dir)
    return cfg


def llm(path, spec=None, **kw):
    return LLM(str(path), speculative_config=spec, dtype="float32", progress=False, **kw)


def adaptive_decoder(spec_llm):
    """The same proposer with the adaptive default (num_speculative_tokens unset)."""
    cfg = replace(spec_llm.speculative_config, num_speculative_tokens=None)
    return SpeculativeDecoder(spec_llm.model, spec_llm.tokenizer, spec_llm.proposer, cfg)


def ids_of(llm_, prompt):
    return llm_.tokenizer.encode(prompt)


# ----------------------------------------------------------------------------------------- tiny models

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [2, 5, None])
def test_greedy_equals_plain_tiny(tiny_dir, method, k):
    d = tiny_dir("llama")
    plain = llm(d)
    spec = llm(d, spec_config(method, tiny_dir("llama", seed=1), num_speculative_tokens=k))
    accepted = 0
    for prompt in (REPEAT, VARIED):
        ids = ids_of(plain, prompt)
        a = plain.generate_one(ids, greedy(64))
        b = spec.generate_one(ids, greedy(64))
        assert b.token_ids == a.token_ids and b.text == a.text
        accepted += b.metrics.num_accepted_tokens
    if method != "draft_model" and k is not None:  # exercise accepted blocks, not only rejections
        assert accepted > 0


@pytest.mark.parametrize("method", ["draft_model", "layerskip", "suffix", "lookahead"])
def test_greedy_equals_plain_qwen3(tiny_dir, method):
    d = tiny_dir("qwen3")
    plain, spec = llm(d), llm(d, spec_config(method, d, num_speculative_tokens=3))
    ids = ids_of(plain, VARIED)
    assert spec.generate_one(ids, greedy(40)).token_ids == plain.generate_one(ids, greedy(40)).token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_equals_target_accepts_everything(tiny_dir, temperature):
    d = tiny_dir("llama")
    spec = llm(d, spec_config("draft_model", d, num_speculative_tokens=4))
    r = spec.generate_one(ids_of(spec, VARIED), SamplingParams(temperature=temperature, seed=7, max_tokens=48,
                                                               ignore_eos=True))
    assert r.metrics.num_draft_tokens >= 30
    # greedy: the draft's argmax is the target's, every token accepted; sampling: q == p accepts with
    # probability min(1, p/q) = 1 up to the rounding of two separately computed distributions
    assert r.metrics.acceptance_rate == 1.0 if temperature == 0 else r.metrics.acceptance_rate >= 0.98


@pytest.mark.parametrize("method", METHODS)
def test_eos_inside_accepted_block(tiny_dir, method):
    d = tiny_dir("llama")
    plain = llm(d)
    ids = ids_of(plain, REPEAT)
    ref = plain.generate_one(ids, greedy(40)).token_ids
    draft = d if method == "draft_model" else tiny_dir("llama", seed=1)
    spec = llm(d, spec_config(method, draft, num_speculative_tokens=4))
    # call a token first emitted at index >= 6 EOS (for both decoders)
    first = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    for x in (plain, spec):
        x.tokenizer.eos_token_ids = frozenset({ref[first]})
    want = plain.generate_one(ids, greedy(40, ignore_eos=False))
    got = spec.generate_one(ids, greedy(40, ignore_eos=False))
    assert got.token_ids == want.token_ids == ref[:first + 1]
    assert got.finish_reason == want.finish_reason == "stop"
    if method == "draft_model":  # draft == target: EOS arrives in the middle of an accepted block
        assert got.metrics.num_accepted_tokens >= first - 4


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7])
def test_max_tokens_inside_accepted_block(tiny_dir, max_tokens):
    d = tiny_dir("llama")
    plain, spec = llm(d), llm(d, spec_config("draft_model", d, num_speculative_tokens=4))
    ids = ids_of(plain, VARIED)
    ref = plain.generate_one(ids, greedy(16)).token_ids
    r = spec.generate_one(ids, greedy(max_tokens))
    assert r.token_ids == ref[:max_tokens] and r.finish_reason == "length"


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_reproducible(tiny_dir, method):
    """Same seed, same proposer state -> same output. (The random numbers drawn depend on the drafts,
    so a drafter with history, such as suffix's global cache, is compared from the same state.)"""
    d = tiny_dir("llama")
    cfg = spec_config(method, tiny_dir("llama", seed=1), num_speculative_tokens=3)
    first, second = llm(d, cfg), llm(d, cfg)
    ids = ids_of(first, REPEAT)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
    a = first.generate_one(ids, params).token_ids
    b = second.generate_one(ids, params).token_ids
    c = first.generate_one(ids, replace(params, seed=99)).token_ids
    assert a == b and a != c


# ------------------------------------------------------------------------------------------ draft model

def test_draft_model_vocab_mismatch_is_a_config_error(tiny_dir, tmp_path):
    d = tiny_dir("llama")
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_dir("llama", seed=1), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"  # same strings, two ids swapped: a different vocabulary all the same
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="different vocabulary"):
        llm(d, spec_config("draft_model", other))


def test_draft_model_with_padded_embedding(tiny_dir):
    """Same tokenizer, larger (padded) embedding in the draft: logits are cut to the target's vocab."""
    d = tiny_dir("llama")
    plain = llm(d)
    spec = llm(d, spec_config("draft_model", tiny_dir("llama", seed=1, vocab_size=49216), num_speculative_tokens=3))
    ids = ids_of(plain, VARIED)
    assert spec.generate_one(ids, greedy(32)).token_ids == plain.generate_one(ids, greedy(32)).token_ids
    r = spec.generate_one(ids, SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True))
    assert len(r.token_ids) == 16


def test_draft_layers_choice():
    from specdec.train.make_draft import draft_layers
    assert draft_layers(30, 8) == [0, 1, 2, 3, 4, 5, 6, 29]
    assert draft_layers(30, 8, "even") == [0, 4, 8, 12, 17, 21, 25, 29]
    assert draft_layers(4, 4) == draft_layers(4, 4, "even") == [0, 1, 2, 3]
    assert draft_layers(4, 1) == [3]
    with pytest.raises(ConfigError):
        draft_layers(4, 5)


def test_make_draft_cli_and_use(tiny_dir, tmp_path):
    from specdec.cli import main
    from specdec.model.loader import load_model
    d = tiny_dir("llama")
    out = tmp_path / "draft2"
    assert main(["make-draft", str(d), "--layers", "2", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    target, draft = load_model(d), load_model(out)
    assert torch.equal(draft.layers[0].qkv.weight, target.layers[0].qkv.weight)
    assert torch.equal(draft.layers[1].down.weight, target.layers[3].down.weight)  # first-last: [0, 3]
    assert main(["make-draft", str(d), "--layers", "2", "--out", str(out)]) == 2  # not empty: one-line error
    plain, spec = llm(d), llm(d, spec_config("draft_model", out, num_speculative_tokens=4))
    ids = ids_of(plain, REPEAT)
    assert spec.generate_one(ids, greedy(48)).token_ids == plain.generate_one(ids, greedy(48)).token_ids


def test_draft_confidence_threshold_stops_early(tiny_dir):
    d = tiny_dir("llama")
    plain = llm(d)
    spec = llm(d, spec_config("draft_model", d, num_speculative_tokens=6, draft_confidence_threshold=0.99))
    ids = ids_of(plain, VARIED)
    r = spec.generate_one(ids, greedy(32))
    assert r.token_ids == plain.generate_one(ids, greedy(32)).token_ids
    assert r.metrics.num_draft_tokens < 6 * r.metrics.num_drafts  # some drafts stopped before k


# ------------------------------------------------------------------------------------------- layerskip

def test_layerskip_search_and_validation(tiny_dir):
    from specdec.proposers import layer_skip
    d = tiny_dir("llama", seed=2)
    spec = llm(d, {"method": "layerskip", "num_speculative_tokens": 3})
    skip = spec.proposer.skip
    assert 1 <= len(skip) < 4 and all(0 <= i < 4 for i in skip)
    assert layer_skip.search_skip_layers(spec.model, spec.tokenizer) == skip  # deterministic
    again = llm(d, {"method": "layerskip"})
    assert again.proposer.skip == skip  # cached per model
    for bad in ([0, 1, 2, 3], [7]):
        with pytest.raises(ConfigError, match="skip_layers"):
            llm(d, {"method": "layerskip", "skip_layers": bad})


def test_layerskip_probe_matches_drafting(tiny_dir):
    """The search's probe pass gives exactly the draft's first-token prediction at every position."""
    from specdec.proposers.layer_skip import LayerProbe
    from specdec.model.loader import load_model
    model = load_model(tiny_dir("llama"))
    ids = list(range(100, 140))
    layers = [0, 2, 3]
    probe = LayerProbe(model, ids, scored=8)
    probe.agreement(layers)
    out = model(probe.ids, probe.positions, probe.cache, layers=layers)  # the same pass, kept for inspection
    probe.cache.rollback(probe.n)
    for j, pos in enumerate(range(len(ids) - 8, len(ids))):
        cache = model.new_cache(64)
        model(torch.tensor([ids[:pos]]), torch.arange(pos)[None], cache)
        step = model(torch.tensor([[ids[pos]]]), torch.tensor([[pos]]), cache, layers=layers)
        assert torch.allclose(step.logits[0, -1], out.logits[0, j], atol=1e-4)


def test_layerskip_leaves_target_cache_as_found(tiny_dir):
    d = tiny_dir("llama")
    spec = llm(d, {"method": "layerskip", "skip_layers": [1, 2], "num_speculative_tokens": 4})
    seen = []
    inner = spec.proposer.propose

    def spy(state, k):
        cache = state.draft["target_cache"]
        before = cache.length
        out = inner(state, k)
        seen.append((before, cache.length, len(state.token_ids)))
        return out

    spec.proposer.propose = spy
    spec.generate_one(ids_of(spec, VARIED), greedy(24))
    assert seen and all(b == a == n - 1 for b, a, n in seen)


# ---------------------------------------------------------------------------------------------- suffix

def _suffix_proposer(**cfg):
    from specdec.proposers.suffix import SuffixProposer
    from specdec.spec.proposer import ProposerContext, RequestState
    config = SpeculativeConfig(method="suffix", **cfg)
    return SuffixProposer(ProposerContext(None, None, config)), RequestState


def test_suffix_proposes_most_frequent_continuation_with_caps():
    prop, RS = _suffix_proposer(suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.3)
    # after [1 2 3], 4 followed twice and 9 once; the context ends in [1 2 3]
    st = RS([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 1, 2, 3], SamplingParams())
    prop.begin(st)
    assert prop.propose(st, 8).tokens == [4, 5, 1]  # match length 3 caps k at 3 (factor 1.0)
    prop2, _ = _suffix_proposer(suffix_decoding_max_spec_factor=4.0, suffix_decoding_min_token_prob=0.5)
    st2 = RS(list(st.prompt_ids), SamplingParams())
    prop2.begin(st2)
    assert prop2.propose(st2, 8).tokens == [4, 5, 1, 2, 3]  # path prob 2/3 > 0.5, then 2/3 * 1/2 < 0.5
    st2.output_ids.append(77)  # an unseen token: no match at all
    assert prop2.propose(st2, 8).tokens == []


def test_suffix_global_cache_is_bounded_lru():
    prop, RS = _suffix_proposer(suffix_decoding_max_cached_requests=2, suffix_decoding_max_spec_factor=4.0)
    for i, out in enumerate(([10, 11, 12, 13, 14], [20, 21, 22, 23], [30, 31, 32, 33])):
        st = RS([i], SamplingParams())
        prop.begin(st)
        st.output_ids.extend(out)
        prop.end(st)
    assert len(prop.cached) == 2
    st = RS([5, 20, 21], SamplingParams())  # request 2's output is cached: continue from it
    prop.begin(st)
    assert prop.propose(st, 4).tokens == [22, 23]
    st = RS([5, 10, 11], SamplingParams())  # request 1's output was evicted
    prop.begin(st)
    assert prop.propose(st, 4).tokens == []
    assert 10 not in prop.global_trie.root.children


def test_suffix_uses_earlier_requests_on_the_real_decoder(tiny_dir):
    d = tiny_dir("llama")
    spec = llm(d, {"method": "suffix", "num_speculative_tokens": 6})
    ids = ids_of(spec, VARIED)
    first = spec.generate_one(ids, greedy(40))
    second = spec.generate_one(ids, greedy(40))  # the same request again: its output is in the global cache
    assert second.token_ids == first.token_ids
    assert second.metrics.mean_acceptance_length > first.metrics.mean_acceptance_length
    assert second.metrics.acceptance_rate > 0.9


# ------------------------------------------------------------------------------------------- lookahead

def test_lookahead_pool():
    from specdec.proposers.lookahead import NgramPool
    pool = NgramPool(3, guess_set=2)
    pool.add_sequence([1, 2, 3, 1, 4, 5, 1, 6, 7])
    assert pool.candidate(1) == (6, 7)
    assert list(pool.table[1]) == [(4, 5), (6, 7)]  # G = 2: (2, 3) was dropped
    pool.add((1, 4, 5))
    assert pool.candidate(1) == (4, 5)
    assert pool.candidate(99) is None


def test_lookahead_harvests_jacobi_ngrams(tiny_dir):
    d = tiny_dir("llama")
    spec = llm(d, {"method": "lookahead", "num_speculative_tokens": 5, "lookahead_ngram": 3})
    pools = []
    end = spec.proposer.end

    def keep(state):
        pools.append(state.draft["pool"])
        end(state)

    spec.proposer.end = keep
    ids = ids_of(spec, VARIED)
    spec.generate_one(ids, greedy(48))
    context = ids + spec.generate_one(ids, greedy(48)).token_ids
    seen = substring_counts([context], 3)
    pooled = {(first, *rest) for first, entries in pools[-1].table.items() for rest in entries}
    assert pooled - set(seen)  # n-grams that come from the Jacobi window, not from the text


# ------------------------------------------------------------------------------------------ real model

@pytest.fixture(scope="module")
def real_refs(smollm_llm):
    tok = smollm_llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in CHAT_PROMPTS[1:]]
    return [(ids, smollm_llm.generate_one(ids, greedy(64, ignore_eos=False)).token_ids) for ids in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "suffix", "layerskip", "lookahead", "recycle"])
def test_greedy_equals_plain_real_model(real_refs, method):
    spec = LLM("smollm2-135m", dtype="float32", progress=False,
               speculative_config=spec_config(method, "smollm2-135m", num_speculative_tokens=4))
    for ids, ref in real_refs:
        r = spec.generate_one(ids, greedy(64, ignore_eos=False))
        assert r.token_ids == ref
        if method == "draft_model":  # draft == target
            assert r.metrics.acceptance_rate >= 0.98
    ids, ref = real_refs[0]
    assert adaptive_decoder(spec).generate(ids, greedy(64, ignore_eos=False)).token_ids == ref


@pytest.mark.parametrize("method, carried", [("draft_model", True), ("ngram", False)])
def test_model_drafters_start_from_the_previous_requests_estimates(tiny_dir, method, carried, monkeypatch):
    """A drafter with a per-token cost starts a request from the previous one's acceptance and probe
    wait; a lookup drafter (no cost: a miss is one verify column) starts each request fresh."""
    from specdec.spec import adaptive

    # per-step overheads held at zero: on this tiny model they are timing noise as large as a forward,
    # and a plain overhead measured above the spec one let a step at acceptance 0.01 "pay" (and reset
    # the probe wait this test checks) now and then
    monkeypatch.setattr(adaptive.StepOverhead, "observe", lambda self, drafted, seconds: None)
    d = tiny_dir("llama")
    spec = llm(d, spec_config(method, tiny_dir("llama", seed=1)))
    dec = adaptive_decoder(spec)
    dec.generate(ids_of(spec, VARIED), greedy(16))
    first = dec.last_adaptive
    first._accepted, first._tested, first.acceptance, first.probes.interval = 0.01, 1.0, 0.01, 128
    dec.generate(ids_of(spec, VARIED), greedy(16))
    second = dec.last_adaptive
    assert second is not first
    assert (second.probes.interval == 128) == carried
    assert (second.acceptance < 0.3) == carried


def test_speculation_off_the_cpu_says_it_is_not_batch_invariant():
    """Bitwise equality with plain decoding is a CPU-kernel property: on another device the proposer
    registry warns (a meta-device stand-in for CUDA), and on the CPU it does not."""
    import warnings
    from types import SimpleNamespace

    from specdec.spec.proposer import ProposerContext, make_proposer

    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    with pytest.warns(RuntimeWarning, match="not batch-invariant"):
        make_proposer(ProposerContext(SimpleNamespace(device=torch.device("meta")), None, cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_proposer(ProposerContext(SimpleNamespace(device=torch.device("cpu")), None, cfg))


@pytest.mark.parametrize("value,ok", [
    ({"num_speculative_tokens": 3}, True), ({"num_speculative_tokens": None}, True),
    ({"num_speculative_tokens": "3"}, False), ({"num_speculative_tokens": 3.0}, False),
    ({"num_speculative_tokens": True}, False), ({"adaptive": False}, True), ({"adaptive": 0}, False),
    ({"draft_confidence_threshold": 0}, True), ({"draft_confidence_threshold": "0.5"}, False),
    ({"method": "layerskip", "skip_layers": [1, 2]}, True), ({"method": "layerskip", "skip_layers": [1, "2"]}, False),
    ({"method": 3}, False), ({"model": 7}, False),
])
def test_speculative_config_values_have_their_types(value, ok):
    """A JSON config's value of the wrong type is a ConfigError naming the key (it was a TypeError from
    a comparison, a traceback in the CLI); ints are numbers, booleans are not."""
    d = {"method": "ngram", **value}
    if ok:
        assert SpeculativeConfig.from_dict(d).method == d["method"]
    else:
        with pytest.raises(ConfigError, match=f"'{list(value)[-1]}' must be"):
            SpeculativeConfig.from_dict(d)


def test_generate_takes_vllm_prompt_forms_and_refuses_others(tiny_dir):
    """LLM.generate's prompts as vLLM's: a string, token ids, {"prompt"} or {"prompt_token_ids"}, one or a
    list. Anything else is a ValueError saying what a prompt is, raised before any prompt is decoded (an int
    list of floats or {"prompt_token_ids": "abc"} were TypeErrors, or decoded the string)."""
    model = llm(tiny_dir("llama"))
    ids = model.tokenizer.encode("hello there")
    p = greedy(4)
    ref = model.generate(ids, p)[0].outputs[0].token_ids
    for form in ("hello there", {"prompt": "hello there"}, {"prompt_token_ids": ids}, [ids], [{"prompt_token_ids": ids}]):
        assert model.generate(form, p)[0].outputs[0].token_ids == ref, form
    calls = []
    model.decoder.generate = lambda *a, **k: calls.append(a)  # nothing may be decoded for a bad list
    for bad in (123, None, [1.5, 2.0], [True, False], [{"prompt_token_ids": "abc"}], [{"prompt": 5}],
                [{"prompt_token_ids": ids, "extra": 1}], ["fine", 5]):
        with pytest.raises(ValueError, match="a prompt"):
            model.generate(bad, p)
    assert calls == []


def test_generate_takes_params_per_prompt_and_checks_every_request_first(tiny_dir):
    """sampling_params may be a list, one a prompt (as vLLM's); a wrong count or type is a ValueError, and
    a bad prompt anywhere in the list (empty, too long) is refused before the first is decoded. chat takes
    one conversation or a list of them, and says so for anything else (a bare message was a KeyError)."""
    model = llm(tiny_dir("llama"))
    outs = model.generate(["hello there", "one two"], [greedy(3), greedy(5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    calls = []
    model.decoder.generate = lambda *a, **k: calls.append(a)
    for prompts, params, match in ((["a", "b"], [greedy(3)], "sampling_params"),
                                   (["a"], [{"max_tokens": 3}], "sampling_params"),
                                   (["fine", []], greedy(3), "a prompt|empty"),
                                   (["fine", [5] * 10_000], greedy(3), "context")):
        with pytest.raises(ValueError, match=match):
            model.generate(prompts, params)
    for bad in ({"role": "user", "content": "hi"}, [], "hi", [[{"role": "user", "content": "hi"}], "x"]):
        with pytest.raises(ValueError, match="messages"):
            model.chat(bad, greedy(3))
    assert calls == []


def test_layerskip_search_refuses_a_one_layer_target(tiny_dir):
    """With one layer there is nothing to skip: a clear error, not max() of an empty list."""
    from specdec.model.loader import load_model
    from specdec.model.tokenizer import Tokenizer
    from specdec.proposers import layer_skip

    d = tiny_dir("llama", num_hidden_layers=1)
    with pytest.raises(ConfigError, match="at least 2 layers"):
        layer_skip.search_skip_layers(load_model(d), Tokenizer(d))
