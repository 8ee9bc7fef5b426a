"""The serving engine under everything at once (tiny random model, an EAGLE-3 head paired with the
n-gram lookup): chunked prefill that leaves a prompt's last token to a decode pass, prefix-cache hits,
preemption by recompute, rows joining mid-flight, and the drafters' features resting and waking at
random steps. Every output must equal single-request plain decoding and every block must come back.
(A resting pass once crashed on a prompt whose last token a decode pass finished.)"""
from __future__ import annotations

import random

import pytest

from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.engine.speculation import Speculation
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from tests.heads import random_head
from tests.test_engine_batching import memory_bound, reference


# short contexts (one of the attention kernel's key splits, 128; few blocks: preemption) and long ones (prompts
# of 100-250 tokens: two or three splits, the rows of a batch ending in different ones)
@pytest.mark.parametrize("seed,max_len,words_per_prompt,kv_blocks", [(0, 96, (3, 30), 16), (1, 96, (3, 30), 16),
                                                                     (2, 300, (100, 250), 96)])
def test_engine_outputs_stay_exact_under_chunking_preemption_prefix_hits_and_rests(tiny_dir, tmp_path, monkeypatch,
                                                                                   seed, max_len, words_per_prompt,
                                                                                   kv_blocks):
    d = tiny_dir("llama")
    plain = LLM(str(d), dtype="float32", progress=False, max_model_len=max_len)
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, max_model_len=max_len,
               speculative_config={"method": "eagle3", "model": str(head), "lookup": "ngram"})
    rng = random.Random(seed)
    monkeypatch.setattr(Speculation, "resting", lambda self: rng.random() < 0.5)
    engine = memory_bound(Engine(spec, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                                                    num_kv_blocks=kv_blocks)))
    words = "the cat sat on a mat and one two three four five six seven eight".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(*words_per_prompt))) for _ in range(5)]
    prompts = [plain.tokenizer.encode(t) for t in texts + texts[:3]]  # the last three: prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    pending = [EngineRequest(str(i), ids, params) for i, ids in enumerate(prompts)]
    got: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.4:  # rows join between steps
            engine.add_request(pending.pop(0))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.blocks.num_used == 0
    assert engine.stats().prefix_hits > 0
    assert engine.scheduler.num_preemptions > 0 or max_len > 96  # the long variant has room: prefix hits, not preemption
    assert max_len == 96 or max(map(len, prompts)) > 128  # the long prompts span two splits or more
    assert engine.totals.num_drafts > 0 and engine.totals.num_accepted_tokens > 0
    for i, ids in enumerate(prompts):
        assert got[str(i)] == reference(plain, ids, params)[0].token_ids, i
