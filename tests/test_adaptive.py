"""The per-request adaptive k: it speculates when the measured step costs pay, and turns itself off
when a drafter's real cost (draft time, per-step overhead) eats the gain, even at full acceptance."""
import random

import pytest

from specdec.spec.adaptive import PLAIN_REFRESH, AdaptiveK, CostModel


def _cost(c1=0.040, growth=0.02) -> CostModel:
    cost = CostModel(9)
    cost.seconds = [None] + [c1 * (1 + growth * (T - 1)) for T in range(1, 10)]  # cheap verify
    return cost


def _run(adaptive: AdaptiveK, steps: int, accepted_rate: float, draft_s: float, overhead_s: float) -> list[int]:
    ks = []
    for _ in range(steps):
        k = adaptive.choose(draft_cost_rel=0.01).k
        ks.append(k)
        adaptive.update(k, round(k * accepted_rate))
        adaptive.observe_step(k, k * draft_s, overhead_s if k else 0.001)
    return ks


def test_cheap_drafts_with_high_acceptance_speculate():
    ks = _run(AdaptiveK(8, _cost()), 40, 1.0, draft_s=0.001, overhead_s=0.002)
    assert ks[0] == 0  # the first step measures plain decoding
    assert sum(k >= 4 for k in ks[1:]) >= 30


def test_expensive_drafts_turn_speculation_off_despite_full_acceptance():
    """Every draft accepted, but each drafted token costs 0.8 of a target step: a loss."""
    ks = _run(AdaptiveK(8, _cost()), 64, 1.0, draft_s=0.032, overhead_s=0.010)
    late = ks[32:]
    assert sum(k > 0 for k in late) <= len(late) // 8  # at most the probes


def test_step_overhead_counts():
    """The same drafts pay without per-step overhead and do not with a large one."""
    a, b = AdaptiveK(8, _cost()), AdaptiveK(8, _cost())
    for ad, over in ((a, 0.0), (b, 0.2)):
        ad.acceptance = 0.7
        ad.observe_step(0, 0.0, 0.001)
        ad.observe_step(4, 4 * 0.004, over)
    assert a.expected_speedup(4, 0.1) > 1.3 > 1.0 > b.expected_speedup(4, 0.1)


def test_plain_steps_are_refreshed():
    ad = AdaptiveK(8, _cost())
    ks = _run(ad, 2 * PLAIN_REFRESH + 1, 1.0, draft_s=0.001, overhead_s=0.002)
    assert [i for i, k in enumerate(ks) if k == 0] == [0, PLAIN_REFRESH, 2 * PLAIN_REFRESH]


@pytest.mark.parametrize("position_weight", [None, 0.1])
def test_probes_back_off_while_speculation_keeps_losing(position_weight):
    """A losing drafter is probed after 16, 32, 64, 128, 128... plain steps (each probe costs it a
    catch-up), and a probe that finds a gain brings speculation back at once."""
    ad = AdaptiveK(8, _cost(), probe_interval=16, position_weight=position_weight)
    ks = _run(ad, 420, 0.0, draft_s=0.004, overhead_s=0.002)  # nothing is ever accepted
    off = ks.index(0, 1)  # the first plain step after the first: the estimate has fallen
    assert off <= 16  # each miss tests one position: about ten steps from the 0.6 prior
    probes = [i for i, k in enumerate(ks) if k > 0 and i > off]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps == sorted(gaps) and max(gaps) >= 128 > min(gaps)
    assert len(probes) <= 6  # after 16, 32, 64, 128 and 128 plain steps
    ks = _run(ad, 300, 1.0, draft_s=0.0001, overhead_s=0.0)  # the drafter became cheap
    assert sum(k > 0 for k in ks[-100:]) >= 90


def test_acceptance_estimate_does_not_count_untested_drafts():
    """Drafting 4 tokens with a per-position acceptance of 0.75 (seeded geometric draws): the estimate
    lands near 0.75, where counting the untested positions after a rejection as rejected (m / k)
    would settle near 0.5."""
    import random
    rng = random.Random(0)
    ad = AdaptiveK(8, _cost())
    naive = []
    for _ in range(400):
        m = 0
        while m < 4 and rng.random() < 0.75:
            m += 1
        ad.update(4, m)
        naive.append(m / 4)
    assert abs(ad.acceptance - 0.75) < 0.12
    assert abs(sum(naive) / len(naive) - 0.75) > 0.15  # the old estimator's bias, for contrast


def test_a_request_starts_from_the_previous_requests_estimates():
    """After a request whose drafter never pays, the next one does not draft before the wait it inherits
    (128 steps, partly counted down already) runs out, and then probes once, where a fresh start drafts
    on its second step; a drafter that pays again is back within one probe interval."""
    from specdec.spec.adaptive import MAX_PROBE_INTERVAL
    losing = AdaptiveK(8, _cost(), probe_interval=16)
    _run(losing, 420, 0.0, draft_s=0.004, overhead_s=0.002)
    assert losing.probes.interval == MAX_PROBE_INTERVAL
    fresh = _run(AdaptiveK(8, _cost()), 100, 0.0, draft_s=0.004, overhead_s=0.002)
    assert fresh[1] > 0  # the negative case: the prior 0.6 drafts at once
    after = AdaptiveK(8, _cost(), previous=losing)
    left = MAX_PROBE_INTERVAL - losing.probes.plain_steps  # plain steps the inherited wait still needs
    ks = _run(after, 100, 0.0, draft_s=0.004, overhead_s=0.002)
    assert sum(k > 0 for k in ks) <= 1 and all(k == 0 for k in ks[:left])
    recovered = AdaptiveK(8, _cost(), previous=losing)
    ks = _run(recovered, 200, 1.0, draft_s=0.0001, overhead_s=0.0)
    assert sum(k > 0 for k in ks[140:]) >= 55


def test_costs_measured_after_a_much_longer_prompt_are_not_carried():
    """A drafter too dear after a 900-token prompt (its KV cache read every step) is off at the end of that
    request, with a long wait. The next request with a prompt over twice as short keeps the acceptance but
    not those costs: it drafts within its first steps; one with a prompt of the same size still waits."""
    long_ctx = AdaptiveK(8, _cost(), prompt_len=900)
    _run(long_ctx, 300, 0.9, draft_s=0.045, overhead_s=0.002)
    assert long_ctx.probes.interval >= 128 and long_ctx.draft_seconds > 0.04
    short = AdaptiveK(8, _cost(), previous=long_ctx, prompt_len=100)
    assert short.draft_seconds is None and abs(short.acceptance - long_ctx.acceptance) < 1e-9
    assert sum(k > 0 for k in _run(short, 20, 0.9, draft_s=0.004, overhead_s=0.002)) >= 15
    same = AdaptiveK(8, _cost(), previous=long_ctx, prompt_len=800)  # the negative control
    assert same.draft_seconds == long_ctx.draft_seconds
    assert sum(k > 0 for k in _run(same, 20, 0.9, draft_s=0.004, overhead_s=0.002)) == 0


def test_a_pairings_model_drafter_is_probed_while_its_lookup_drafts():
    """qdraft+ngram after its model estimate fell: n-gram finds a chain on every step and drafts it. The
    model drafter's probe wait counts those steps (they do not measure it), so it is probed again and,
    paying now, comes back; before, every lookup step restarted the wait and it never did."""
    ad = AdaptiveK(8, _cost(), probe_interval=16)
    ad.acceptance = 0.05  # what a run of misses left
    model_steps = 0
    for _ in range(300):
        choice = ad.choose(draft_cost_rel=0.1, lookup_match=3, lookup_len=4, model=True)
        if choice.k and not choice.lookup:
            model_steps += 1
            ad.update(choice.k, choice.k)  # the model drafter is right again
            ad.observe_step(choice.k, choice.k * 0.004, 0.001)
        elif choice.k:
            ad.update(choice.k, 1, match_len=3)  # the lookup's chains: one token of each accepted
            ad.observe_step(choice.k, 0.0, 0.001, model=False)
    assert model_steps >= 30  # 54 here; 0 when every lookup step restarted the wait


def test_the_proposers_prior_sets_the_first_steps_k():
    """A drafter that is a copy of the target (qdraft: prior 0.9) starts at a long draft; the generic
    prior (0.6) starts short, with the same measured costs (draft 0.4 of a target step)."""
    def first_k(prior: float) -> int:
        a = AdaptiveK(8, _cost(c1=0.020, growth=0.07), prior=prior)
        a.draft_seconds = 0.008
        a.choose(draft_cost_rel=0.4)  # the first step measures plain decoding
        return a.choose(draft_cost_rel=0.4).k
    assert first_k(0.6) <= 1 and first_k(0.9) >= 3



def test_lookup_chains_are_estimated_by_match_length():
    """Chains after 1-token matches rejected, after 5-token matches accepted: the next 1-token match
    drafts little or nothing, the next 5-token match drafts long; the model drafter's estimate is
    untouched by both."""
    ad = AdaptiveK(8, _cost(c1=0.020, growth=0.07))
    ad.choose(0.0, model=False)  # the plain refresh step
    for _ in range(20):
        ad.update(4, 0, match_len=1)
        ad.update(8, 8, match_len=5)
        ad.update(8, 8, match_len=9)
    short = ad.choose(0.0, lookup_match=1, lookup_len=8, model=False)
    long = ad.choose(0.0, lookup_match=5, lookup_len=8, model=False)
    assert short.k <= 1 and long.k >= 6 and long.lookup
    assert ad.acceptance == 0.6  # the prior: no model-drafted step was seen
    assert ad.choose(0.0, lookup_match=12, lookup_len=8, model=False).k == long.k  # >= 8 tokens: one estimate
    assert ad.choose(0.0, lookup_match=7, lookup_len=8, model=False).k < long.k  # unseen: the prior
    assert ad.choose(0.0, lookup_match=5, lookup_len=3, model=False).k == 3  # never past the chain


def test_the_dearer_drafter_loses_the_step():
    """A free lookup chain with a good estimate beats a model drafter whose tokens cost 0.4 of a target
    step; with a poor estimate for the chain's match length, the model drafter drafts."""
    ad = AdaptiveK(8, _cost(c1=0.020, growth=0.07), prior=0.9)
    ad.draft_seconds = 0.008
    ad.choose(0.4)  # the plain refresh step
    for _ in range(20):
        ad.update(4, 4, match_len=3)
        ad.update(4, 0, match_len=1)
    assert ad.choose(0.4, lookup_match=3, lookup_len=8).lookup
    model = ad.choose(0.4, lookup_match=1, lookup_len=8)
    assert not model.lookup and model.k >= 3


def test_one_stall_does_not_switch_a_paying_drafter_off():
    """A shared machine pausing one step (100x its draft time) moves the estimate by <= 1.6x, so a
    drafter that pays keeps drafting; without the cap it read as 30x dearer and went off."""
    ad = AdaptiveK(8, _cost())
    ks = _run(ad, 20, 1.0, draft_s=0.001, overhead_s=0.002)
    assert ks[-1] >= 4
    before = ad.draft_seconds
    ad.observe_step(4, 4 * 0.1, 0.002)  # the stall
    assert ad.draft_seconds <= 1.6 * before + 1e-12
    assert ad.choose(draft_cost_rel=0.01).k >= 4
    cost = _cost()
    c2 = cost.seconds[2]
    cost.observe(2, 100 * c2)  # a stalled verify pass moves the shared cost curve by as little
    assert cost.seconds[2] <= 1.6 * c2 + 1e-12


def test_real_cost_changes_still_get_through():
    ad = AdaptiveK(8, _cost())
    _run(ad, 10, 1.0, draft_s=0.001, overhead_s=0.002)
    for _ in range(12):  # the drafter became 40x dearer for good
        ad.observe_step(4, 4 * 0.040, 0.002)
    assert ad.draft_seconds > 0.030


def test_a_drafting_step_is_never_priced_below_a_plain_one():
    """Overheads are timing noise on small models: a plain-step estimate above the drafting one must
    not make a useless draft (acceptance 0.01) look like it pays."""
    ad = AdaptiveK(8, _cost())
    ad.acceptance = 0.01
    ad.overhead.plain, ad.overhead.spec = 0.030, 0.0
    ad.draft_seconds = 0.0
    assert all(ad.expected_speedup(k, 0.0) < 1.0 for k in range(1, 9))


def test_a_drafter_too_dear_at_full_acceptance_probes_rarely():
    """Each drafted token costs 1.1 target steps: no k pays even if all are accepted, so probes
    (which only re-measure) come at the longest interval; a drafter that is merely unlucky (acceptance
    low, cost low) keeps the short one."""
    from specdec.spec.adaptive import MAX_PROBE_INTERVAL
    dear = AdaptiveK(8, _cost())
    ks = _run(dear, 24, 1.0, draft_s=0.044, overhead_s=0.002)
    assert ks[-1] == 0 and dear.probes.interval == MAX_PROBE_INTERVAL
    cheap = AdaptiveK(8, _cost())
    cheap.acceptance = 0.02
    cheap.draft_seconds = 0.0005
    ks = [cheap.choose(0.01).k for _ in range(40)]
    assert cheap.probes.interval < MAX_PROBE_INTERVAL and sum(k > 0 for k in ks) >= 1


def test_a_drafter_switched_off_by_a_stall_comes_back_across_short_requests():
    """Run S16: a stall of the machine inflated a pairing's int4 draft cost, it read as too dear to pay
    (the longest probe wait), and as each 64-token request restarted that 128-step wait, no probe ever
    came: off for the rest of the run. The wait now counts on across requests, and a probe that finds
    the drafter cheap again replaces the inflated estimates."""
    ad = AdaptiveK(8, _cost())
    _run(ad, 20, 1.0, draft_s=0.001, overhead_s=0.002)
    for _ in range(15):  # a stall of 15 drafting steps, each ~40x its cost
        ad.observe_step(4, 4 * 0.040, 0.080)
    requests, drafted = [], []
    for _ in range(6):  # 64-step requests, each from the previous one's estimates; the drafter is cheap
        ad = AdaptiveK(8, _cost(), previous=ad)
        ks = _run(ad, 64, 1.0, draft_s=0.001, overhead_s=0.002)
        requests.append(ad)
        drafted.append(sum(k > 0 for k in ks))
    assert drafted[0] == 0  # off at first: the inflated estimates say it cannot pay
    assert drafted[-1] >= 8, drafted  # back, drafting most steps (a step drafts up to 8 tokens)


def test_a_hopeless_drafters_probes_thin_out_across_requests():
    """A drafter too dear even at full acceptance probes after 128 steps, then 256, 512, up to 1024 while
    each probe confirms it (its probes count across requests, and a draft model's probe pays a catch-up
    over the whole context); one that is merely unlucky keeps waits of at most 128."""
    from specdec.spec.adaptive import HOPELESS_INTERVAL_FACTOR, MAX_PROBE_INTERVAL
    ad, probes = AdaptiveK(8, _cost()), []
    for request in range(40):  # 64-step requests, each from the previous one's estimates
        ad = AdaptiveK(8, _cost(), previous=ad) if request else ad
        ks = _run(ad, 64, 1.0, draft_s=0.044, overhead_s=0.002)
        probes.append(sum(k > 0 for k in ks))
    assert sum(probes[:2]) >= 1  # the first measurement, then the first hopeless wait of 128 steps
    assert ad.probes.interval == HOPELESS_INTERVAL_FACTOR * MAX_PROBE_INTERVAL
    assert 4 <= sum(probes) <= 8, probes  # 128-step waits would have probed ~20 times in these 2560 steps


SHARES = [0.40, 0.16, 0.08, 0.065, 0.064, 0.032, 0.032, 0.026]  # recycling's first 8 nodes


def _steep_cost() -> CostModel:
    cost = CostModel(9)
    cost.seconds = [None] + [0.040 * (1 + 0.12 * (T - 1)) for T in range(1, 10)]  # each row +12%
    return cost


def test_a_tree_is_priced_by_its_node_shares_scaled_by_what_it_yields():
    ad = AdaptiveK(8, _cost(), tree_shares=SHARES)
    assert abs(ad.expected_tokens(3) - (1 + 0.40 + 0.16 + 0.08)) < 1e-9
    chain = AdaptiveK(8, _cost(), prior=0.4)
    assert chain.expected_tokens(3) < ad.expected_tokens(3)  # 0.4^2, 0.4^3 for nodes 2, 3: a chain's shape
    for _ in range(80):  # every 4-node tree yields twice its prediction (1.41 tokens)
        ad.update(4, 2 * sum(SHARES[:4]))
    assert abs(ad.tree.scale - 2.0) < 0.05
    assert abs(ad.expected_tokens(2) - (1 + min(1, 2 * 0.40) + 2 * 0.16)) < 0.05
    for _ in range(80):
        ad.update(8, 8)  # far above: each node's scaled share is capped at 1
    assert ad.expected_tokens(8) <= 9.0 + 1e-9
    assert ad.expected_tokens(3, acceptance=0.5) == 1 + 0.5 + 0.25 + 0.125  # a given acceptance: the chain bound


def test_a_tree_that_yields_nothing_stops_drafting_and_one_that_yields_grows():
    """Trees whose nodes are never accepted lose and stop (each row adds 12% to a pass); trees whose
    accepted path is as likely as their shares say keep drafting, and on a flat cost curve (2% a row)
    draft most of their nodes."""
    rng = random.Random(0)
    losing = AdaptiveK(8, _steep_cost(), tree_shares=SHARES)
    paying = AdaptiveK(8, _cost(), tree_shares=SHARES)
    late_losing, late_paying = [], []
    for step in range(120):
        k = losing.choose(0.0).k
        losing.update(k, 0)
        losing.observe_step(k, 0.0, 0.0005)
        j = paying.choose(0.0).k
        paying.update(j, int(rng.random() < sum(SHARES[:j])))  # one token, as often as the shares say
        paying.observe_step(j, 0.0, 0.0005)
        if step >= 60:
            late_losing.append(k)
            late_paying.append(j)
    assert sum(k > 0 for k in late_losing) <= 3  # the probes
    assert sum(j > 0 for j in late_paying) >= 0.9 * len(late_paying)
    assert sorted(late_paying)[len(late_paying) // 2] >= 5


def test_a_coin_flip_drafter_keeps_drafting():
    """A drafter whose every position is accepted half the time (seeded draws) pays at every k here.
    Averaged over its last ~10 tested positions (position_weight 0.1, a head's), its estimate rarely
    falls far enough to stop it. The per-step average (each step weighted 0.3, however many positions it tested) is the negative
    control: at k = 1, three misses in a row took it from 0.5 to 0.17, and a stopped drafter's single-
    token probes kept it stopped (a head on MT-bench: 1.26x where fixed chains gave 1.32x)."""
    def drafting_steps(position_weight: float | None) -> int:
        rng, ad, drafted = random.Random(1), AdaptiveK(8, _cost(), position_weight=position_weight), 0
        for _ in range(400):
            k = ad.choose(draft_cost_rel=0.01).k
            m = 0
            while m < k and rng.random() < 0.5:
                m += 1
            ad.update(k, m)
            ad.observe_step(k, k * 0.004, 0.002 if k else 0.001)
            drafted += k > 0
        return drafted

    weighted, per_step = drafting_steps(0.1), drafting_steps(None)
    assert weighted >= 400 - 400 // PLAIN_REFRESH - 12 > per_step


def test_position_weight_counts_positions_not_steps():
    """Weighted per tested position, one step accepting 4 drafts moves the estimate as 4 one-draft steps
    do, and a probe (re-measuring a stopped drafter) still weighs a whole step EMA."""
    from specdec.spec.adaptive import EMA, Acceptance

    one, four = Acceptance(0.5, 0.1), Acceptance(0.5, 0.1)
    for _ in range(4):
        one.update(1, 1)
    four.update(4, 4)
    assert abs(one.value - four.value) < 1e-12 and abs(four.value - (1 - 0.5 * 0.9 ** 4)) < 1e-12
    miss = Acceptance(0.5, 0.1)
    miss.update(1, 0)
    assert abs(miss.value - 0.45) < 1e-12  # 0.3 weighted per step: 0.35
    probe = Acceptance(0.1, 0.1)
    probe.update(1, 1, per_step=True)
    assert abs(probe.value - (0.1 * (1 - EMA) + EMA)) < 1e-12


def test_a_dynamic_trees_shares_are_learned_per_rank():
    """An EAGLE-2 tree's node i is its drafter's i-th likeliest: each rank's share is the EMA of its
    being on the accepted path over the steps that drafted it, a rank never drafted keeps its prior, and
    no rank is valued above the ones before it."""
    prior = [0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    ad = AdaptiveK(6, _cost(), tree_shares=prior, dynamic_tree_depth=3)
    for step in range(200):  # rank 0 always accepted, rank 2 every other step, rank 1 never; 4 nodes
        ad.update(4, 1 + step % 2, accepted_nodes=[0, 2] if step % 2 else [0])
    shares = ad.tree.shares
    assert shares[0] == pytest.approx(1.0, abs=1e-6) and shares[1] == pytest.approx(0.0, abs=1e-6)
    assert shares[2] == pytest.approx(0.5, abs=0.06) and shares[3] == pytest.approx(0.0, abs=1e-6)
    assert shares[4:] == prior[4:]  # never drafted
    assert ad.expected_tokens(6) == pytest.approx(2.0, abs=1e-6)  # ranks 2..5 capped by rank 1's 0
    static = AdaptiveK(6, _cost(), tree_shares=prior)  # the negative control: a static tree scales its prior
    for step in range(200):
        static.update(4, 1 + step % 2)
    assert static.expected_tokens(6) > 2.5


def test_a_dynamic_tree_costs_a_drafting_pass_per_depth():
    """A dynamic tree of k nodes is drafted in min(k, depth) passes: its measured draft time is kept per
    pass and a tree of 8 nodes 3 deep is priced as 3 passes, not 8 drafted tokens."""
    prior = [0.45 * 0.75 ** r for r in range(8)]
    tree = AdaptiveK(8, _cost(), tree_shares=prior, dynamic_tree_depth=3)
    tree.observe_step(8, 0.006, 0.001)  # 8 nodes in 3 passes of 2 ms
    assert tree.draft_seconds == pytest.approx(0.002)
    assert [tree.draft_passes(k) for k in (1, 2, 3, 8)] == [1, 2, 3, 3]
    per_token = AdaptiveK(8, _cost(), tree_shares=prior)  # a static tree: a pass per node
    per_token.observe_step(8, 0.006, 0.001)
    assert per_token.draft_seconds == pytest.approx(0.00075)
    per_token.draft_seconds = tree.draft_seconds
    assert tree.expected_speedup(8, 0.0) > per_token.expected_speedup(8, 0.0)


def test_no_pass_is_priced_above_a_longer_one():
    """A pass over T tokens is priced at most as a longer pass: an estimate for a seldom-chosen T may be
    old or hold a stall, and adaptive k would avoid that T for the rest of the request."""
    cost = _cost()
    cost.seconds[7] = 3 * cost.seconds[8]  # a stalled 7-token pass
    assert cost.relative(7) == cost.relative(8) < cost.relative(9)
    assert cost.relative(3) == pytest.approx(cost.seconds[3] / cost.seconds[1])


def test_probes_wait_for_something_to_measure_and_carry_across_requests():
    """A lookup alone with no chain this step: a probe drafted nothing and still doubled the wait (400 such
    steps: probes at 16, 49, 115, ...). A drafter whose best case is under the 2% margin that choosing a k
    needs is hopeless (it was only under 1.0). A request that ended on a probe hands that on (it was dropped)."""
    from specdec.spec.adaptive import MAX_PROBE_INTERVAL
    lookup = AdaptiveK(8, _cost(), probe_interval=16)
    choices = [lookup.choose(draft_cost_rel=0.0, lookup_match=0, model=False) for _ in range(400)]
    assert all(c.k == 0 for c in choices) and lookup.probes.interval == 16
    marginal = AdaptiveK(8, _cost(), probe_interval=16)
    marginal.expected_speedup = lambda *a, **k: 1.01  # never chosen (the margin is 2%)
    for _ in range(3):
        assert marginal.choose(draft_cost_rel=0.1).k == 0
    assert marginal.probes.interval == MAX_PROBE_INTERVAL
    ended_on_a_probe = AdaptiveK(8, _cost(), probe_interval=16)
    ended_on_a_probe.probes.probed = True
    assert AdaptiveK(8, _cost(), previous=ended_on_a_probe).probes.probed
