"""Penalties, logit bias and min_tokens (specdec/penalties.py): each verify row is penalized after the output plus
the drafts before it, so speculative output with penalties equals plain decoding with them (greedy,
every drafter, chains and trees), sampled marginals equal the exact penalized ones, plain decoding
equals transformers' repetition penalty and an independent OpenAI-formula processor; negative
controls show the tests catch rows that ignore their drafts."""
import math
from dataclasses import replace

import pytest
import torch

from specdec import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.model.loader import load_model
from specdec.model.tokenizer import Tokenizer
from specdec.penalties import apply_penalties, row_prefixes
from specdec.spec.decoder import SpeculativeDecoder
from specdec.spec.proposer import ProposerContext

from conftest import CHAT_PROMPTS
from test_equivalence import FixedQProposer, sampled_marginals, within_tv_bound

REPEAT = "one two three four five six. one two three four five six. one two three"
VARIED = "The quick brown fox"
PENALTIES = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5),
             dict(frequency_penalty=-0.6, logit_bias={5: 2.0, 17: -3.0})]


def reference_row(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, token by token: OpenAI's bias and frequency/presence formula, HF/vLLM's repetition penalty."""
    x = logits.float().clone()
    for tok, bias in params.logit_bias:
        x[tok] += bias
    for tok in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            x[tok] = x[tok] / params.repetition_penalty if x[tok] > 0 else x[tok] * params.repetition_penalty
    for tok in set(output):
        x[tok] -= params.frequency_penalty * output.count(tok) + params.presence_penalty
    return x


# ------------------------------------------------------------------------------------------------ unit

def test_row_prefixes_chain_and_tree():
    assert row_prefixes([7, 8, 9]) == [[], [7], [7, 8], [7, 8, 9]]
    # two children of the last token (nodes 0, 1), two of node 0 (2, 3), one of node 2 (4)
    assert row_prefixes([1, 2, 3, 4, 5], [-1, -1, 0, 0, 2]) == [[], [1], [2], [1, 3], [1, 4], [1, 3, 5]]


@pytest.mark.parametrize("penalty", PENALTIES + [dict(repetition_penalty=0.7, presence_penalty=-1.0)])
@pytest.mark.parametrize("parents", [None, [-1, -1, 0, 0, 2]])
def test_each_row_sees_the_output_plus_its_drafts(penalty, parents):
    g = torch.Generator().manual_seed(0)
    V, prompt, output = 40, [3, 5, 5, 9], [5, 11, 11, 2]
    drafts = [11, 5, 11, 30, 11]
    params = SamplingParams(temperature=0, **penalty)
    prefixes = row_prefixes(drafts, parents)
    logits = torch.randn(len(prefixes), V, generator=g) * 3
    got = apply_penalties(logits, params, prompt, output, drafts, parents)
    want = torch.stack([reference_row(logits[i], params, prompt, output + p) for i, p in enumerate(prefixes)])
    assert torch.allclose(got, want, atol=1e-6)
    # negative control: rows that ignore their drafts are not what the test accepts
    blind = torch.stack([reference_row(logits[i], params, prompt, output) for i in range(len(prefixes))])
    assert not torch.allclose(got, blind, atol=1e-6)


def test_no_penalty_returns_the_logits_themselves():
    logits = torch.randn(3, 10)
    assert apply_penalties(logits, SamplingParams(temperature=0), [1], [2, 3], [4, 5]) is logits


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                dict(repetition_penalty=2.5), dict(frequency_penalty=math.nan),
                                dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101}), dict(logit_bias={3: "x"}),
                                dict(logit_bias={i: 1.0 for i in range(1025)}), dict(allowed_token_ids=[]),
                                dict(allowed_token_ids=[-1])])
def test_bad_penalties_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_logit_bias_is_normalized_and_hashable():
    p = SamplingParams(logit_bias={9: 1, 2: -0.5})
    assert p.logit_bias == ((2, -0.5), (9, 1.0)) and p.adjusts_logits and hash(p) == hash(SamplingParams(logit_bias={2: -0.5, 9: 1}))
    assert not SamplingParams().adjusts_logits


# ----------------------------------------------------------------------------------------- tiny models

def llm(path, spec=None):
    return LLM(str(path), speculative_config=spec, dtype="float32", progress=False)


def greedy(max_tokens=48, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "layerskip", "lookahead", "recycle", "qdraft"])
@pytest.mark.parametrize("k", [3, None])
def test_greedy_with_penalties_equals_plain_tiny(tiny_dir, method, k):
    d = tiny_dir("llama")
    spec_cfg = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec_cfg["model"] = str(d)  # draft == target: long accepted blocks, each row's counts matter
    plain, spec = llm(d), llm(d, spec_cfg)
    accepted = 0
    for penalty in PENALTIES:
        for prompt in (REPEAT, VARIED):
            ids = plain.tokenizer.encode(prompt)
            a = plain.generate_one(ids, greedy(**penalty))
            b = spec.generate_one(ids, greedy(**penalty))
            assert b.token_ids == a.token_ids, (penalty, prompt)
            accepted += b.metrics.num_accepted_tokens
    if k is not None:
        assert accepted > 0  # blocks were accepted under penalties, not only rejected


def test_rows_blind_to_their_drafts_break_equivalence(tiny_dir, monkeypatch):
    """Negative control: a verifier that penalizes every row as if no draft preceded it (the bug
    this module prevents) no longer reproduces plain decoding."""
    import specdec.penalties as penalties
    d = tiny_dir("llama")
    plain, spec = llm(d), llm(d, {"method": "draft_model", "model": str(d), "num_speculative_tokens": 4})
    ids = plain.tokenizer.encode(REPEAT)
    params = greedy(frequency_penalty=2.0, presence_penalty=2.0)
    want = plain.generate_one(ids, params).token_ids
    assert spec.generate_one(ids, params).token_ids == want
    monkeypatch.setattr(penalties, "row_prefixes", lambda tokens, parents=None: [[] for _ in range(len(tokens) + 1)])
    assert spec.generate_one(ids, params).token_ids != want


def test_min_tokens_masks_stops_on_rows_short_of_it():
    logits = torch.zeros(4, 10)
    params = SamplingParams(temperature=0, min_tokens=5, max_tokens=9, stop_token_ids=(3,))
    out = apply_penalties(logits, params, [1, 2], [4, 4, 4], [6, 7, 8], eos_ids={0})
    # rows 0 and 1 follow 3 and 4 output tokens (< 5): EOS 0 and stop id 3 masked; rows 2, 3 follow 5, 6
    assert torch.isinf(out[:2, [0, 3]]).all() and torch.isfinite(out[2:]).all()
    assert torch.isfinite(out[:2, [1, 2, 4, 5]]).all()
    ignoring = apply_penalties(logits[:1], replace(params, ignore_eos=True), [1], [4, 4, 4], eos_ids={0})
    assert torch.isfinite(ignoring[0, 0]) and torch.isinf(ignoring[0, 3])  # EOS is no stop then
    assert apply_penalties(logits, params, [1], [4] * 5, [6, 7, 8], eos_ids={0}) is logits


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_min_tokens_with_eos_inside_accepted_blocks_equals_plain(tiny_dir, method):
    """EOS is made a token the model emits early; min_tokens past it: plain decoding goes on (and stops
    at a later EOS or max_tokens), and speculation, whose accepted blocks span that EOS, does the same."""
    d = tiny_dir("llama")
    cfg = {"method": method, "num_speculative_tokens": 4, **({"model": str(d)} if method == "draft_model" else {})}
    plain, spec = llm(d), llm(d, cfg)
    ids = plain.tokenizer.encode(REPEAT)
    ref = plain.generate_one(ids, greedy(40)).token_ids
    first = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    for x in (plain, spec):
        x.tokenizer.eos_token_ids = frozenset({ref[first]})
    params = SamplingParams(temperature=0, max_tokens=40)
    assert plain.generate_one(ids, params).token_ids == ref[:first + 1]  # the control: EOS stops it there
    want = plain.generate_one(ids, replace(params, min_tokens=first + 6))
    got = spec.generate_one(ids, replace(params, min_tokens=first + 6))
    assert got.token_ids == want.token_ids and len(want.token_ids) >= first + 6
    assert ref[first] not in want.token_ids[:first + 6]
    assert got.metrics.num_accepted_tokens > 0


def test_min_tokens_defers_stop_strings(tiny_dir):
    d = tiny_dir("llama")
    spec = llm(d, {"method": "ngram", "num_speculative_tokens": 4})
    ids = spec.tokenizer.encode(REPEAT)
    full = spec.generate_one(ids, greedy(30))
    stop = full.text[len(spec.tokenizer.decode(full.token_ids[:2])):][:3]  # text that appears early
    assert stop and spec.generate_one(ids, greedy(30, stop=(stop,))).finish_reason == "stop"
    late = spec.generate_one(ids, greedy(30, stop=(stop,), min_tokens=30))
    assert late.token_ids == full.token_ids and late.finish_reason == "length"


@pytest.mark.parametrize("method", ["ngram", "draft_model", "qdraft"])
def test_allowed_token_ids_with_speculation_equal_plain(tiny_dir, method):
    """allowed_token_ids (vLLM): only those are ever emitted, and speculation (whose lookups draft other
    tokens too) gives plain decoding's output; with a frequency penalty the allowed tokens rotate."""
    d = tiny_dir("llama")
    cfg = {"method": method, "num_speculative_tokens": 4, **({"model": str(d)} if method == "draft_model" else {})}
    plain, spec = llm(d), llm(d, cfg)
    ids = plain.tokenizer.encode(REPEAT)
    allowed = sorted(set(ids))[:5]
    for extra in ({}, {"frequency_penalty": 1.5}):
        params = greedy(32, allowed_token_ids=allowed, **extra)
        want = plain.generate_one(ids, params).token_ids
        assert set(want) <= set(allowed) and want == spec.generate_one(ids, params).token_ids
    assert plain.generate_one(ids, greedy(32)).token_ids != want  # the control: unrestricted differs
    with pytest.raises(ValueError, match="allowed_token_ids"):
        plain.generate_one(ids, greedy(4, allowed_token_ids=[10**7]))


def test_logit_bias_forces_and_forbids_tokens(tiny_dir):
    d = tiny_dir("llama")
    spec = llm(d, {"method": "ngram", "num_speculative_tokens": 4})
    ids = spec.tokenizer.encode(VARIED)
    assert spec.generate_one(ids, greedy(12, logit_bias={123: 100})).token_ids == [123] * 12
    free = spec.generate_one(ids, greedy(12)).token_ids
    banned = spec.generate_one(ids, greedy(12, logit_bias={free[0]: -100})).token_ids
    assert banned[0] != free[0] and free[0] not in banned
    with pytest.raises(ValueError, match="outside the vocabulary"):
        spec.generate_one(ids, greedy(4, logit_bias={10**6: 1.0}))


def exact_penalized_marginals(model, ids: list[int], params: SamplingParams) -> list[torch.Tensor]:
    """The exact distributions of the first three tokens, each step penalized after the output so far."""
    from specdec.sampler import warp

    def dist(out):
        c = model.new_cache(len(ids) + len(out) + 1)
        seq = ids + out
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], c).logits[0, -1:]
        return warp(apply_penalties(logits, params, ids, out), params)[0]

    p1 = dist([])
    p2 = sum(float(p1[y]) * dist([y]) for y in p1.nonzero().flatten().tolist())
    p3 = sum(float(p1[y]) * float(dist([y])[z]) * dist([y, z])
             for y in p1.nonzero().flatten().tolist() for z in dist([y]).nonzero().flatten().tolist())
    return [p1, p2, p3]


def test_sampled_marginals_with_penalties_match_the_exact_ones(tiny_dir):
    """temperature 1, top_k 4, strong frequency/presence penalties; a fixed q drafts 2 tokens, so the
    second and third tokens come from verify rows whose counts include drafts."""
    d = tiny_dir("llama", seed=3)
    model, tok = load_model(d), Tokenizer(d)
    ids = tok.encode("Once upon a time")
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.0)
    exact = exact_penalized_marginals(model, ids, SamplingParams(**params))
    q = torch.zeros(model.config.vocab_size)
    q[torch.cat([exact[0].topk(4).indices, exact[1].topk(6).indices])] = 1.0
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False)
    dec = SpeculativeDecoder(model, tok, FixedQProposer(ProposerContext(model, tok, cfg), q / q.sum()), cfg)
    n = 2500
    freqs, drafted = sampled_marginals(dec, ids, n, params)
    assert drafted >= n
    assert all(within_tv_bound(f, p, n) for f, p in zip(freqs, exact))
    # negative control: the unpenalized marginals are rejected by the same bound
    plain = exact_penalized_marginals(model, ids, SamplingParams(temperature=1.0, top_k=4, max_tokens=3))
    assert not all(within_tv_bound(f, p, n) for f, p in zip(freqs, plain))


# ------------------------------------------------------------------------------------- the real model

@pytest.mark.slow
def test_repetition_penalty_equals_transformers(smollm_dir, smollm_llm):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    tok = smollm_llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[1]}]))
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, repetition_penalty=1.3,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    ours = smollm_llm.generate({"prompt_token_ids": ids}, greedy(48, repetition_penalty=1.3))[0]
    assert ours.outputs[0].token_ids == hf
    assert hf != smollm_llm.generate({"prompt_token_ids": ids}, greedy(48))[0].outputs[0].token_ids


@pytest.mark.slow
def test_openai_penalties_equal_an_independent_processor(smollm_dir, smollm_llm):
    """frequency/presence penalties and a bias against transformers' generate with a logits processor
    written from OpenAI's formula."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    ref = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    tok = smollm_llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[2]}]))
    params = greedy(48, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={13: -2.0, 28: 1.5})

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for t, b in params.logit_bias:
                scores[0, t] += b
            out = input_ids[0, len(ids):].tolist()
            for t in set(out):
                scores[0, t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
            return scores

    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0,
                          logits_processor=LogitsProcessorList([OpenAIPenalties()]))[0, len(ids):].tolist()
    assert smollm_llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == hf


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"method": "ngram"}, {"method": "qdraft", "lookup": "ngram"},
                                  {"method": "eagle3"}])
def test_speculation_with_penalties_equals_plain_real_model(smollm_llm, spec):
    other = LLM("smollm2-135m", dtype="float32", progress=False, speculative_config=spec)
    tok = smollm_llm.tokenizer
    params = greedy(64, repetition_penalty=1.2, frequency_penalty=0.3)
    drafted = 0
    for p in CHAT_PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
        want = smollm_llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        got = other.generate_one(ids, params)
        assert got.token_ids == want
        drafted += got.metrics.num_draft_tokens
    assert drafted > 0


def test_random_combinations_equal_plain(tiny_dir):
    """Differential fuzzing: random penalties, bias, allowed tokens, min_tokens, stop strings and max_tokens,
    six drafters, fixed and adaptive k: speculative greedy output equals plain decoding's (seeded, 48 cases)."""
    import random

    rng = random.Random(29)
    d = tiny_dir("llama")
    plain = llm(d)
    spec = {m: llm(d, {"method": m, "num_speculative_tokens": k, **({"model": str(d)} if m == "draft_model" else {})})
            for m, k in (("ngram", 3), ("suffix", 5), ("draft_model", 4), ("lookahead", 3), ("recycle", 2),
                         ("qdraft", None))}
    words = ["one", "two", "three", "robot", "river", "sky"]
    for case in range(48):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        ids = plain.tokenizer.encode(prompt)
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, min_tokens=rng.randint(0, max_tokens),
            repetition_penalty=rng.choice([1.0, 0.8, 1.15, 1.6]), frequency_penalty=rng.choice([0.0, -0.5, 0.7, 2.0]),
            presence_penalty=rng.choice([0.0, 0.4, -1.0]), stop=tuple(rng.sample(words, rng.randint(0, 2))),
            logit_bias={rng.randrange(200): rng.uniform(-5, 5) for _ in range(rng.randint(0, 3))},
            allowed_token_ids=rng.choice([None, None, sorted(set(ids)) + rng.sample(range(500), 20)]))
        want = plain.generate_one(ids, params)
        got = spec[rng.choice(sorted(spec))].generate_one(ids, params)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), (case, params)


def test_allowed_tokens_that_all_end_the_output_are_refused_under_min_tokens():
    """allowed_token_ids all stop tokens (or EOS) with min_tokens > 0: min_tokens masks every allowed
    token, so nothing could be sampled (it raised mid-decoding, failing the server's whole batch)."""
    from specdec.penalties import check_token_ids

    for params in (SamplingParams(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=1),
                   SamplingParams(allowed_token_ids=[2, 5], stop_token_ids=[5], min_tokens=1)):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            check_token_ids(params, 100, eos_ids={2})
    check_token_ids(SamplingParams(allowed_token_ids=[2, 5], stop_token_ids=[5], min_tokens=1, ignore_eos=True),
                    100, {2})  # EOS is not masked under ignore_eos
    check_token_ids(SamplingParams(allowed_token_ids=[5], stop_token_ids=[5]), 100, {2})  # no min_tokens: fine
    with pytest.raises(ValueError, match="stop_token_ids"):
        check_token_ids(SamplingParams(stop_token_ids=[100]), 100)


def test_a_stop_string_from_before_min_tokens_does_not_stop_later():
    """A stop string produced while min_tokens held the checks off does not match on a later token: that
    stopped the request and cut back text it had already streamed (as vLLM, a match must end in the new
    text). Control: the same string produced after min_tokens stops it."""
    from specdec.spec.decoder import _Output
    from specdec.spec.proposer import RequestState

    class Chars:  # one character a token
        def add(self, toks):
            return "".join(chr(t) for t in toks)

    def run(min_tokens, text):
        streamed = []
        out = _Output(SamplingParams(temperature=0, stop=("ab",), min_tokens=min_tokens, max_tokens=9), frozenset(),
                      Chars(), lambda delta, toks: streamed.append(delta), 100)
        out.emit(RequestState([1], out.params, None), [ord(c) for c in text], None)
        return out.text, "".join(streamed), out.finish_reason

    assert run(3, "xabcd") == ("xabcd", "xabcd", None)
    assert run(0, "xabcd")[::2] == ("x", "stop")
    assert run(3, "xabcab") == ("xabc", "xabca", "stop")  # (offline streams are not held back: "a" went out)
