"""EAGLE heads in the serving engine (tiny model, random heads): prefix-cache hits, resting features, rows
drafting together as each would alone, fresh starts, kept prefixes, the catch-up's pricing; every output
equals plain greedy decoding."""
from __future__ import annotations

import pytest

from specdec.sampling_params import SamplingParams
from tests.heads import random_head


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from specdec.llm import LLM
    d = tiny_dir("llama")
    return d, LLM(str(d), dtype="float32", progress=False)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_serving_engine_with_a_prefix_cache_hit(tiny, tmp_path, kind):
    """In the serving engine a prompt whose first blocks are in the prefix cache is computed only from
    there on: the head gets features for that suffix alone and must place them at their positions (it
    raised a shape error in the server before). Every output equals plain decoding, blocks all freed."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.llm import LLM
    from tests.test_engine_batching import reference, run

    d, plain = tiny
    head = random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0)
    config = {"method": kind, "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    shared = plain.tokenizer.encode("A long shared system prompt: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16.")
    prompts = [shared + plain.tokenizer.encode(t) for t in (" First question?", " Second one, longer?")]
    engine = Engine(spec, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8))
    res = run(engine, [EngineRequest("a", prompts[0], params)])  # fills the prefix cache
    res.update(run(engine, [EngineRequest("b", prompts[1], params), EngineRequest("c", prompts[0], params)]))
    assert engine.stats().prefix_hits >= 2 * 2  # b and c each found the two shared blocks cached
    for rid, ids in (("a", prompts[0]), ("b", prompts[1]), ("c", prompts[0])):
        assert res[(rid, 0)]["ids"] == reference(plain, ids, params)[0].token_ids, rid
        assert res[(rid, 0)]["out"].metrics.num_drafts > 0


def test_engine_rests_the_heads_features_while_nothing_drafts(tiny, tmp_path, monkeypatch):
    """After REST_AFTER decode steps without drafts the engine's passes keep no EAGLE-3 features and the
    rows queue none; once drafting resumes the head restarts from the first rows it is given, at their
    true positions, and drafts again. Outputs stay plain decoding's, every block is freed."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.engine.speculation import REST_AFTER, Speculation
    from specdec.llm import LLM
    from specdec.proposers import eagle
    from tests.test_engine_batching import reference, run

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head)})
    engine = Engine(spec, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8))
    step, passes, commits, drafted_after = [0], [], [], []

    def held(self, seqs, caps, found=None):  # K = 2 on decode steps 1-3, 0 on 4-23, 2 from 24 on
        step[0] += 1
        k = 0 if 4 <= step[0] <= 23 else 2
        self.probes.should_probe(k > 0)
        return k

    run_pass, commit, propose_batch = engine.runner.run, eagle._EagleBase._commit, eagle._EagleBase.propose_batch

    def record_pass(rows, all_logits, output_layers=()):
        if all_logits:
            passes.append((step[0], tuple(output_layers)))
        return run_pass(rows, all_logits, output_layers=output_layers)

    def record_commit(self, work):
        commits.extend((step[0], st.draft["offset"], st.draft["len"], len(toks), len(st.token_ids))
                       for st, _, toks in work)
        commit(self, work)

    def record_drafts(self, states, ks, trees=False):
        out = propose_batch(self, states, ks, trees)
        drafted_after.extend(len(p.tokens) for p in out if step[0] >= 24)
        return out

    monkeypatch.setattr(Speculation, "choose_k", held)
    monkeypatch.setattr(eagle._EagleBase, "_commit", record_commit)
    monkeypatch.setattr(eagle._EagleBase, "propose_batch", record_drafts)
    engine.runner.run = record_pass
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [plain.tokenizer.encode(t) for t in ("Hello there, 1 2 3 4 5", "The cat sat on the mat, the cat")]
    res = run(engine, [EngineRequest(str(i), ids, params) for i, ids in enumerate(prompts)])
    for i, ids in enumerate(prompts):
        assert res[(str(i), 0)]["ids"] == reference(plain, ids, params)[0].token_ids
    resting = [s for s, layers in passes if not layers]
    assert resting == list(range(3 + REST_AFTER, 24))  # from the REST_AFTER-th plain step to the last one
    assert all(layers for s, layers in passes if s not in resting)
    # each row's first digest after the rest: a fresh cache whose last row is the token before the newest
    restarts = {}
    for s, offset, length, n, tokens in commits:
        if s >= 24:
            restarts.setdefault(tokens, (offset, length, n))
    assert len(restarts) >= 2 and all(length == 0 and offset + n == tokens - 1
                                      for tokens, (offset, length, n) in list(restarts.items())[:2])
    assert sum(drafted_after) > 0  # the head drafts again after its rest


def test_a_prompt_whose_last_token_is_left_to_a_decode_pass_begins_while_the_head_rests(tiny, tmp_path,
                                                                                        monkeypatch):
    """A prompt chunked so that its last token is left alone (17 tokens, 16 a step) is finished by a decode
    pass, and its head starts from that pass's features: a resting engine keeps them for such a pass (it
    crashed the server's engine on a ShareGPT prompt: the 16 requests in flight failed)."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.engine.speculation import Speculation
    from specdec.llm import LLM
    from tests.test_engine_batching import reference, run

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head)})
    engine = Engine(spec, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, block_size=8))
    monkeypatch.setattr(Speculation, "resting", lambda self: True)
    ids = plain.tokenizer.encode("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20")[:17]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = run(engine, [EngineRequest("a", ids, params)])[("a", 0)]
    assert got["ids"] == reference(plain, ids, params)[0].token_ids  # (a TypeError in the head before)


def test_the_engine_drafts_a_tree_configs_chain(tiny, tmp_path, monkeypatch):
    """A decode batch of two rows verifies chains (a tree would be cut to its first path), so with an
    EAGLE-2 tree config its rows draft chains, together, and no tree is built; the offline decoder still
    drafts trees (and so does a one-row batch: test_engine_trees.py). Outputs equal plain decoding either way."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.llm import LLM
    from specdec.proposers import eagle
    from tests.test_engine_batching import reference, run

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512, seed=4)
    cfg = {"method": "eagle3", "model": str(head), "eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 9,
           "num_speculative_tokens": 8, "adaptive": False}
    trees, tree = [], eagle._EagleBase._tree
    monkeypatch.setattr(eagle._EagleBase, "_tree", lambda self, state, budget: trees.append(budget) or tree(self, state, budget))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    texts = ["Hello there, 1 2 3 4", "The cat sat on the mat, the cat"]
    engine = Engine(LLM(str(d), dtype="float32", progress=False, speculative_config=cfg),
                    EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8))
    res = run(engine, [EngineRequest(str(i), plain.tokenizer.encode(t), params) for i, t in enumerate(texts)])
    for i, t in enumerate(texts):
        assert res[(str(i), 0)]["ids"] == reference(plain, plain.tokenizer.encode(t), params)[0].token_ids
    assert trees == [] and engine.totals.num_draft_tokens > 0  # chains of at most num_steps, no tree
    assert len(engine.totals.drafted_per_pos) <= 3  # (its longest draft)
    offline = LLM(str(d), dtype="float32", progress=False, speculative_config=cfg)
    assert offline.generate([texts[0]], params)[0].outputs[0].token_ids == res[("0", 0)]["ids"]
    assert trees and max(trees) == 8  # the offline decoder: trees of 8 nodes


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_engine_rows_draft_together_as_each_would_alone(tiny, tmp_path, kind, monkeypatch):
    """The serving engine's greedy rows digest and draft in one head pass per depth (forward_rows over
    several rows), and each row drafts exactly what it drafts alone: the same sequence of proposals per
    request as in the single-request decoder (k fixed), and outputs equal to plain decoding."""
    from collections import defaultdict

    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.llm import LLM
    from specdec.proposers import eagle
    from specdec.proposers.heads import EagleHead
    from tests.test_engine_batching import reference, run

    d, plain = tiny
    head = random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0, seed=4)
    spec = LLM(str(d), dtype="float32", progress=False,
               speculative_config={"method": kind, "model": str(head), "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = ["Hello there, 1 2 3 4", "The cat sat on the mat, the cat", "a b c a b c a b", "Counting: 7 8 9 10 11"]
    reqs = [EngineRequest(str(i), plain.tokenizer.encode(t), params) for i, t in enumerate(texts)]
    drafts, widths = defaultdict(list), []
    draft, forward_rows = eagle._EagleBase._draft, EagleHead.forward_rows
    digest, chains = EagleHead.digest, EagleHead.draft_chains  # (eagle3's C calls, rows together likewise)

    def log_drafts(self, states, ks, trees):  # (what propose and propose_batch both run)
        out = draft(self, states, ks, trees)
        for state, proposal in zip(states, out):
            drafts[tuple(state.prompt_ids)].append(tuple(proposal.tokens))
        return out

    def log_width(self, embeds, hidden, positions, caches, sizes):
        widths.append(len(sizes))
        return forward_rows(self, embeds, hidden, positions, caches, sizes)

    def log_c_width(real, caches_at: int):
        def logged(self, *args):
            widths.append(len(args[caches_at]))
            return real(self, *args)
        return logged

    monkeypatch.setattr(eagle._EagleBase, "_draft", log_drafts)
    monkeypatch.setattr(EagleHead, "forward_rows", log_width)
    monkeypatch.setattr(EagleHead, "digest", log_c_width(digest, 2))
    monkeypatch.setattr(EagleHead, "draft_chains", log_c_width(chains, 1))
    for r in reqs:
        spec.generate_one(r.prompt_ids, params)
    alone, widths[:] = dict(drafts), []
    drafts.clear()
    res = run(Engine(spec, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8)), reqs)
    assert max(widths) == 4  # four rows in one head pass
    for r in reqs:
        assert res[(r.request_id, 0)]["ids"] == reference(plain, r.prompt_ids, params)[0].token_ids, r.request_id
        assert drafts[tuple(r.prompt_ids)] == alone[tuple(r.prompt_ids)], r.request_id
        assert sum(len(t) for t in alone[tuple(r.prompt_ids)]) > 0


def test_a_head_starts_each_request_fresh(tiny, tmp_path, monkeypatch):
    """A head has a measured draft cost, yet unlike a draft model its adaptive k does not start from the
    previous request's estimates (its acceptance swings with the content); a draft model's does
    (tests/test_proposers.py)."""
    from specdec.llm import LLM
    from specdec.spec.adaptive import AdaptiveK

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head)})
    ids, params = plain.tokenizer.encode("Hello there, 1 2 3 4 5"), SamplingParams(temperature=0.0, max_tokens=24)
    spec.generate_one(ids, params)
    first = spec.decoder.last_adaptive
    spec.proposer.draft_cost_per_token = 1e-3  # a measured cost (a head leaves 0; a draft model's would carry)
    first.acceptance = 0.01
    starts = []  # each AdaptiveK's acceptance at its first choice
    choose = AdaptiveK.choose

    def first_choice(self, *args, **kwargs):
        if self.steps == 0:
            starts.append(self.acceptance)
        return choose(self, *args, **kwargs)

    monkeypatch.setattr(AdaptiveK, "choose", first_choice)
    spec.generate_one(ids, params)
    assert spec.decoder.last_adaptive is not first
    assert starts == [pytest.approx(spec.proposer.acceptance_prior)]  # the prior, not the previous 0.01


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_kept_prefix_keeps_the_heads_context(tiny, tmp_path, monkeypatch, kind):
    """A request whose prompt prefix comes from the kept prefix (prefilled only from there on) drafts
    what it would with a cold prefill: the head gets the cached rows' features kept from the request
    before. Without them (the negative control) the head sees only the new rows, and drafts otherwise."""
    from specdec.llm import LLM
    from specdec.proposers import eagle as eagle_mod

    d, plain = tiny
    head = random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0)
    shared = "A long shared system prompt: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20."
    prompts = [plain.tokenizer.encode(shared + t) for t in (" First question?", " Second one, longer?")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = {"method": kind, "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    proposals = []
    draft = eagle_mod._EagleBase._draft  # (what propose and propose_batch both run)

    def recording(self, states, ks, trees):
        out = draft(self, states, ks, trees)
        proposals.append([list(p.tokens) for p in out])
        return out

    monkeypatch.setattr(eagle_mod._EagleBase, "_draft", recording)

    def second_request_drafts(prefix_caching: bool) -> tuple[list, int]:
        spec = LLM(str(d), dtype="float32", progress=False, speculative_config=config,
                   enable_prefix_caching=prefix_caching)
        spec.generate({"prompt_token_ids": prompts[0]}, params)
        proposals.clear()
        out = spec.generate({"prompt_token_ids": prompts[1]}, params)[0]
        assert out.outputs[0].token_ids == plain.generate({"prompt_token_ids": prompts[1]}, params)[0].outputs[0].token_ids
        return list(proposals), out.num_cached_tokens

    cold, cached_cold = second_request_drafts(False)
    warm, cached_warm = second_request_drafts(True)
    assert cached_cold == 0 and cached_warm >= 16  # the kept prefix served the shared part
    assert warm == cold and len(cold) >= 3
    monkeypatch.setattr(eagle_mod._EagleBase, "_with_kept_prefix", lambda self, state, feats: feats)
    blind, _ = second_request_drafts(True)
    assert blind != cold


def test_a_heads_catchup_is_priced_as_step_overhead_not_per_drafted_token(tiny, tmp_path, monkeypatch):
    """The head digests the rows accepted since it last drafted when it next drafts. That catch-up is
    reported apart (take_catchup): the prompt's digest prices nothing, a step's few rows are the step's
    overhead, and the drafted tokens are priced at the rest. (Counted per drafted token, a real prompt's
    digest made an EAGLE-3 head's first step cost 12 ms a token and kept it off for 15 steps.)"""
    import time as time_mod

    from specdec.llm import LLM
    from specdec.proposers import eagle as eagle_mod
    from specdec.spec.adaptive import AdaptiveK, Choice

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False,
               speculative_config={"method": "eagle3", "model": str(head), "num_steps": 4})
    commit = eagle_mod.Eagle3Proposer._commit
    DIGEST = 0.2  # seconds a digest costs (slept), far above the tiny head's own work even on a busy machine

    def slow_commit(self, work):
        time_mod.sleep(DIGEST)
        return commit(self, work)

    monkeypatch.setattr(eagle_mod.Eagle3Proposer, "_commit", slow_commit)
    reported, observed = [], []
    take, observe = eagle_mod.Eagle3Proposer.take_catchup, AdaptiveK.observe_step
    monkeypatch.setattr(eagle_mod.Eagle3Proposer, "take_catchup", lambda self: reported.append(take(self)) or reported[-1])
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, *args: Choice(2, False))  # draft on every step
    monkeypatch.setattr(AdaptiveK, "observe_step", lambda self, n, draft, other, model=True: (
        observed.append((reported[-1], (n, draft, other))), observe(self, n, draft, other, model))[1])
    ids = plain.tokenizer.encode("Hello there, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert spec.generate_one(ids, params).token_ids == plain.generate_one(ids, params).token_ids
    drafting = [(rep, obs) for rep, obs in observed if obs[0] > 0]  # (the step's catch-up report, its costs)
    assert drafting
    (seconds, rows), (n, draft, other) = drafting[0]
    assert rows >= len(ids) - 1 and seconds >= DIGEST  # the first proposal digests the prompt
    assert draft < DIGEST / 2 and other < DIGEST / 2  # ... which prices nothing
    steady = [(rep, obs) for rep, obs in drafting[1:] if 0 < rep[1] <= spec.decoder.k_max + 1]
    assert steady
    for (seconds, rows), (n, draft, other) in steady:
        assert other >= seconds >= DIGEST and draft < DIGEST / 2  # the step's overhead


def test_heldout_decode_tau_is_the_engines_tokens_per_pass():
    """The trainer's held-out decode_tau, on the real model and the shipped head, counts the target
    passes greedy chain decoding makes: the same sequences (prompt + the target's greedy answer) through
    the engine, pass for pass (within one: the head's attention sums its rows in another order there).
    Its `tau` averages over every start position instead: it is not what decoding sees."""
    from specdec.llm import LLM
    from specdec.proposers.eagle_rows import PROMPT_WINDOW
    from specdec.proposers.head_io import ASSETS
    from specdec.proposers.head_io import load_head
    from specdec.train.features import compute_features
    from specdec.train.evaluate import chain_acceptance

    head_dir = ASSETS / "smollm2-135m-eagle3"
    head = load_head(head_dir)
    plain = LLM("smollm2-135m", dtype="float32", progress=False, enable_prefix_caching=False)
    spec = LLM("smollm2-135m", dtype="float32", progress=False, enable_prefix_caching=False,
               speculative_config={"method": "eagle3", "model": str(head_dir), "num_steps": 5, "eagle_topk": 1,
                                   "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for text in ("List three uses of a paperclip.", "Explain what a prime number is to a child."):
        ids = plain.tokenizer.encode(plain.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        assert len(ids) < PROMPT_WINDOW  # the engine's head then sees every prompt row, as training does
        answer = plain.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        out = spec.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
        assert list(out.token_ids) == list(answer)
        engine_passes = out.metrics["target_forward_passes"] - 1  # the prompt's pass gave the first token
        seq = compute_features(plain.model, list(ids) + list(answer), len(ids), tuple(head.cfg.aux_layers))
        ev = chain_acceptance(head, plain.model, [seq], 5, tuple(head.cfg.aux_layers))
        offline_passes = (len(answer) - 1) / ev["decode_tau"]
        assert abs(offline_passes - engine_passes) <= 1, (offline_passes, engine_passes)
        assert engine_passes < len(answer) - 1  # the head drafted something right: the test compares counts


def test_a_fixed_k_row_keeps_the_heads_features_while_adaptive_rows_rest(tiny, tmp_path, monkeypatch):
    """A request with its own num_speculative_tokens drafts at every step whatever K the batch chose, so the
    passes it is in keep the head's features even while the adaptive rows' speculation rests: it drafted only
    until the rest began (REST_AFTER plain batches), then never again."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.engine.speculation import Speculation
    from specdec.llm import LLM
    from tests.test_engine_batching import reference, run

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head)})
    engine = Engine(spec, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8))

    def held(self, seqs, caps, found=None):  # the adaptive rows' K: 0 at every step, with no probe
        self.probes.should_probe(False)
        return 0

    monkeypatch.setattr(Speculation, "choose_k", held)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [plain.tokenizer.encode(t) for t in ("Hello there, 1 2 3 4 5", "The cat sat on the mat, the cat")]
    res = run(engine, [EngineRequest("adaptive", prompts[0], params),
                       EngineRequest("fixed", prompts[1], params, speculative={"method": "eagle3",
                                                                                "num_speculative_tokens": 2})])
    for rid, ids in zip(("adaptive", "fixed"), prompts):
        assert res[(rid, 0)]["ids"] == reference(plain, ids, params)[0].token_ids, rid
    fixed = res[("fixed", 0)]["out"].metrics
    assert fixed.num_drafts >= fixed.target_passes - 2  # every step but the last (no room to draft)
    assert res[("adaptive", 0)]["out"].metrics.num_drafts == 0


def test_a_request_asking_more_tokens_a_step_than_the_head_drafts_is_refused(tiny, tmp_path):
    """A request's num_speculative_tokens above what the head drafts a step (a chain's num_steps) is a
    ConfigError (a 400 in the server): it was cut to num_steps silently."""
    from specdec.config import ConfigError
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.llm import LLM

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head)})
    engine = Engine(spec, EngineConfig(max_num_seqs=2, profile_cost=False))
    assert engine.resolve_spec({"method": "eagle3", "num_speculative_tokens": 3}).k_max == 3
    with pytest.raises(ConfigError, match="eagle3 drafts at most 3 tokens a step"):
        engine.resolve_spec({"method": "eagle3", "num_speculative_tokens": 4})
