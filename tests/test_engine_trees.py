"""Token trees in the serving engine: a decode batch of one row verifies its drafter's tree (the accepted
path's keys and values moved into place in the paged pool), a wider batch cuts each tree to its first path;
either way greedy outputs and logprobs are single-request plain decoding's, and no KV block leaks."""
from __future__ import annotations

import pytest

from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.sampling_params import SamplingParams
from specdec.spec.proposer import Proposal
from tests.heads import random_head
from tests.test_engine_batching import PROMPTS, memory_bound, run

TREE = {"eagle_topk": 3, "num_steps": 3, "num_draft_tokens": 9}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from specdec.llm import LLM
    d = tiny_dir("llama")
    return d, LLM(str(d), dtype="float32", progress=False)


def _oracle(proposer, want: dict[tuple, list[int]], drafted: list[Proposal]):
    """proposer.propose replaced by a tree whose accepted path runs through second children: for the next
    true tokens t0, t1, t2 (plain decoding's), nodes [w, t0, w', t1, t2] with parents [-1, -1, 1, 1, 3]
    (w, w' wrong), so every accepted node but the first leaves its row and its keys must move."""
    def propose(state, k):
        truth = want[tuple(state.prompt_ids)][len(state.output_ids):]
        if len(truth) < 3:
            return Proposal([])
        wrong = [(t + 1) % 256 for t in truth[:2]]
        p = Proposal([wrong[0], truth[0], wrong[1], truth[1], truth[2]], None, [-1, -1, 1, 1, 3])
        drafted.append(p.first(k))
        return drafted[-1]
    proposer.propose = propose
    proposer.propose_batch = lambda states, ks, trees=False: [propose(s, k) for s, k in zip(states, ks)]


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_a_single_rows_trees_are_verified_and_its_keys_moved(tiny, tmp_path, monkeypatch, max_num_seqs):
    from specdec.cache.paged_cache import PagedKVPool
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, enforce_eager=True, speculative_config={
        "method": "eagle3", "model": str(head), **TREE, "num_speculative_tokens": 5})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS[:3]]
    refs = [plain.generate({"prompt_token_ids": ids}, params)[0].outputs[0] for ids in prompts]
    drafted, moves = [], []
    _oracle(spec.proposer, {tuple(ids): r.token_ids for ids, r in zip(prompts, refs)}, drafted)
    real_move = PagedKVPool.move
    monkeypatch.setattr(PagedKVPool, "move", lambda self, *a: moves.append(a[1:]) or real_move(self, *a))
    engine = memory_bound(Engine(spec, EngineConfig(max_num_seqs=max_num_seqs, block_size=8)))
    got = run(engine, [EngineRequest(str(i), ids, params) for i, ids in enumerate(prompts)])
    for i, ref in enumerate(refs):
        assert got[(str(i), 0)]["ids"] == ref.token_ids
        lps = got[(str(i), 0)]["lps"]  # each token's logprob and top 2: the row of its own path
        assert [(lp["token_id"], [t for t, _ in lp["top"]]) for lp in lps] == \
            [(lp["token_id"], [t for t, _ in lp["top"]]) for lp in ref.logprobs]
        assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(lps, ref.logprobs)) < 1e-4
    assert drafted
    if max_num_seqs == 1:  # the trees were verified: 4 tokens a pass, and the accepted keys moved
        assert moves and all(src != dst for src, dst in moves)
        assert engine.totals.num_accepted_tokens >= 2.5 * engine.totals.num_drafts
    else:  # 3 rows: each tree cut to its first path [w], which is rejected
        assert engine.totals.num_accepted_tokens < engine.totals.num_drafts


def test_an_eagle_tree_config_drafts_trees_for_one_row_in_the_engine(tiny, tmp_path, monkeypatch):
    """The EAGLE-2 tree of a tree config, drafted as the offline decoder drafts it, in a one-row batch."""
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, enforce_eager=True, speculative_config={
        "method": "eagle3", "model": str(head), **TREE, "num_speculative_tokens": 8})
    from specdec.engine import speculation
    verified, fit = [], speculation.Speculation._fit  # (_fit sees every proposal the engine verifies)
    monkeypatch.setattr(speculation.Speculation, "_fit",
                        staticmethod(lambda seq, p, k, trees=False: verified.append(fit(seq, p, k, trees)) or verified[-1]))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS[:2]]
    engine = memory_bound(Engine(spec, EngineConfig(max_num_seqs=1, block_size=8)))
    got = run(engine, [EngineRequest(str(i), ids, params) for i, ids in enumerate(prompts)])
    for i, ids in enumerate(prompts):
        assert got[(str(i), 0)]["ids"] == plain.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    assert any(p.is_tree and len(p) == 8 for p in verified)


def test_a_sampled_rows_tree_draws_what_the_offline_decoder_draws(tiny, tmp_path):
    """Sampling (temperature 0.8, a seed): the engine's one-row tree verification consumes the request's
    generator as the offline decoder's does (spec/tree.py's recursive rejection over the same rows), so the
    same trees give the same tokens; the distribution itself is tests/test_tree_distribution.py's. With
    top_k 1 the sampled path is the greedy one, and the oracle's second children are accepted through it."""
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, enforce_eager=True, speculative_config={
        "method": "eagle3", "model": str(head), **TREE, "num_speculative_tokens": 5})
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS[:2]]
    want = {tuple(ids): plain.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids for ids in prompts}
    drafted = []
    _oracle(spec.proposer, want, drafted)
    for params in (SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=1, seed=11, max_tokens=24, ignore_eos=True)):
        drafted.clear()
        offline = [spec.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids for ids in prompts]
        n_offline = len(drafted)
        engine = memory_bound(Engine(spec, EngineConfig(max_num_seqs=1, block_size=8)))
        got = run(engine, [EngineRequest(str(i), ids, params) for i, ids in enumerate(prompts)])
        assert [got[(str(i), 0)]["ids"] for i in range(len(prompts))] == offline
        assert n_offline and len(drafted) == 2 * n_offline  # the same number of trees
        if params.top_k == 1:
            assert offline == [want[tuple(ids)] for ids in prompts]
            assert engine.totals.num_accepted_tokens >= 2.5 * engine.totals.num_drafts
