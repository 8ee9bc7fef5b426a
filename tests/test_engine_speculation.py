"""The batch cost model and the choice of K (speculation backs off as the batch grows); prefill packing."""
from __future__ import annotations

from types import SimpleNamespace

from specdec.engine.speculation import (MAX_PROBE_INTERVAL, PROBE_INTERVAL, BatchCost, Speculation, expected_tokens,
                                       first_path)
from specdec.spec.proposer import Proposal
from specdec.spec.adaptive import ProbeBackoff, StepOverhead


def cpu_like_cost() -> BatchCost:
    """Flat (memory-bound) up to 16 token rows, then linear (compute-bound): c(N) = max(1, N / 16)."""
    cost = BatchCost()
    for n in (1, 2, 4, 8, 16, 32, 64):
        cost.seconds[n] = max(1.0, n / 16)
    return cost


def cpu_like_speculation() -> Speculation:
    """The choice of K alone: no model, no proposers."""
    spec = Speculation.__new__(Speculation)
    spec.cost, spec.overhead = cpu_like_cost(), StepOverhead()
    spec.probes = ProbeBackoff(PROBE_INTERVAL, MAX_PROBE_INTERVAL)  # the engine's
    spec.pool, spec.propose_seconds = None, 0.0
    return spec


def rows(batch: int, acceptance: float, cap: int = 8, draft_yield: float = 1.0):
    proposer = SimpleNamespace(draft_cost_per_token=0.0)
    seqs = [SimpleNamespace(adaptive=SimpleNamespace(acceptance=acceptance), draft_yield=draft_yield,
                            spec=SimpleNamespace(proposer=proposer, fixed_k=False)) for _ in range(batch)]
    return seqs, [cap] * batch


def test_cost_interpolates_and_extrapolates():
    cost = cpu_like_cost()
    assert cost.estimate(12) == 1.0 and cost.estimate(48) == 3.0 and cost.estimate(128) == 8.0
    cost.observe(4, 3.0)  # three times slower than profiled: the whole curve moves, by an EMA step
    assert 1.0 < cost.estimate(4) < 3.0 and cost.estimate(64) / cost.estimate(4) == 4.0


def test_k_backs_off_as_the_batch_grows():
    spec = cpu_like_speculation()
    ks = [spec.choose_k(*rows(b, acceptance=0.7)) for b in (1, 2, 4, 8, 16, 32)]
    assert ks[0] >= 4 and ks == sorted(ks, reverse=True) and ks[-1] == 0
    # a poor drafter gets shorter drafts at the same batch size
    assert spec.choose_k(*rows(4, acceptance=0.2)) < spec.choose_k(*rows(4, acceptance=0.8))
    # rows that may not draft (cap 0) never make the batch speculate
    assert spec.choose_k(*rows(4, acceptance=0.9, cap=0)) == 0
    # alone, a row that rarely has a draft still speculates (an empty draft costs nothing) ...
    assert spec.choose_k(*rows(1, acceptance=0.5, draft_yield=0.1)) >= 1
    # ... but in a large batch its rare drafts would pad every row: off
    assert spec.choose_k(*rows(16, acceptance=0.5, draft_yield=0.1)) == 0
    # a long run of plain batches is broken by probes of the whole batch, further apart while they lose
    # (12 rows: drafts that were all accepted would pay, so the acceptance a probe measures matters)
    spec = cpu_like_speculation()
    ks = [spec.choose_k(*rows(12, acceptance=0.1)) for _ in range(250)]
    probes = [i for i, k in enumerate(ks) if k == 1]
    assert len(probes) == 3 and [b - a for a, b in zip(probes, probes[1:])] == [64, 128]


def test_no_probe_where_even_accepted_drafts_would_not_pay():
    """32 rows on the compute-bound part of the curve (a pass over 2 x 32 rows costs twice one over 32), or
    a drafter whose own cost outweighs a plain step: no acceptance could make drafting pay, so no probe
    in the first 500 batches (the longest wait, 512); a cheap drafter at the same batch size is still probed."""
    for batch, draft_cost in ((32, 0.0), (12, 0.5)):
        spec = cpu_like_speculation()
        seqs, caps = rows(batch, acceptance=0.1)
        seqs[0].spec.proposer.draft_cost_per_token = draft_cost  # every row shares the proposer
        assert all(spec.choose_k(seqs, caps) == 0 for _ in range(500))
    spec = cpu_like_speculation()
    assert 1 in [spec.choose_k(*rows(12, acceptance=0.1)) for _ in range(250)]


def test_expected_tokens_and_tree_path():
    assert expected_tokens(0.0, 4) == 1.0 and abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    tree = Proposal([10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 2])
    assert first_path(tree).tokens == [10, 12, 14] and first_path(tree).probs is None


def test_prefill_chunks_are_packed_with_little_padding():
    from specdec.engine.model_runner import pack_rows

    class R:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    groups = pack_rows([R(n) for n in (30, 200, 8, 180, 6)])
    assert [[len(r) for r in g] for g in groups] == [[200, 180], [30], [8, 6]]


def test_measured_step_overhead_turns_batched_speculation_off():
    """Drafting steps that cost a lot outside the forward (slow drafting, verification) lose to plain."""
    spec = cpu_like_speculation()
    assert spec.choose_k(*rows(1, acceptance=0.5)) >= 1
    for _ in range(20):
        spec.observe_overhead(1, drafted=True, seconds=2.0)  # 2x a whole forward, per drafting step
        spec.observe_overhead(1, drafted=False, seconds=0.01)
    assert spec.choose_k(*rows(1, acceptance=0.5)) == 0


def test_profile_runs_the_engines_paged_path(tiny_dir, monkeypatch):
    """c(N) is profiled through BatchKV (the engine's kernels), not the single-sequence static cache."""
    import torch

    from specdec.cache import paged_cache
    from specdec.model.loader import load_model
    model = load_model(tiny_dir("llama"), torch.float32)
    seen = []
    real = paged_cache.BatchKV.__init__

    def spy(self, pool, tables, past, num_new, *rest):
        seen.append(len(past))
        real(self, pool, tables, past, num_new, *rest)

    monkeypatch.setattr(paged_cache.BatchKV, "__init__", spy)
    cost = BatchCost()
    cost.profile(model, sizes=(1, 2, 4), repeats=2)
    assert sorted(cost.seconds) == [1, 2, 4] and all(t > 0 for t in cost.seconds.values())
    assert seen == [1, 1, 2, 2, 4, 4, 2]  # and one ragged pass of 2 + 1 tokens: does it run packed?
    assert cost.packs  # the tiny fp32 Llama runs through layer.c


def test_packed_verify_prices_real_tokens_not_padding():
    """Packed, a pass with one row drafting 5 tokens beside 3 rows drafting none costs c(9), not
    c(4 x 6); unpacked, past layer.c's rows or the attention kernel's grid, the padded size."""
    cost = BatchCost()
    assert cost.rows(4, 5, 9) == 24  # not known to pack: padded
    cost.packs = True
    assert cost.rows(4, 5, 9) == 9
    assert cost.rows(16, 4, 70) == 80  # 70 real tokens > MAX_ROWS: the per-op path, padded
    assert cost.rows(32, 4, 40) == 160  # a grid of 160 > PAGED_ROWS: torch's attention, padded


def test_a_model_drafters_time_is_not_counted_twice():
    """A model drafter's time is left out of the step overhead: it costs its drafting itself
    (draft_cost_per_token), and its one-off catch-up on the prompt, before it has measured a cost (0),
    is no step's overhead either (an EAGLE head's first digest once made speculation look 2.5 ms a row
    dearer at c = 4: off for good). A lookup drafter (no model, cost 0) stays in the overhead."""
    import time

    class Slow:
        def __init__(self, cost, model):
            self.draft_cost_per_token, self.has_model_drafter = cost, model

        def propose_batch(self, states, ks, trees=False):
            time.sleep(0.05)  # e.g. the drafter prefilling a whole prompt on its first call
            return [Proposal([1] * k) for k in ks]

    spec = cpu_like_speculation()
    for cost, model, counted in ((0.01, True, True), (0.0, True, True), (0.0, False, False)):
        spec.propose_seconds = 0.0
        seq = SimpleNamespace(spec=SimpleNamespace(proposer=Slow(cost, model), fixed_k=False), state=None,
                              grammar=None, draft_yield=0.0)
        assert spec.propose([seq], 2, caps=[4])[0].tokens == [1, 1]
        assert (spec.propose_seconds >= 0.05) == counted


def test_lookup_chains_are_priced_by_their_match_length():
    """Lookups are asked before K is chosen: rows whose chains follow a long match (estimate 0.95)
    speculate where the same rows' pooled estimate (0) would not; lookup-only rows that found no
    chain this step draft nothing, whatever their history."""
    from specdec.spec.adaptive import AdaptiveK
    spec = cpu_like_speculation()
    seqs, caps = rows(2, acceptance=0.0)
    for s in seqs:
        s.adaptive = AdaptiveK(0, None, prior=0.0)
        s.spec.proposer.has_model_drafter = False
        s.grammar = None
        for _ in range(30):
            s.adaptive.update(8, 8, match_len=6)
    assert spec.choose_k(seqs, caps) == 0  # priced by the pooled estimate
    chains = [Proposal([7] * 8, match_len=6) for _ in seqs]
    k = spec.choose_k(seqs, caps, chains)
    assert k >= 4
    assert [p.tokens for p in spec.propose(seqs, k, caps, chains)] == [[7] * k] * 2
    nothing = [Proposal([])] * len(seqs)
    assert spec.choose_k(seqs, caps, nothing) == 0
    assert all(not p for p in spec.propose(seqs, 4, caps, nothing))


def test_features_rest_after_plain_steps_and_wake_before_a_probe():
    """REST_AFTER plain steps in a row rest the drafters' features; the last WAKE_BEFORE steps before a
    probe keep them again (the probe drafts from fresh ones); a drafting step ends the rest."""
    from specdec.engine.speculation import REST_AFTER, WAKE_BEFORE
    probes = ProbeBackoff(PROBE_INTERVAL, MAX_PROBE_INTERVAL)
    rests, probed_at = [], None
    for step in range(1, PROBE_INTERVAL + 1):
        if probes.should_probe(False):
            probed_at = step
        rests.append(probes.resting(REST_AFTER, WAKE_BEFORE))
    assert probed_at == PROBE_INTERVAL
    assert rests == [REST_AFTER <= s < PROBE_INTERVAL - WAKE_BEFORE for s in range(1, PROBE_INTERVAL)] + [False]
    for _ in range(REST_AFTER):
        probes.should_probe(False)
    assert probes.resting(REST_AFTER, WAKE_BEFORE)
    probes.should_probe(True)
    assert not probes.resting(REST_AFTER, WAKE_BEFORE)


def test_k_prices_the_rows_that_draft_a_fixed_length():
    """A row with a fixed num_speculative_tokens drafts its 14 tokens at any K: the pass already stands at
    16 rows, where the CPU curve turns compute-bound, so a weak drafter's (10%) tokens no longer ride free.
    The choice once left the fixed row out (a 2-row pass, flat) and drafted anyway."""
    spec = cpu_like_speculation()
    spec.cost.packs = True  # (padded, the adaptive row's tokens would ride in the fixed row's padding)
    seqs, caps = rows(2, acceptance=0.1)
    fixed = SimpleNamespace(proposer=SimpleNamespace(draft_cost_per_token=0.0), fixed_k=True)
    seqs[0] = SimpleNamespace(adaptive=SimpleNamespace(acceptance=0.3), draft_yield=1.0, spec=fixed)
    assert spec.choose_k(seqs, [14, 8]) == 0
    seqs[0].spec = SimpleNamespace(proposer=None, fixed_k=False)  # the same row not drafting: K pays again
    assert spec.choose_k(seqs, [14, 8]) >= 1
