"""The draft vocabulary of an EAGLE-3 head: ranked from token counts, and grown from a trained head
(its old rows kept, the new tokens' rows the target's carried through a least-squares map)."""
from __future__ import annotations

import pytest
import torch

from specdec.proposers.head_io import make_head
from specdec.proposers.heads import HeadConfig
from specdec.train.vocab import fit_row_map, grow_vocab, rank_vocab

H, V = 16, 64


def _head(draft_vocab_size: int = 20, kind: str = "eagle3"):
    torch.manual_seed(0)
    cfg = HeadConfig(kind, H, V, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                     draft_vocab_size=draft_vocab_size, aux_layers=(0, 1, 2) if kind == "eagle3" else ())
    head = make_head(cfg)
    if draft_vocab_size:
        head.set_vocab(torch.arange(0, 3 * draft_vocab_size, 3))
    return head


def test_rank_vocab_keeps_then_always_then_counts():
    counts = torch.tensor([5, 9, 9, 0, 7, 1, 9, 2])
    assert rank_vocab(counts, 3).tolist() == [1, 2, 6]  # ties: the lower id first
    assert rank_vocab(counts, 3, always=[3]).tolist() == [1, 2, 3]
    assert rank_vocab(counts, 4, always=[3], keep=torch.tensor([0, 5])).tolist() == [0, 1, 3, 5]
    # a kept token outranks an always one: growing by one keeps every kept token
    assert rank_vocab(counts, 3, always=[3, 7], keep=torch.tensor([0, 5])).tolist() == [0, 5, 7]  # 7: counted 2
    with pytest.raises(ValueError, match="shrink"):
        rank_vocab(counts, 1, keep=torch.tensor([0, 5]))


def test_grown_head_keeps_its_logits_and_maps_the_new_rows():
    head = _head()
    target = torch.randn(V, H)
    A = torch.randn(H, H) / H ** 0.5
    with torch.no_grad():  # a head whose rows are exactly the target's through A: the map must find A
        head.lm_head.weight.copy_(target[head.draft_ids] @ A)
    torch.testing.assert_close(fit_row_map(target[head.draft_ids], head.lm_head.weight), A, rtol=1e-4, atol=1e-4)
    new_ids = torch.arange(40)  # lacks the head's tokens 42, 45, ..., 57
    with pytest.raises(ValueError, match="lacks"):
        grow_vocab(head, target, new_ids)
    new_ids = torch.tensor(sorted(set(head.draft_ids.tolist()) | {1, 2, 4, 63}))
    grown = grow_vocab(head, target, new_ids)
    assert grown.cfg.draft_vocab_size == 24 and torch.equal(grown.draft_ids, new_ids)
    assert bool(grown.t2d[new_ids].all()) and int(grown.t2d.sum()) == 24
    old = torch.searchsorted(new_ids, head.draft_ids)
    assert torch.equal(grown.lm_head.weight[old], head.lm_head.weight)  # old rows exactly as they were
    torch.testing.assert_close(grown.lm_head.weight, target[new_ids] @ A, rtol=1e-4, atol=1e-4)
    for k, v in head.state_dict().items():  # every other weight as it was
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(v, grown.state_dict()[k]), k
    out = torch.randn(5, H)
    torch.testing.assert_close(grown.logits(out)[:, old], head.logits(out))  # old tokens' logits unmoved


def test_only_a_reduced_eagle3_vocabulary_grows():
    with pytest.raises(ValueError, match="EAGLE-3"):
        grow_vocab(_head(0), torch.randn(V, H), torch.arange(V))
    with pytest.raises(ValueError, match="EAGLE-3"):
        grow_vocab(_head(20, "eagle"), torch.randn(V, H), torch.arange(30))
