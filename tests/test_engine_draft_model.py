"""A draft model in the serving engine: its keys/values live in the engine's KV blocks (a pool of its
own indexed by the same block tables), the rows of a decode batch draft together, and outputs equal
single-request plain decoding, with preemption and prefix sharing (tiny random models)."""
from __future__ import annotations

import pytest
import torch

from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from tests.test_engine_batching import greedy_reqs, reference, run


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=160, progress=False, num_threads=1)


def drafting(tiny_dir, draft, k: int | None = None) -> LLM:
    cfg = {"method": "draft_model", "model": str(draft)}
    if k is not None:
        cfg["num_speculative_tokens"] = k
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=160, progress=False, num_threads=1,
               speculative_config=cfg)


@pytest.fixture(scope="module", params=["self", "other"])
def draft_llm(request, tiny_dir):
    """draft == target (every draft accepted) and a 1-layer model of other weights (most rejected)."""
    draft = tiny_dir("llama") if request.param == "self" else tiny_dir("llama", seed=1, num_hidden_layers=1)
    return drafting(tiny_dir, draft)


def spy_forwards(engine: Engine) -> list[tuple[int, int]]:
    drafter = engine.spec.proposer("draft_model")
    shapes: list[tuple[int, int]] = []
    real = drafter.model.forward
    drafter.model.forward = lambda ids, *a, **kw: shapes.append(tuple(ids.shape)) or real(ids, *a, **kw)
    drafter.model.new_cache = lambda *a, **kw: pytest.fail("the engine's drafter made a cache of its own")
    return shapes


def test_draft_model_drafts_in_the_engines_blocks(plain, draft_llm):
    engine = Engine(draft_llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8))
    drafter = engine.spec.proposer("draft_model")
    assert drafter.kv_bytes_per_block(8) > 0
    shapes = spy_forwards(engine)
    reqs = greedy_reqs(draft_llm, max_tokens=24)[:4]
    sampled = EngineRequest("s", reqs[0].prompt_ids, SamplingParams(temperature=0.8, max_tokens=24, seed=3,
                                                                     ignore_eos=True))
    for r in reqs + [sampled]:
        r.speculative = {"method": "draft_model", "num_speculative_tokens": 3}
    res = run(engine, reqs + [sampled])  # asserts that no block leaked
    for r in reqs:
        assert res[(r.request_id, 0)]["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids
    assert len(res[("s", 0)]["ids"]) == 24
    pool = drafter.paged.pool
    assert pool.num_blocks == engine.pool.num_blocks and pool.block_size == engine.pool.block_size
    assert max(b for b, t in shapes if t == 1) >= 3  # draft steps: several rows in one forward
    drafted = sum(res[(r.request_id, 0)]["out"].metrics.num_draft_tokens for r in reqs)
    accepted = sum(res[(r.request_id, 0)]["out"].metrics.num_accepted_tokens for r in reqs)
    assert drafted > 0
    if draft_llm.proposer.model.config.num_hidden_layers == plain.model.config.num_hidden_layers:
        assert accepted == drafted  # the target drafting for itself: rollback never loses a token


def test_draft_model_survives_preemption_and_prefix_sharing(plain, tiny_dir):
    """Preemption frees the drafter's blocks with the target's (its drafter starts over); a prompt shared
    through the prefix cache is re-read by each request's own drafter; short of blocks, rows' drafts give way
    to other rows' next tokens. Outputs stay exact, and every draft is the one the drafter makes from that
    context afresh (a drafter reading stale keys/values would still give exact outputs, only other drafts)."""
    llm = drafting(tiny_dir, tiny_dir("llama", seed=1, num_hidden_layers=1), k=3)
    reqs = greedy_reqs(llm, max_tokens=40)
    reqs.append(EngineRequest("dup", reqs[4].prompt_ids, reqs[4].params))  # the same prompt again
    engine = Engine(llm, EngineConfig(max_num_seqs=6, max_num_batched_tokens=32, block_size=8, num_kv_blocks=21))
    drafter = engine.spec.proposer("draft_model")
    fresh_cache = drafter.model.new_cache
    spy_forwards(engine)
    drafts: list[tuple[list[int], list[int]]] = []  # (context, drafted tokens)
    propose = drafter.paged.propose

    def recording(states, ks, threshold):
        proposals = propose(states, ks, threshold)
        drafts.extend((list(s.token_ids), list(p.tokens)) for s, p in zip(states, proposals) if p.tokens)
        return proposals

    drafter.paged.propose = recording
    res = run(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for r in reqs:
        assert res[(r.request_id, 0)]["ids"] == reference(plain, r.prompt_ids, r.params)[0].token_ids, r.request_id
    assert len(drafts) > 100
    for context, tokens in drafts:
        cache, ids = fresh_cache(len(context) + len(tokens)), list(context)
        for _ in tokens:
            logits = drafter.model(torch.tensor([ids[cache.length:]]), torch.arange(cache.length, len(ids))[None],
                                   cache, num_logits=1).logits[0, -1]
            ids.append(int(logits[:drafter.vocab].argmax()))
        assert ids[len(context):] == tokens


def test_engine_blocks_are_sized_with_the_drafters_bytes(tiny_dir):
    llm = drafting(tiny_dir, tiny_dir("llama"))
    cfg = EngineConfig(max_num_seqs=64, kv_cache_memory_gb=0.001, block_size=8, profile_cost=False)
    plain_blocks = Engine(LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=160, progress=False,
                              num_threads=1), cfg).pool.num_blocks
    assert Engine(llm, cfg).pool.num_blocks == plain_blocks // 2  # the draft here is a copy of the target


def test_the_blocks_count_each_request_methods_drafter(draft_llm):
    """A request method with a draft model of its own (here 'draft_model+ngram', a second drafter beside the
    default's) is built with the engine, and its keys/values are counted when the KV memory is cut into blocks."""
    def engine(methods):
        return Engine(draft_llm, EngineConfig(max_num_seqs=64, block_size=8, kv_cache_memory_gb=0.002,
                                              profile_cost=False, request_methods=methods))
    alone, paired, listed = engine(()), engine(("draft_model+ngram",)), engine(("draft_model",))
    drafter = paired.request_proposers["draft_model+ngram"]
    per_block = {e: e.pool.bytes_per_block(draft_llm.model.config, 8, e.pool.k.dtype) for e in (alone, paired)}
    for e, drafters in ((alone, [draft_llm.proposer]), (paired, [draft_llm.proposer, drafter])):
        assert e.blocks.num_blocks == int(0.002 * 2**30 // (per_block[e] + sum(d.kv_bytes_per_block(8) for d in drafters)))
    assert drafter is not draft_llm.proposer and paired.blocks.num_blocks < alone.blocks.num_blocks
    assert listed.blocks.num_blocks == alone.blocks.num_blocks  # the server's own method, listed: counted once


def test_a_draft_model_with_a_shorter_context_drafts_within_it(plain, tiny_dir, caplog):
    """A draft model whose context (64) is shorter than the target's (160) is said so at load; in the engine a
    row past the draft's context drafts nothing while the rows within it go on drafting (a position past the
    draft's rotary table raised, and the engine dropped the drafter of every row of the batch); alone, a
    request drafts up to the draft's last position. Outputs stay plain decoding's."""
    import logging
    import warnings
    draft = tiny_dir("llama", seed=1, num_hidden_layers=1, max_position_embeddings=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short = drafting(tiny_dir, draft, k=3)
    assert any("draft model's context (64 tokens) is shorter than the target's (160)" in str(w.message) for w in caught)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long_prompt, short_prompt = [5 + i % 50 for i in range(50)], [7, 8, 9]  # 50 + 40 tokens pass 64; 3 + 40 do not
    engine = Engine(short, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8))
    with caplog.at_level(logging.WARNING, logger="specdec"):
        res = run(engine, [EngineRequest("long", long_prompt, params), EngineRequest("short", short_prompt, params)])
    assert not [r for r in caplog.records if "drafter" in r.getMessage()]  # no drafter dropped
    for rid, ids in (("long", long_prompt), ("short", short_prompt)):
        assert res[(rid, 0)]["ids"] == reference(plain, ids, params)[0].token_ids, rid
    m = res[("short", 0)]["out"].metrics
    assert m.num_drafts >= m.target_passes - 2  # drafted all along, beside a row past the draft's context
    assert 0 < res[("long", 0)]["out"].metrics.num_drafts < m.num_drafts
    alone = short.generate_one(long_prompt, params)
    assert alone.token_ids == reference(plain, long_prompt, params)[0].token_ids
    assert 0 < alone.metrics.num_drafts
