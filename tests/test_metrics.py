"""Speculative metrics: tau, acceptance by position, and lookup chains counted by match length."""
from specdec.spec.metrics import SpecMetrics


def test_lookup_steps_are_counted_by_match_length():
    m = SpecMetrics()
    m.record(0, 0, 1)  # a plain step
    m.record(4, 2, 3)  # a model drafter's step
    m.record(3, 3, 4, match_len=2)
    m.record(3, 0, 1, match_len=2)
    m.record(5, 5, 6, match_len=11)  # >= 8 tokens share one row
    assert m.target_passes == 5 and m.num_drafts == 4 and m.num_draft_tokens == 15 and m.num_accepted_tokens == 10
    assert m.by_match_length == {2: [2, 6, 3], 8: [1, 5, 5]}
    d = m.to_dict()
    assert d["lookup_by_match_length"] == {"2": {"drafts": 2, "draft_tokens": 6, "acceptance_rate": 0.5},
                                           "8": {"drafts": 1, "draft_tokens": 5, "acceptance_rate": 1.0}}
    assert d["mean_acceptance_length"] == 1 + 10 / 4 and d["acceptance_by_position"][:3] == [0.75, 0.75, 0.5]
    other = SpecMetrics()
    other.record(2, 1, 2, match_len=2)
    m.merge(other)
    assert m.by_match_length[2] == [3, 8, 4] and m.num_drafts == 5
    assert "lookup_by_match_length" not in SpecMetrics().to_dict()  # no lookup, no table
