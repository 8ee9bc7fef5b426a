"""A model drafter paired with a lookup (`lookup`: n-gram or suffix first, the model drafter when the
lookup has no match): greedy output equals plain decoding (single request and the engine's batch),
both parts draft, lookup steps do not move the model drafter's estimate, sampling through the pairing
keeps the target's distribution (with a negative control), the settings are checked."""
import pytest
import torch

from specdec import SamplingParams
from specdec.config import ConfigError, SpeculativeConfig, split_method
from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.proposers.hybrid import HybridProposer
from specdec.spec.proposer import EMPTY, Proposer, ProposerContext, RequestState, make_proposer

from conftest import CHAT_PROMPTS, drain_engine

PROMPTS = ["The quick brown fox", "one two three four five six. one two three four five six. one two"]


def greedy(n=48):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def llm(path, spec=None):
    return LLM(str(path), speculative_config=spec, dtype="float32", max_model_len=256, progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("llama")


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_greedy_equals_plain_and_both_parts_draft(tiny, lookup):
    plain = llm(tiny)
    spec = llm(tiny, {"method": "qdraft", "lookup": lookup, "num_speculative_tokens": 4})
    assert isinstance(spec.proposer, HybridProposer) and spec.proposer.name == f"qdraft+{lookup}"
    assert spec.proposer.acceptance_prior == 0.9 > spec.proposer.lookup.acceptance_prior  # the model drafter's
    model_calls = []
    real = spec.proposer.model.propose
    spec.proposer.model.propose = lambda state, k: model_calls.append(k) or real(state, k)
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        assert spec.generate_one(ids, greedy()).token_ids == plain.generate_one(ids, greedy()).token_ids
    assert spec.proposer.lookup_steps > 0 and model_calls  # the repetitive prompt matches, the other not


def test_lookup_steps_leave_the_model_drafters_estimate_alone(tiny, monkeypatch):
    """Adaptive k prices the model drafter's tokens by its own acceptance: a lookup's rejected chains
    must not lower it (a lookup with a low bar once switched qdraft off for a whole request); they go
    to the lookup's estimates, by match length."""
    spec = llm(tiny, {"method": "qdraft", "lookup": "ngram", "lookup_min_match": 1})
    ids = spec.tokenizer.encode(PROMPTS[1])
    spec.generate_one(ids, greedy(8))  # profiles the cost model
    # the int4 copy of a tiny model drafts almost for free and is almost always right, so on a quick
    # enough measurement adaptive k preferred it to every lookup (a CI run drafted no lookup chain):
    # priced at a second a token, it never pays, and the lookup's chains are what this test is about
    monkeypatch.setattr(HybridProposer, "draft_cost_per_token", property(lambda self: 1.0))
    # and the target priced as memory-bound (a pass of k + 1 tokens costs one token's), with no measured
    # step costs: a lookup's free chain pays whatever this machine's timings say
    from specdec.spec import adaptive
    cost = spec.decoder.cost
    cost.seconds = [None] + [cost.seconds[1]] * cost.max_tokens
    monkeypatch.setattr(adaptive.CostModel, "observe", lambda self, T, seconds: None)
    monkeypatch.setattr(adaptive.AdaptiveK, "observe_step", lambda self, *a, **kw: None)
    updates = []
    real = adaptive.AdaptiveK.update
    monkeypatch.setattr(adaptive.AdaptiveK, "update",
                        lambda self, n, a, match_len=0, **kw: updates.append(match_len) or real(self, n, a, match_len, **kw))
    before = spec.proposer.lookup_steps
    r = spec.generate_one(ids, greedy(32))
    lookup_steps = spec.proposer.lookup_steps - before
    assert lookup_steps > 0 and len(updates) == r.metrics.target_passes
    assert sum(m > 0 for m in updates) == lookup_steps  # the lookup's steps, keyed by their match


def test_a_missing_match_goes_to_the_model_drafter(tiny):
    cfg = SpeculativeConfig("qdraft", lookup="ngram", lookup_min_match=3)
    plain = llm(tiny)
    proposer = make_proposer(ProposerContext(plain.model, plain.tokenizer, cfg, None, torch.float32, 256))
    state = RequestState([1, 2, 3, 4, 5, 1, 2, 3], greedy(), None, [4])  # ... 1 2 3 4: matches [2 3 4]
    proposer.begin(state)
    p = proposer.propose(state, 3)
    assert p.lookup and p.tokens == [5, 1, 2]
    state2 = RequestState([1, 2, 3, 4, 5, 6, 7], greedy(), None, [8])  # no 3-token match: the int4 copy drafts
    proposer.begin(state2)
    p2 = proposer.propose(state2, 3)
    assert not p2.lookup and len(p2.tokens) == 3


def test_bad_settings_are_config_errors(tiny):
    with pytest.raises(ConfigError, match="lookup must be one of"):
        SpeculativeConfig("qdraft", lookup="medusa")
    with pytest.raises(ConfigError, match="is a lookup itself"):
        SpeculativeConfig("ngram", lookup="suffix")
    with pytest.raises(ConfigError, match="lookup_min_match"):
        SpeculativeConfig("qdraft", lookup="ngram", lookup_min_match=0)
    assert split_method("qdraft+ngram") == ("qdraft", "ngram") and split_method("eagle3") == ("eagle3", None)


def test_engine_batch_with_a_hybrid_equals_single_request(tiny):
    """The serving engine's batched path: lookup rows and model-drafted rows in one decode batch, and
    the per-request method name 'qdraft+ngram'."""
    plain = LLM(str(tiny), dtype="float32", max_model_len=160, progress=False, num_threads=1)
    spec = LLM(str(tiny), dtype="float32", max_model_len=160, progress=False, num_threads=1,
               speculative_config={"method": "qdraft", "lookup": "ngram"})
    engine = Engine(spec, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8))
    assert engine.spec.proposer("qdraft+ngram") is spec.proposer
    reqs = [EngineRequest(str(i), spec.tokenizer.encode(t), greedy(24)) for i, t in enumerate(PROMPTS * 2)]
    for r in reqs:
        r.speculative = {"method": "qdraft+ngram", "num_speculative_tokens": 3}
        engine.add_request(r)
    got, drafted = drain_engine(engine)
    for r in reqs:
        assert got[r.request_id] == plain.generate_one(r.prompt_ids, r.params).token_ids, r.request_id
    assert drafted > 0 and spec.proposer.lookup_steps > 0


@pytest.mark.slow
def test_real_model_greedy_equal(smollm_llm):
    """qdraft + n-gram on the default model: 64 tokens on two chat prompts equal plain decoding."""
    target, tok = smollm_llm.model, smollm_llm.tokenizer
    cfg = SpeculativeConfig("qdraft", lookup="ngram")
    from specdec.spec.decoder import SpeculativeDecoder
    proposer = make_proposer(ProposerContext(target, tok, cfg, None, torch.float32, target.max_len))
    spec = SpeculativeDecoder(target, tok, proposer, cfg)
    for text in CHAT_PROMPTS[:2]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        params = SamplingParams(temperature=0, max_tokens=64)
        assert spec.generate(ids, params).token_ids == smollm_llm.generate_one(ids, params).token_ids


def test_the_lookup_drafts_while_adaptive_k_keeps_the_model_drafter_off(tiny, monkeypatch):
    """Where the model drafter does not pay (its best k is 0 on every step here), the free lookup still
    drafts, and output stays exact; where a verify column costs as much as a plain step, neither does."""
    from specdec.spec import adaptive
    # per-step overheads held at zero: on this tiny model they are timing noise as large as a forward,
    # and a measured plain overhead above the spec one would make even a compute-bound verify pay
    monkeypatch.setattr(adaptive.StepOverhead, "observe", lambda self, drafted, seconds: None)
    plain, spec = llm(tiny), llm(tiny, {"method": "qdraft", "lookup": "ngram"})
    ids = plain.tokenizer.encode(PROMPTS[1])
    spec.generate_one(ids, greedy(4))  # profiles the cost model
    real_best = adaptive.AdaptiveK._best
    monkeypatch.setattr(adaptive.AdaptiveK, "_best", lambda self, rel, match_len, k_max:
                        (0, 1.0) if match_len == 0 else real_best(self, rel, match_len, k_max))
    monkeypatch.setattr(spec.decoder.cost, "relative", lambda T: 1.0)  # a verify column costs nothing
    model_calls = []
    monkeypatch.setattr(spec.proposer.model, "propose", lambda state, k: model_calls.append(k) or EMPTY)
    before = spec.proposer.lookup_steps
    r = spec.generate_one(ids, greedy(32))
    assert r.token_ids == plain.generate_one(ids, greedy(32)).token_ids
    assert spec.proposer.lookup_steps > before and r.metrics.num_accepted_tokens > 0
    assert set(model_calls) <= {1}  # at most probes of one token
    monkeypatch.setattr(spec.decoder.cost, "relative", lambda T: float(T))  # compute-bound: no free columns
    before = spec.proposer.lookup_steps
    spec.generate_one(ids, greedy(32))
    assert spec.proposer.lookup_steps == before


class ScriptedLookup(Proposer):
    """A lookup that matches (one token) after the first sampled token when it is in `after`, and then
    proposes `token`; otherwise it finds nothing and the model drafter drafts."""

    def __init__(self, ctx, after: set[int], token: int):
        super().__init__(ctx)
        self.after, self.token = after, token

    def propose(self, state, k):
        return EMPTY

    def lookup(self, state, k, min_match):
        return ([self.token], 1) if state.output_ids[-1] in self.after else ([], 0)


def test_sampling_through_the_pairing_keeps_the_target_distribution(tiny_dir, monkeypatch):
    """temperature 1, top_k 4, three tokens: the second is drafted by the lookup (verified as one-hot
    q) after half of the possible first tokens, by a model drafter sampling from a fixed q after the
    others; the third is the bonus or the next step's. Every token's marginal equals the exact one
    (total variation within a bound from the sample size); a verifier that accepts every draft fails
    the same check (negative control)."""
    from specdec.model.loader import load_model
    from specdec.model.tokenizer import Tokenizer
    from specdec.sampler import sample
    from specdec.spec import decoder as decoder_mod
    from specdec.spec.decoder import SpeculativeDecoder
    from specdec.spec.rejection import Verdict
    from test_equivalence import (SAMPLING, FixedQProposer, exact_marginals, sampled_marginals, skewed_q,
                                  within_tv_bound)

    d = tiny_dir("llama", seed=3)
    model, tok = load_model(d), Tokenizer(d)
    ids = tok.encode("Once upon a time")
    exact = exact_marginals(model, ids, SamplingParams(**SAMPLING))
    p1, p2, _ = exact
    cfg = SpeculativeConfig("qdraft", lookup="ngram", lookup_min_match=1, num_speculative_tokens=1, adaptive=False)
    ctx = ProposerContext(model, tok, cfg)
    first_tokens = p1.nonzero().flatten().tolist()
    proposer = HybridProposer(ctx, FixedQProposer(ctx, skewed_q(p1, p2)),
                              ScriptedLookup(ctx, set(first_tokens[::2]), int(p2.argmax())))
    dec = SpeculativeDecoder(model, tok, proposer, cfg)
    n = 2000
    freqs, drafted = sampled_marginals(dec, ids, n)
    assert drafted == n and 0.2 * n < proposer.lookup_steps < 0.8 * n  # both parts drafted
    assert all(within_tv_bound(f, p, n) for f, p in zip(freqs, exact))

    def accept_all(tokens, p, q, generator):
        return Verdict(len(tokens), list(tokens) + [sample(p[len(tokens)], generator)])
    monkeypatch.setattr(decoder_mod, "verify_sampling", accept_all)
    freqs, _ = sampled_marginals(dec, ids, n)
    assert not within_tv_bound(freqs[1], p2, n)
