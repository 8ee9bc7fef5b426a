"""EAGLE-2's dynamic tree from an EAGLE-3 head in one C call (kernels/head_tree.c): the same nodes as the
Python tree (eagle_tree.dynamic_tree), their values within rounding (the C log-softmax is its own), for the
offline decoder's requests in fp32 and bf16; greedy outputs stay plain decoding's; and where the C call does
not apply (a top-k above topk.c's limit) the Python tree drafts."""
from __future__ import annotations

import pytest
import torch

from specdec.proposers import eagle_tree
from specdec.proposers.eagle_tree import rerank
from specdec.sampling_params import SamplingParams
from tests.heads import random_head

TREE = {"eagle_topk": 3, "num_steps": 4, "num_draft_tokens": 10, "num_speculative_tokens": 9}  # k fixed: every step drafts


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from specdec.llm import LLM
    d = tiny_dir("llama")
    return d, LLM(str(d), dtype="float32", progress=False)


def _nodes_both_ways(spec, monkeypatch) -> list[tuple]:
    """Every C tree of the spec LLM's proposer beside the Python tree drafted from the same state."""
    eagle = spec.proposer
    real = eagle.head.draft_tree
    pairs = []

    def python_nodes(g, cache, start, topk, depths):
        got = {}

        def keep(tok, par, val, budget):  # dynamic_tree's nodes, before its rerank
            got["nodes"] = (tok, par, val)
            return rerank(tok, par, val, budget)

        def forward(tokens, parent_outs, depths_, tree):
            emb = eagle.embed(torch.tensor(tokens))[None]
            pos = (start + torch.tensor(depths_) - 1)[None]
            return eagle.head.forward_tree(emb, eagle.head.step_input(emb, parent_outs[None]), pos, cache, tree)[0]

        eagle_tree.rerank = keep
        try:
            eagle_tree.dynamic_tree(eagle._logprobs(g[None])[0], g, cache.length, cache, 100, topk, depths,
                                    eagle.draft_ids, forward, eagle._logprobs)
        finally:
            eagle_tree.rerank = rerank
        return got["nodes"]

    def both(g, cache, start, topk, depths, embed, draft_ids):
        committed = cache.length
        nodes = real(g, cache, start, topk, depths, embed, draft_ids)
        cache.length = committed
        pairs.append((nodes, python_nodes(g, cache, start, topk, depths)))
        cache.length = committed
        return nodes

    monkeypatch.setattr(eagle.head, "draft_tree", both)
    return pairs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_c_tree_drafts_the_python_trees_nodes(tiny, tmp_path, monkeypatch, dtype):
    from specdec.kernels import layer as c_layer
    from specdec.llm import LLM
    if c_layer._load() is None:
        pytest.skip("no compiled kernels")
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype=dtype, progress=False, speculative_config={"method": "eagle3", "model": str(head), **TREE})
    plain = plain if dtype == "float32" else LLM(str(d), dtype=dtype, progress=False)
    pairs = _nodes_both_ways(spec, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for text in ("Hello there, 1 2 3 4", "The cat sat on the mat", "a b c d e f"):
        ids = plain.tokenizer.encode(text)
        assert spec.generate_one(ids, params).token_ids == plain.generate_one(ids, params).token_ids
    assert len(pairs) >= 10 and all(c is not None for c, _ in pairs)  # the C call answered every tree
    assert any(len(c[0]) == 3 + 3 * 9 for c, _ in pairs)  # 4 depths (fewer near max_tokens: k is capped)
    for (tok, par, val), (want_tok, want_par, want_val) in pairs:
        assert tok == want_tok and par == want_par
        assert max(abs(a - b) for a, b in zip(val, want_val)) < 1e-4


def test_a_top_k_past_the_kernels_limit_drafts_in_python(tiny, tmp_path, monkeypatch):
    """The negative control: topk 9 is past head_tree.c's 8, so the C call declines and the Python tree
    drafts (outputs still plain decoding's)."""
    from specdec.llm import LLM
    d, plain = tiny
    head = random_head(plain.model, "eagle3", tmp_path / "head", draft_vocab=512)
    spec = LLM(str(d), dtype="float32", progress=False, speculative_config={
        "method": "eagle3", "model": str(head), "eagle_topk": 9, "num_steps": 2, "num_draft_tokens": 12})
    answers, python_trees = [], []
    real_c, real_py = spec.proposer.head.draft_tree, eagle_tree.dynamic_tree
    monkeypatch.setattr(spec.proposer.head, "draft_tree", lambda *a: answers.append(real_c(*a)) or answers[-1])
    monkeypatch.setattr("specdec.proposers.eagle.dynamic_tree", lambda *a: python_trees.append(1) or real_py(*a))
    ids = plain.tokenizer.encode("Hello there, 1 2 3 4")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert spec.generate_one(ids, params).token_ids == plain.generate_one(ids, params).token_ids
    assert answers and all(a is None for a in answers) and len(python_trees) == len(answers)


def test_an_eagle3_config_without_a_shape_gets_a_tree_on_amx_tiles():
    """with_hardware_defaults: on AMX tiles an eagle3 config naming no draft shape (nor a fixed k) becomes
    the 3 x 3 / 9 EAGLE-2 tree; any shape key, a fixed k, another method or no tiles leave it as given."""
    from specdec.config import AMX_EAGLE3_TREE, SpeculativeConfig, with_hardware_defaults

    bare = {"method": "eagle3", "lookup": "ngram"}
    tree = SpeculativeConfig.from_dict(with_hardware_defaults(bare, amx=True))
    assert (tree.eagle_topk, tree.num_steps, tree.num_draft_tokens, tree.k_max) == (3, 3, 9, 8)
    assert with_hardware_defaults(bare, amx=False) is bare
    for given in ({"method": "eagle3", "eagle_topk": 1}, {"method": "eagle3", "num_steps": 5},
                  {"method": "eagle3", "num_speculative_tokens": 4}, {"method": "eagle"}, {"method": "ngram"}):
        assert with_hardware_defaults(given, amx=True) is given
    assert with_hardware_defaults(None, amx=True) is None and set(AMX_EAGLE3_TREE) <= set(tree.__dict__)


def test_an_llm_and_a_servers_request_on_amx_tiles_draft_the_tree(smollm_dir):
    """Where the CPU has AMX (bf16): LLM(..., amx=True) with {"method": "eagle3"} drafts EAGLE-2 trees, and so
    does a server request asking for eagle3 by name; without the tiles, chains."""
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.kernels import amx_active
    from specdec.llm import LLM
    if not amx_active():
        pytest.skip("no AMX tiles here")
    llm = LLM(str(smollm_dir), dtype="bfloat16", amx=True, progress=False, max_model_len=256,
              speculative_config={"method": "eagle3"})
    assert llm.speculative_config.eagle_topk == 3 and llm.proposer.topk == 3
    engine = Engine(llm, EngineConfig(max_num_seqs=2, profile_cost=False, request_methods=("eagle3+ngram",)))
    assert engine.resolve_spec({"method": "eagle3+ngram"}).proposer.model.topk == 3
    plain = LLM(str(smollm_dir), dtype="bfloat16", amx=False, progress=False, max_model_len=256,
                speculative_config={"method": "eagle3"})
    assert plain.speculative_config.eagle_topk == 1


def test_the_bench_gives_its_eagle3_systems_the_shape_an_llm_would(tiny, monkeypatch):
    """The bench builds its decoders without LLM: its eagle3 systems take the same hardware default (and
    report it in their config), a tree on AMX tiles, a chain elsewhere, a named shape as named."""
    from specdec.bench import systems
    d, plain = tiny
    monkeypatch.setattr(systems, "on_tiles", lambda model: True)
    tree = systems.SpecdecSystem(plain.model, plain.tokenizer, d, "eagle3+ngram")
    assert tree.config == {"method": "eagle3", "lookup": "ngram", "eagle_topk": 3, "num_steps": 3,
                           "num_draft_tokens": 9}
    named = systems.SpecdecSystem(plain.model, plain.tokenizer, d, "eagle3", spec={"eagle_topk": 1})
    assert named.config == {"method": "eagle3", "eagle_topk": 1}
    monkeypatch.setattr(systems, "on_tiles", lambda model: False)
    assert systems.SpecdecSystem(plain.model, plain.tokenizer, d, "eagle3").config == {"method": "eagle3"}
