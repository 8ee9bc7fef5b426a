"""Token-tree verification: positions, masks, greedy path selection, and tree proposals on a tiny
model reproducing plain greedy decoding token for token (the KV cache keeps only the accepted path)."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.config import SpeculativeConfig
from specdec.sampling_params import SamplingParams
from specdec.spec.proposer import Proposal, Proposer
from specdec.spec.tree import children_of, tree_mask, tree_positions, verify_tree

GREEDY = SamplingParams(temperature=0.0)


def test_positions_and_mask():
    parents = [-1, -1, 0, 0, 2]
    assert tree_positions(parents).tolist() == [0, 1, 1, 2, 2, 3]
    m = tree_mask(parents)
    assert m[0].tolist() == [True, False, False, False, False, False]
    assert m[5].tolist() == [True, True, False, True, False, True]  # root, node 0, node 2, itself
    assert m[2].tolist() == [True, False, True, False, False, False]
    assert children_of(parents) == [[1, 2], [3, 4], [], [5], [], []]
    with pytest.raises(ValueError):
        tree_positions([-1, 2, 0])  # a parent after its child


def _onehot_logits(argmax_per_row: list[int], V: int = 20) -> torch.Tensor:
    logits = torch.zeros(len(argmax_per_row), V)
    logits[torch.arange(len(argmax_per_row)), torch.tensor(argmax_per_row)] = 5.0
    return logits


def test_greedy_tree_follows_argmax():
    # root -> {a=3, b=4}; a -> {c=7, d=8}; c -> {e=9}
    prop = Proposal([3, 4, 7, 8, 9], None, [-1, -1, 0, 0, 2])
    # the target: after root 4 (b), after b 1; after a 8 (d); after d 2
    verdict, rows = verify_tree(prop, _onehot_logits([3, 8, 1, 0, 2, 0]), GREEDY, None)
    assert rows == [0, 1, 4] and verdict.tokens == [3, 8, 2] and verdict.num_accepted == 2
    verdict, rows = verify_tree(prop, _onehot_logits([5, 0, 0, 0, 0, 0]), GREEDY, None)
    assert rows == [0] and verdict.tokens == [5]
    verdict, rows = verify_tree(prop, _onehot_logits([3, 7, 0, 9, 0, 11]), GREEDY, None)
    assert rows == [0, 1, 3, 5] and verdict.tokens == [3, 7, 9, 11]  # the whole path plus the bonus


class RandomTreeProposer(Proposer):
    """Random trees that contain the target's greedy continuation at random depths (an oracle),
    so acceptance is partial: exercises accept, reject and KV compaction."""

    def __init__(self, reference: list[int], prompt_len: int, seed: int):
        self.ref, self.n0, self.rng = reference, prompt_len, random.Random(seed)

    def propose(self, state, k):
        pos = len(state.output_ids)  # ref[pos] is the next greedy token
        tokens, parents = [], []
        frontier = [-1]
        for depth in range(self.rng.randint(1, 4)):
            new = []
            for par in frontier:
                for _ in range(self.rng.randint(1, 3)):
                    good = pos + depth < len(self.ref) and self.rng.random() < 0.6
                    tokens.append(self.ref[pos + depth] if good and _ == 0 else self.rng.randrange(49152))
                    parents.append(par)
                    new.append(len(tokens) - 1)
            frontier = new[:2]
        return Proposal(tokens[:k], None, parents[:k])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_trees_reproduce_greedy(tiny_dir, arch):
    from specdec.model.loader import load_model
    from specdec.model.tokenizer import Tokenizer
    from specdec.spec.decoder import SpeculativeDecoder

    d = tiny_dir(arch)
    model, tok = load_model(d, torch.float32, 256), Tokenizer(d)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog because")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = SpeculativeDecoder(model, tok).generate(prompt, params).token_ids
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=12)
    for seed in range(3):
        dec = SpeculativeDecoder(model, tok, RandomTreeProposer(ref, len(prompt), seed), cfg)
        r = dec.generate(prompt, params)
        assert r.token_ids == ref
        assert r.metrics.num_accepted_tokens > 0
