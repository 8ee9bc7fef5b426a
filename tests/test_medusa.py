"""Medusa: the static tree from measured head accuracy, and greedy equivalence on a tiny model."""
from __future__ import annotations

import pytest
import torch

from specdec.proposers.medusa import static_tree, tree_parents
from specdec.sampling_params import SamplingParams


def test_static_tree_from_accuracy():
    acc = [[0.6, 0.1], [0.4, 0.1]]
    paths = static_tree(acc, 3)
    assert paths == [(0,), (0, 0), (1,)]  # most likely first: 0.6, 0.24, 0.1
    assert tree_parents(paths) == [-1, 0, -1]
    assert static_tree(acc, 2) == paths[:2]  # a cut keeps the likely path, not the unlikely shallow node
    big = static_tree([[0.7, 0.2, 0.05]] * 4, 20)
    assert len(big) == 20 and all(p[:-1] in big[:i] for i, p in enumerate(big) if len(p) > 1)  # parents first


@pytest.mark.parametrize("nodes", [3, 5, 10])
def test_medusa_reproduces_greedy(tiny_dir, tmp_path, nodes):
    from specdec.llm import LLM
    from specdec.proposers.head_io import make_head, save_head
    from specdec.proposers.heads import HeadConfig

    d = tiny_dir("llama")
    plain = LLM(str(d), dtype="float32", progress=False)
    torch.manual_seed(0)
    cfg = HeadConfig.for_target("medusa", plain.model.config, 256, 3)
    head = make_head(cfg)
    with torch.no_grad():
        for blk in head.blocks:
            blk.layers[0].weight.normal_(0, 0.05)
    head.set_vocab(torch.randperm(cfg.vocab_size)[:256].sort().values)
    head.cfg = HeadConfig(**{**cfg.__dict__, "medusa_accuracy": ((0.5, 0.2, 0.1), (0.3, 0.1, 0.1), (0.2, 0.1, 0.1))})
    path = save_head(head, tmp_path / "medusa", torch.float32)
    spec = LLM(str(d), dtype="float32", progress=False,
               speculative_config={"method": "medusa", "model": str(path), "num_draft_tokens": nodes + 1})
    assert len(spec.proposer.paths) == nodes
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ids = plain.tokenizer.encode("The weather today is")
    assert spec.generate_one(ids, params).token_ids == plain.generate_one(ids, params).token_ids
    # a seed reproduces a run at fixed k (adaptive k depends on measured time, and so do the draws)
    fixed = LLM(str(d), dtype="float32", progress=False, speculative_config={
        "method": "medusa", "model": str(path), "num_draft_tokens": nodes + 1, "num_speculative_tokens": nodes})
    sampled = SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
    assert fixed.generate_one(ids, sampled).token_ids == fixed.generate_one(ids, sampled).token_ids


def test_draft_rows_are_gathered_once_and_follow_the_vocabulary():
    """The restricted LM head is cached across calls and refreshed when the vocabulary changes."""
    from specdec.proposers.head_io import make_head
    from specdec.proposers.heads import HeadConfig, draft_rows

    cfg = HeadConfig("medusa", hidden_size=8, vocab_size=20, draft_vocab_size=5, medusa_num_heads=2)
    head, lm = make_head(cfg), torch.randn(20, 8)
    head.set_vocab(torch.tensor([1, 3, 5, 7, 9]))
    first = draft_rows(head, lm)
    assert torch.equal(first, lm[[1, 3, 5, 7, 9]]) and draft_rows(head, lm) is first
    head.set_vocab(torch.tensor([0, 2, 4, 6, 8]))
    assert torch.equal(draft_rows(head, lm), lm[[0, 2, 4, 6, 8]])
    h = torch.randn(3, 8)
    assert head(h, lm, 1).shape == (1, 3, 5)
    torch.testing.assert_close(head(h, lm)[1], head.blocks[1](h) @ lm[[0, 2, 4, 6, 8]].t())
