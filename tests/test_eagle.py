"""EAGLE-1/2/3 drafting on a tiny model: every chain and tree shape reproduces plain greedy decoding,
seeded sampling is reproducible, and the drafter's incremental KV-cached computation equals the
training-time-test unroll the heads are trained with (so training and inference see the same thing)."""
from __future__ import annotations

import pytest
import torch

from specdec.sampling_params import SamplingParams
from specdec.spec.proposer import Proposal
from tests.heads import random_head


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from specdec.llm import LLM
    d = tiny_dir("llama")
    return d, LLM(str(d), dtype="float32", progress=False)


SHAPES = [
    dict(eagle_topk=1, num_steps=4),  # EAGLE-1 chain
    dict(eagle_topk=3, num_steps=3, num_draft_tokens=8),  # EAGLE-2 dynamic tree
    dict(eagle_topk=2, num_steps=5, num_draft_tokens=12),
]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree3x3", "tree2x5"])
def test_greedy_equivalence(tiny, tmp_path, kind, shape):
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": kind, "model": str(head), **shape})
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ids = plain.tokenizer.encode("Hello there, 1 2 3 4 5 6 7 8")
    r = spec.generate_one(ids, params)
    assert r.token_ids == plain.generate_one(ids, params).token_ids
    assert r.metrics.num_drafts > 0


def test_tree_metrics_count_positions_by_depth(tiny, tmp_path):
    """An EAGLE-2 tree of 8 nodes 3 deep: acceptance by position has at most 3 entries (it had one a node)."""
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head),
                                                                            "num_speculative_tokens": 7, **SHAPES[1]})
    r = spec.generate_one(plain.tokenizer.encode("Hello there, 1 2 3 4 5 6 7 8"),
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    m = r.metrics
    assert m.num_draft_tokens > 3 * m.num_drafts  # trees wider than their depth were drafted
    assert len(m.drafted_per_pos) <= 3 and m.drafted_per_pos[0] == m.num_drafts  # (7 positions before)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_confidence_threshold_stops_chains_after_an_unsure_token(tiny, tmp_path, temperature):
    """draft_confidence_threshold, as for the other drafters: a chain stops after a token the head drafted
    below it (a random head over 512 tokens is never sure: one token a draft); greedy output unchanged."""
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=3)
    ids = plain.tokenizer.encode("Hello there, 1 2 3 4 5 6 7 8")
    runs = {}
    for th in (0.0, 0.5):
        cfg = {"method": "eagle3", "model": str(head), "num_steps": 4, "num_speculative_tokens": 4,
               "draft_confidence_threshold": th}
        runs[th] = LLM(str(d), dtype="float32", progress=False, speculative_config=cfg).generate_one(ids, params)
    cut, full = runs[0.5].metrics, runs[0.0].metrics
    assert cut.num_drafts > 0 and cut.num_draft_tokens == cut.num_drafts
    assert full.num_draft_tokens > full.num_drafts
    if temperature == 0.0:
        assert runs[0.5].token_ids == runs[0.0].token_ids == plain.generate_one(ids, params).token_ids


def test_rerank_orders_the_cut_likeliest_first_with_parents_before_children():
    from specdec.proposers.eagle_tree import rerank
    # root children 0 (-0.1), 1 (-1.0), 2 (-2.0); 3, 4 under 0; 5 under 3 (equal to its parent: a sure token)
    tok, par = [10, 11, 12, 13, 14, 15], [-1, -1, -1, 0, 0, 3]
    val = [-0.1, -1.0, -2.0, -0.5, -3.0, -0.5]
    p = rerank(tok, par, val, 4)
    assert p.tokens == [10, 13, 15, 11]  # -0.1, -0.5, -0.5 (the parent first), -1.0
    assert p.parents == [-1, 0, 1, -1]


def test_a_smaller_tree_is_the_first_nodes_of_a_larger_one(tiny, tmp_path):
    """Node i of an EAGLE-2 tree is its i-th likeliest, and a tree of b nodes, drafted b deep at most,
    is the first b nodes of the full-depth tree: adaptive k prices a rank by the trees that drafted it."""
    from specdec.llm import LLM
    from specdec.spec.proposer import RequestState, TargetOutput

    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={
        "method": "eagle3", "model": str(head), "eagle_topk": 3, "num_steps": 4, "num_draft_tokens": 13})
    proposer = spec.proposer
    assert proposer.dynamic_tree_depth == 4 and len(proposer.tree_shares()) == 12
    state = RequestState(plain.tokenizer.encode("Hello there, 1 2 3 4"), SamplingParams(temperature=0.0))
    n = len(state.prompt_ids)  # the target's prefill, as the decoder runs it
    res = spec.model(torch.tensor([state.prompt_ids]), torch.arange(n)[None], spec.model.new_cache(64),
                     num_logits=1, output_layers=proposer.feature_layers, prefill=True)
    state.output_ids.append(int(res.logits[0, -1].argmax()))
    proposer.begin(state, TargetOutput(res, list(range(n))))
    full = proposer.propose(state, 12)
    assert len(full) == 12 and all(p < i for i, p in enumerate(full.parents))
    for b in (2, 3, 5):
        small = proposer.propose(state, b)
        assert small.tokens == full.tokens[:b] and small.parents == full.parents[:b]
    proposer.end(state)


def test_the_shipped_head_on_amx_tiles_drafts_within_rounding_and_switches_back():
    """use_amx_tiles: where the CPU has AMX, the shipped head's six matrices (bf16 values) run on tiles with
    bf16-rounded inputs, the fused step and the C layer's rows within that rounding of the exact ones; switched
    off, bitwise the exact ones again (the layer's C description follows the kernels). Without AMX: 0, no change."""
    from specdec.kernels import amx_active
    from specdec.proposers.head_io import ASSETS, load_head
    from specdec.cache.draft_kv import DraftKV

    head = load_head(ASSETS / "smollm2-135m-eagle3")
    H, g = head.cfg.hidden_size, torch.Generator().manual_seed(0)
    feats, emb, hidden = (torch.randn(1, 6, n * H, generator=g) for n in (3, 1, 1))
    pos = torch.arange(6)[None]

    def draft():  # the fused step and the layer, each from the same inputs
        return head.fuse(feats), head.forward_rows(emb, hidden, pos, [DraftKV(head.cfg, 16, torch.float32)], [6])

    with torch.inference_mode():
        exact = draft()
        on = head.use_amx_tiles(True)
        tiled = draft()
        assert on == (6 if amx_active() else 0)
        for a, b in zip(tiled, exact):
            if on:
                assert not torch.equal(a, b)
                torch.testing.assert_close(a, b, rtol=0.05, atol=0.02 * float(b.abs().max()))
            else:
                assert torch.equal(a, b)
        assert head.use_amx_tiles(False) == 0
        assert all(torch.equal(a, b) for a, b in zip(draft(), exact))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_heads_c_layer_equals_its_torch_layer_and_each_row_is_what_it_is_alone(tiny, tmp_path, kind):
    """forward_rows runs the head's layer in one C call (kernels/layer.py's head_layer): the same as the
    torch layer (sdpa) up to summation order, bitwise the same for a row whether it comes alone or beside
    others, and the keys it leaves in each cache are the torch layer's."""
    from specdec.kernels import layer as c_layer
    from specdec.proposers.head_io import load_head
    from specdec.cache.draft_kv import DraftKV

    d, plain = tiny
    head = load_head(random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0),
                     torch.float32)
    if c_layer._load() is None:
        pytest.skip("no compiled kernels")
    H, sizes, g = head.cfg.hidden_size, [1, 3, 2], torch.Generator().manual_seed(0)
    with torch.inference_mode():
        caches = [DraftKV(head.cfg, 64, torch.float32) for _ in sizes]
        for i, c in enumerate(caches):
            x = torch.randn(1, 5 + 3 * i, H, generator=g)
            head.forward_rows(x, x, torch.arange(x.shape[1])[None], [c], [x.shape[1]])
        lens = [c.length for c in caches]
        emb, hid = torch.randn(1, 6, H, generator=g), torch.randn(1, 6, H, generator=g)
        pos = torch.tensor([[5, 8, 9, 10, 11, 12]])
        both = head.forward_rows(emb, hid, pos, caches, sizes)
        assert [c.length for c in caches] == [n + L for n, L in zip(sizes, lens)]
        keys = [c.k[:, :, :c.length].clone() for c in caches]
        alone, torch_rows, start = [], [], 0
        for c, n, L, k in zip(caches, sizes, lens, keys):
            rows = slice(start, start + n)
            c.length = L
            alone.append(head.forward_rows(emb[:, rows], hid[:, rows], pos[:, rows], [c], [n]))
            c.length = L
            mask = torch.ones(n, L + n, dtype=torch.bool).tril(L)  # a mask: the torch layer
            torch_rows.append(head.forward_layer(emb[:, rows], hid[:, rows], pos[:, rows], c, mask=mask))
            torch.testing.assert_close(c.k[:, :, :c.length], k, rtol=0, atol=1e-5)
            start += n
    assert torch.equal(both, torch.cat(alone, dim=1))
    torch.testing.assert_close(both, torch.cat(torch_rows, dim=1), rtol=1e-4, atol=1e-4)
    assert not torch.equal(both, torch.cat(torch_rows, dim=1))  # the C layer did run (its own sums)

    # over MAX_ROWS tokens in all (a digest after a plain stretch): groups of whole rows, and a row over
    # MAX_ROWS through the torch layer, as alone
    from specdec.kernels import MAX_ROWS
    sizes = [40, MAX_ROWS + 6, 30, 1]
    with torch.inference_mode():
        caches = [DraftKV(head.cfg, 256, torch.float32) for _ in sizes]
        emb, hid = torch.randn(1, sum(sizes), H, generator=g), torch.randn(1, sum(sizes), H, generator=g)
        pos = torch.cat([torch.arange(n) for n in sizes])[None]
        both = head.forward_rows(emb, hid, pos, caches, sizes)
        alone, start = [], 0
        for c, n in zip(caches, sizes):
            c.length = 0
            rows = slice(start, start + n)
            alone.append(head.forward_rows(emb[:, rows], hid[:, rows], pos[:, rows], [c], [n]))
            start += n
    assert torch.equal(both, torch.cat(alone, dim=1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_chains_in_one_c_call_draft_what_the_loop_drafts(tiny, tmp_path, monkeypatch, dtype):
    """EAGLE-3's greedy chains go through one C call (head_chain.c: each depth's norm, LM head, argmax,
    embedding and layer) for the offline decoder's row and the serving engine's rows together, and so does
    the digest of the rows accepted before them: every proposal is the one the Python calls draft, and the
    outputs are plain decoding's (bf16: the target's embedding a bf16 table, widened as its rows() does)."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.kernels import layer as c_layer
    from specdec.llm import LLM
    if c_layer._load() is None:
        pytest.skip("no compiled kernels")
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    plain = plain if dtype == "float32" else LLM(str(d), dtype=dtype, progress=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [plain.tokenizer.encode(p) for p in ("Hello there, 1 2 3 4", "The cat sat on the mat", "a b c d e f")]
    c_calls = []

    def drafted(use_c: bool) -> tuple[list, list]:
        """Each run on a fresh LLM: the offline decoder keeps a prompt's prefix between requests."""
        spec = LLM(str(d), dtype=dtype, progress=False, speculative_config={
            "method": "eagle3", "model": str(head), "num_steps": 4, "num_speculative_tokens": 4})
        eagle = spec.proposer
        real_chains, real_digest, real_loop = eagle.head.draft_chains, eagle.head.digest, type(eagle)._greedy_chains
        proposals = []

        def chains_in_c(*args):  # use_c False: the C calls decline, the Python ones run
            c_calls.append(real_chains(*args) if use_c else None)
            return c_calls[-1]

        def digest_in_c(*args):
            c_calls.append(real_digest(*args) if use_c else None)
            return c_calls[-1]

        def recorded(states, ks):
            proposals.append([p.tokens for p in real_loop(eagle, states, ks)])
            return [Proposal(t) for t in proposals[-1]]

        monkeypatch.setattr(eagle.head, "draft_chains", chains_in_c)
        monkeypatch.setattr(eagle.head, "digest", digest_in_c)
        monkeypatch.setattr(eagle, "_greedy_chains", recorded)
        outs = [spec.generate_one(ids, params).token_ids for ids in prompts]
        engine = Engine(spec, EngineConfig(max_num_seqs=4, block_size=8))
        for i, ids in enumerate(prompts):
            engine.add_request(EngineRequest(str(i), ids, params))
        got = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.token_ids)
        return proposals, outs + [got[str(i)] for i in range(len(prompts))]

    with_c, outs_c = drafted(True)
    assert c_calls and all(c is not None for c in c_calls)  # the C calls did answer
    loop, outs_loop = drafted(False)
    assert any(len(rows) > 1 for rows in with_c)  # the engine's rows drafted together
    assert with_c == loop
    want = [plain.generate_one(ids, params).token_ids for ids in prompts]
    assert outs_c == outs_loop == want + want


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_tree_block_through_the_c_layer(tiny, tmp_path, kind, monkeypatch):
    """forward_tree (EAGLE-2's draft blocks) on the CPU: one C call whose rows read their root paths, as a
    verify pass's tree rows do. Each row is bitwise what its root path gives as a chain after the cache,
    and the block equals the torch layer with the mask spelled out up to summation order; with the C
    layer off, the torch layer runs (the negative control: not bitwise the C rows)."""
    from specdec.cache.draft_kv import DraftKV
    from specdec.kernels import layer as c_layer
    from specdec.proposers.head_io import load_head
    d, plain = tiny
    head = load_head(random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0),
                     torch.float32)
    if c_layer._load() is None:
        pytest.skip("no compiled kernels")
    H, g = head.cfg.hidden_size, torch.Generator().manual_seed(1)
    parents = [-1, -1, 0, 0, 1, 2]  # two roots; 2, 3 under 0; 4 under 1; 5 under 2
    depths = [1, 1, 2, 2, 2, 3]
    tree = torch.eye(6, dtype=torch.bool)  # [6, 6]: each row sees itself and its ancestors (a forest, as a block)
    for r, p in enumerate(parents):
        while p != -1:
            tree[r, p], p = True, parents[p]
    L = 7
    with torch.inference_mode():
        cache = DraftKV(head.cfg, 64, torch.float32)
        x = torch.randn(1, L, H, generator=g)
        head.forward_rows(x, x, torch.arange(L)[None], [cache], [L])
        emb, hid = torch.randn(1, 6, H, generator=g), torch.randn(1, 6, H, generator=g)
        pos = torch.tensor([[L - 1 + d for d in depths]])
        block = head.forward_tree(emb, hid, pos, cache, tree)
        assert cache.length == L + 6
        for r in range(6):  # row r's root path as a chain after the committed rows
            path = [j for j in range(6) if tree[r, j]]
            cache.length = L
            chain = head.forward_rows(emb[:, path], hid[:, path], pos[:, path], [cache], [len(path)])
            assert torch.equal(chain[0, -1], block[0, r]), r
        cache.length = L
        mask = torch.cat([torch.ones(6, L, dtype=torch.bool), tree], dim=1)
        torch_rows = head.forward_layer(emb, hid, pos, cache, mask=mask)
        torch.testing.assert_close(block, torch_rows, rtol=1e-4, atol=1e-4)
        cache.length = L
        monkeypatch.setattr("specdec.proposers.heads.head_layer", lambda *a, **k: None)  # no C layer
        fallback = head.forward_tree(emb, hid, pos, cache, tree)
        assert torch.equal(fallback, torch_rows) and not torch.equal(fallback, block)


def test_sampling_is_seeded(tiny, tmp_path):
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    for shape, budget in zip(SHAPES[:2], (4, 7)):  # fixed k: adaptive k depends on measured time
        spec = LLM(str(d), dtype="float32", progress=False,
                   speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": budget, **shape})
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=7, ignore_eos=True)
        ids = plain.tokenizer.encode("Once upon a time")
        a, b = spec.generate_one(ids, params).token_ids, spec.generate_one(ids, params).token_ids
        assert a == b and len(a) == 16


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_incremental_draft_matches_training_unroll(tiny, tmp_path, kind):
    """The proposer's catch-up + chain drafting (KV cache, positions) == eagle_unroll's steps."""
    from specdec.llm import LLM
    from specdec.spec.proposer import RequestState, TargetOutput
    from specdec.train.unroll import eagle_unroll

    d, plain = tiny
    target = plain.model
    head_dir = random_head(target, kind, tmp_path / "head")
    spec = LLM(str(d), dtype="float32", progress=False,
               speculative_config={"method": kind, "model": str(head_dir), "num_steps": 3})
    prop = spec.proposer
    tokens = plain.tokenizer.encode("a b c d e f g h i j k l")
    N = len(tokens)
    fwd = target(torch.tensor([tokens]), torch.arange(N)[None], target.new_cache(N),
                 output_layers=prop.feature_layers)
    # commit positions 0..n-1 (next tokens 1..n); the draft's g then predicts token n + 1
    n = N - 4
    state = RequestState(tokens[:n], SamplingParams(temperature=0.0))
    state.output_ids = [tokens[n]]
    prop.begin(state, TargetOutput(fwd, list(range(n))))
    with torch.inference_mode():
        prop._flush([state])  # the head digests queued features when it next drafts
    hidden = fwd.hidden[:, :N - 1]
    aux = torch.cat([fwd.layer_hidden[l][:, :N - 1] for l in prop.feature_layers], -1) if kind == "eagle3" else None
    with torch.inference_mode():
        logits, _ = eagle_unroll(prop.head, target.embed.weight, target.lm_head.weight[prop.draft_ids],
                                 torch.tensor([tokens]), hidden, aux, 3)
    with torch.inference_mode():
        g = state.draft["g"][0]
        torch.testing.assert_close(prop.head.logits(g, target.lm_head.weight)[0], logits[0][0, n - 1], atol=1e-4, rtol=1e-4)
        # depth 2 of a chain that drafted the true token x_{n+1}: == unroll step 1 at position n
        out = prop._forward_nodes(state, [tokens[n + 1]], g, [1], None)
        torch.testing.assert_close(prop.head.logits(out, target.lm_head.weight)[0], logits[1][0, n], atol=1e-4, rtol=1e-4)
        out2 = prop._forward_nodes(state, [tokens[n + 2]], out, [2], None)
        torch.testing.assert_close(prop.head.logits(out2, target.lm_head.weight)[0], logits[2][0, n + 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["chain", "tree3x3"])
def test_first_digest_keeps_the_newest_prompt_rows_at_their_positions(tiny, tmp_path, monkeypatch, kind, shape):
    """A prompt longer than PROMPT_WINDOW: the head's first digest is its newest PROMPT_WINDOW rows, at
    their true positions (row 0 at position len - window), and the output is still plain decoding's."""
    from specdec.llm import LLM
    from specdec.proposers import eagle, eagle_rows
    monkeypatch.setattr(eagle_rows, "PROMPT_WINDOW", 6)
    commits = []
    original = eagle._EagleBase._commit

    def record(self, work):
        commits.extend((state.draft["offset"], state.draft["len"], len(next_tokens)) for state, _, next_tokens in work)
        original(self, work)

    monkeypatch.setattr(eagle._EagleBase, "_commit", record)
    d, plain = tiny
    head = random_head(plain.model, kind, tmp_path / "head", draft_vocab=512 if kind == "eagle3" else 0)
    spec = LLM(str(d), dtype="float32", progress=False,
               speculative_config={"method": kind, "model": str(head), "num_speculative_tokens": 3, **shape})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = plain.tokenizer.encode("Hello there, 1 2 3 4 5 6 7 8 9 10 11 12, and again 1 2 3 4 5 6")
    assert len(ids) > 12
    r = spec.generate_one(ids, params)
    assert r.token_ids == plain.generate_one(ids, params).token_ids and r.metrics.num_drafts > 0
    assert commits[0] == (len(ids) - 6, 0, 6)  # the first digest: 6 rows, row 0 at position len(ids) - 6
    assert all(off == len(ids) - 6 for off, _, _ in commits)  # later rows follow at offset + len


def test_a_long_plain_stretch_restarts_the_head_from_its_newest_rows(tiny, tmp_path, monkeypatch):
    """Rows queued while nothing is drafted (adaptive k held at 0 for steps 2-20) stay within
    PROMPT_WINDOW; past it the head restarts from the newest rows at their true positions, and the output
    is still plain decoding's. (Unbounded, a busy server's rows queued features for every step.)"""
    from specdec.llm import LLM
    from specdec.proposers import eagle, eagle_rows
    from specdec.spec.adaptive import AdaptiveK, Choice
    monkeypatch.setattr(eagle_rows, "PROMPT_WINDOW", 6)
    choose = AdaptiveK.choose

    def held(self, *args, **kwargs):
        choice = choose(self, *args, **kwargs)
        return Choice(0, False) if 2 <= self.steps <= 20 else Choice(max(choice.k, 2), False)

    monkeypatch.setattr(AdaptiveK, "choose", held)
    commits, queued = [], []
    original_commit, original_trim = eagle._EagleBase._commit, eagle_rows.trim_pending

    def record(self, work):
        commits.extend((state.draft["offset"], state.draft["len"], len(next_tokens)) for state, _, next_tokens in work)
        original_commit(self, work)

    def trim(st):
        original_trim(st)
        queued.append(sum(len(toks) for _, toks in st["pending"]))

    monkeypatch.setattr(eagle._EagleBase, "_commit", record)
    monkeypatch.setattr(eagle_rows, "trim_pending", trim)
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={"method": "eagle3", "model": str(head)})
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ids = plain.tokenizer.encode("Hello there, 1 2 3 4 5 6 7 8 9 10 11 12, and again 1 2 3 4 5 6")
    r = spec.generate_one(ids, params)
    assert r.token_ids == plain.generate_one(ids, params).token_ids
    assert max(queued) <= 6 and len(queued) > 20  # every queued step trimmed to the window
    first, restart = commits[0], commits[1]  # the prompt's window; the first digest after the stretch
    assert first == (len(ids) - 6, 0, 6) and restart[1] == 0 and restart[2] == 6
    assert restart[0] >= first[0] + 6 + 19 - 6  # past the stretch's 19+ rows, keeping its newest 6
    assert all(off == restart[0] for off, _, _ in commits[2:])  # then it continues from there


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_drafting_path_equals_the_training_path(tiny, tmp_path, kind, saved):
    """Drafting (no autograd) runs the head's q/k/v and gate/up as stacked matmuls through the C
    kernels (bf16-stored where the saved head is bf16); training runs the modules. Same outputs, and
    the stacked weights follow an update."""
    from specdec.proposers.head_io import load_head, save_head
    from specdec.proposers.head_layer import stacked_weight
    from specdec.quant.bf16 import Bf16Weight
    target = tiny[1].model
    head_dir = random_head(target, kind, tmp_path / "head", draft_vocab=64)
    save_head(load_head(head_dir), head_dir, saved)
    head = load_head(head_dir, torch.float32)
    H, lm = target.config.hidden_size, target.lm_head.weight
    gen = torch.Generator().manual_seed(1)
    emb, hid = torch.randn(1, 5, H, generator=gen), torch.randn(1, 5, H, generator=gen)
    pos = torch.arange(5)[None]

    def both():
        with torch.enable_grad():
            train = head.logits(head.forward_layer(emb, hid, pos), lm)
        with torch.inference_mode():
            draft = head.logits(head.forward_layer(emb, hid, pos), lm)
        return train, draft

    train, draft = both()
    torch.testing.assert_close(draft, train, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        stored = stacked_weight(head.layer.mlp, ("gate_proj", "up_proj"))
    assert isinstance(stored, Bf16Weight) == (saved is torch.bfloat16)
    with torch.no_grad():  # as an optimizer step would: in place
        head.layer.self_attn.k_proj.weight.mul_(-1.5)
        head.layer.mlp.up_proj.weight.add_(0.05)
    train2, draft2 = both()
    assert not torch.allclose(train2, train, atol=1e-3)
    torch.testing.assert_close(draft2, train2, atol=1e-5, rtol=1e-5)
