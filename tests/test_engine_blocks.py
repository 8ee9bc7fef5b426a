"""Block manager (ref counts, prefix caching, salt, collisions, LRU eviction) and the paged batch cache."""
from __future__ import annotations

import torch

from specdec.cache import prefix_cache
from specdec.cache.paged_cache import BatchKV, PagedKVPool, SeqKV
from specdec.engine.block_manager import BlockManager


class FakeSeq:
    reads_prefix_cache = True

    def __init__(self, tokens, salt=None):
        self.token_ids, self.cache_salt = list(tokens), salt
        self.block_table, self.block_hashes, self.num_computed = [], [], 0


def _run(bm: BlockManager, seq: FakeSeq) -> None:
    """Prefill the whole sequence (as the engine would) and register its full blocks."""
    bm.match_prefix(seq)
    assert bm.ensure(seq, len(seq.token_ids))
    seq.num_computed = len(seq.token_ids)
    bm.commit(seq)


def test_alloc_free_and_trim():
    bm = BlockManager(8, 4)
    s = FakeSeq(range(10))
    assert bm.ensure(s, 10) and len(s.block_table) == 3 and bm.num_used == 3
    assert not bm.ensure(FakeSeq(range(40)), 40)  # all or nothing
    assert bm.num_used == 3
    bm.trim(s, 5)
    assert len(s.block_table) == 2 and bm.num_used == 2
    bm.free(s)
    assert bm.num_used == 0 and bm.num_free == 8


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = FakeSeq(range(12))
    _run(bm, a)
    b = FakeSeq(list(range(12)))  # identical: 2 full blocks reused, the last block recomputed
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = FakeSeq(list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.match_prefix(c) == 8
    bm.free(a), bm.free(b), bm.free(c)
    assert bm.num_used == 0
    d = FakeSeq(range(12))  # cached blocks survive their users (ref count 0, still hittable)
    assert bm.match_prefix(d) == 8
    bm.free(d)


def test_cache_salt_isolates_tenants():
    bm = BlockManager(16, 4)
    _run(bm, FakeSeq(range(12), salt="tenant-a"))
    assert bm.match_prefix(FakeSeq(range(12), salt="tenant-b")) == 0
    assert bm.match_prefix(FakeSeq(range(12))) == 0
    same = FakeSeq(range(12), salt="tenant-a")
    assert bm.match_prefix(same) == 8


def test_forced_hash_collision_is_caught_by_content(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens, salt=None: b"same")
    import specdec.engine.block_manager as bm_mod
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, tokens, salt=None: b"same")
    bm = BlockManager(16, 4)
    _run(bm, FakeSeq(range(12)))
    other = FakeSeq([7, 7, 7, 7, 8, 8, 8, 8, 9])
    assert bm.match_prefix(other) == 0 and other.block_table == []


def test_lru_eviction_prefers_uncached_blocks_then_the_oldest_tail():
    bm = BlockManager(4, 2)
    a = FakeSeq([1, 2, 3, 4, 5])
    _run(bm, a)  # blocks [1 2] and [3 4] cached, [5] private
    bm.free(a)
    b = FakeSeq([9, 9, 9])
    assert bm.ensure(b, 4)  # the two uncached blocks: the cached prefix survives
    probe = FakeSeq([1, 2, 3, 4, 5])
    assert bm.match_prefix(probe) == 4
    bm.free(probe)  # freed tail first: [3 4] is now the least recently freed
    assert bm.ensure(FakeSeq([8]), 1)
    probe = FakeSeq([1, 2, 3, 4, 5])
    assert bm.match_prefix(probe) == 2


def test_eviction_drops_the_hash():
    bm = BlockManager(2, 2)
    a = FakeSeq([1, 2, 3, 4, 5])
    a2 = FakeSeq([1, 2, 3])
    _run(bm, a2)  # blocks: [1,2] cached, [3] private
    bm.free(a2)
    big = FakeSeq([])
    assert bm.ensure(big, 4)  # needs both blocks: the cached one is evicted
    bm.free(big)
    assert bm.match_prefix(a) == 0


def _contiguous_logits(model, ids, past_len):
    cache = model.new_cache(64)
    if past_len:
        model(torch.tensor([ids[:past_len]]), torch.arange(past_len)[None], cache)
    return model(torch.tensor([ids[past_len:]]), torch.arange(past_len, len(ids))[None], cache).logits[0]


def test_batch_kv_matches_contiguous_cache(tiny_dir):
    """Ragged rows through the paged view give each row's single-request logits."""
    from specdec.model.loader import load_model
    model = load_model(tiny_dir("llama"), torch.float32, 128)
    pool = PagedKVPool.for_model(model.config, 32, 4, torch.float32)
    bm = BlockManager(32, 4)
    rows = [(list(range(5, 18)), 10), (list(range(100, 103)), 0), (list(range(40, 47)), 6)]
    seqs = []
    for ids, past in rows:  # fill the past of each row through the paged cache itself
        s = FakeSeq(ids)
        assert bm.ensure(s, len(ids))
        if past:
            kv = BatchKV(pool, [s.block_table], [0], [past])
            model(torch.tensor([ids[:past]]), torch.arange(past)[None], kv)
        seqs.append(s)
    T = max(len(ids) - past for ids, past in rows)
    inp = torch.zeros(len(rows), T, dtype=torch.long)
    pos = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (ids, past) in enumerate(rows):
        n = len(ids) - past
        inp[b, T - n:] = torch.tensor(ids[past:])
        pos[b, T - n:] = torch.arange(past, len(ids))
    kv = BatchKV(pool, [s.block_table for s in seqs], [p for _, p in rows], [len(i) - p for i, p in rows])
    out = model(inp, pos, kv).logits
    for b, (ids, past) in enumerate(rows):
        n = len(ids) - past
        ref = _contiguous_logits(model, ids, past)
        torch.testing.assert_close(out[b, T - n:], ref, atol=1e-4, rtol=1e-4)
    # the single-sequence view (lent to layer-skip drafters) reads the same blocks
    view = SeqKV(pool, seqs[0].block_table, len(rows[0][0]) - 1)
    last = model(torch.tensor([[rows[0][0][-1]]]), torch.tensor([[len(rows[0][0]) - 1]]), view).logits[0, -1]
    torch.testing.assert_close(last, _contiguous_logits(model, rows[0][0], len(rows[0][0]) - 1)[-1],
                               atol=1e-4, rtol=1e-4)


def test_text_pieces_cut_the_text_at_token_starts():
    """Sequence.text_pieces (what the page colours by drafted / not drafted) against a character-by-character
    reference, for every [start, end): it starts from the first token ending after `start` (a bisect) and
    must give the pieces a scan from the text's start gives."""
    from types import SimpleNamespace

    from specdec.engine.sequence import Sequence
    text = "Hello, world! How are you?"
    ends = [5, 6, 12, 13, 17, 21, 26]  # token i covers [ends[i-1], ends[i])
    seq = SimpleNamespace(out=SimpleNamespace(text=text), text_marks=[(e, i % 2 == 1) for i, e in enumerate(ends)])
    owner = [next(i for i, e in enumerate(ends) if c < e) for c in range(len(text))]
    for start in range(len(text) + 1):
        for end in range(start, len(text) + 1):
            want, prev = [], None
            for c in range(start, end):
                if owner[c] != prev:
                    want.append(["", owner[c] % 2 == 1])
                    prev = owner[c]
                want[-1][0] += text[c]
            assert Sequence.text_pieces(seq, start, end) == [tuple(w) for w in want], (start, end)


def test_generated_blocks_are_cached_only_where_prompt_and_decode_passes_agree(tiny_dir, monkeypatch):
    """Where a model's prompt passes run other kernels than its decode passes (a bf16 prompt on oneDNN, on a
    CPU whose oneDNN is row-invariant), a later prompt hitting keys/values a decode pass wrote would differ
    bitwise from its own cold prefill: only blocks wholly inside the prompt are cached there."""
    from specdec.engine import engine as engine_mod
    from specdec.llm import LLM

    seq = FakeSeq(range(14))
    seq.prompt_ids = list(range(9))  # a 9-token prompt, 5 generated tokens: blocks [0..3] [4..7] prompt-only
    for cache_generated, cached in ((True, 3), (False, 2)):
        bm = BlockManager(16, 4, cache_generated=cache_generated)
        s = FakeSeq(seq.token_ids)
        s.prompt_ids = seq.prompt_ids
        _run(bm, s)
        assert len(s.block_hashes) == cached
    llm = LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=64, progress=False, num_threads=1)
    assert engine_mod.Engine(llm).blocks.cache_generated  # prompt passes on the decode passes' kernels
    monkeypatch.setattr(engine_mod, "exact_prompt_passes", lambda model: False)  # a row-invariant oneDNN
    llm.model.prefill_matmul_dtype = torch.bfloat16
    try:
        assert not engine_mod.Engine(llm).blocks.cache_generated
    finally:
        llm.model.prefill_matmul_dtype = None
