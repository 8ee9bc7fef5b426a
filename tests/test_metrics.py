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


def test_n_samples_report_each_and_their_sum(tiny_dir):
    """LLM.generate with n > 1: each sample carries its own metrics, the request the sum over all n."""
    from specdec import LLM, SamplingParams
    llm = LLM(str(tiny_dir("llama")), speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              dtype="float32", max_model_len=128, progress=False)
    out = llm.generate("one two three one two three one two", SamplingParams(temperature=0.8, seed=3, n=2,
                                                                             max_tokens=12, ignore_eos=True))[0]
    per = [o.metrics for o in out.outputs]
    assert len(per) == 2 and all(m["target_forward_passes"] >= 1 for m in per)
    assert out.metrics["target_forward_passes"] == sum(m["target_forward_passes"] for m in per)
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert out.metrics["speculative"][key] == sum(m["speculative"][key] for m in per)


def test_a_tree_counts_positions_by_depth_not_by_node():
    """A 9-node tree 3 deep counted positions 0-8 as drafted, positions 3-8 never accepted (no path is
    that deep): acceptance by position read as falling to 0 after the tree's depth. Now a tree's pass
    drafts its depth's positions; the acceptance rate stays accepted over drafted nodes."""
    from specdec.spec.proposer import Proposal

    tree = Proposal(list(range(9)), parents=[-1, -1, -1, 0, 0, 1, 3, 3, 4])  # depths 1,1,1,2,2,2,3,3,3
    chain = Proposal([5, 6, 7])
    assert tree.depth == 3 and chain.depth == 3 and Proposal([]).depth == 0
    m = SpecMetrics()
    m.record(len(tree), 2, 3, depth=tree.depth)
    m.record(len(chain), 3, 4, depth=chain.depth)
    assert m.drafted_per_pos == [2, 2, 2] and m.accepted_per_pos == [2, 2, 1]
    assert m.acceptance_rate == 5 / 12 and m.mean_acceptance_length == 1 + 5 / 2

