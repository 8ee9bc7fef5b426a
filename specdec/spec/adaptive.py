"""Adaptive speculation length from a measured cost model.

    expected tokens per step   E(k) = (1 - a^(k+1)) / (1 - a)       (a: acceptance rate, EMA)
    seconds of a step          S(k) = c_verify(k+1) + k * d + o_spec     (k > 0)
                               S(0) = c_verify(1) + o_plain
    choose k in 0..k_max maximising E(k) / S(k) against 1 / S(0);  k = 0 is plain decoding.

c_verify(T) is the target's forward time over T tokens, measured on this machine (a short profile
at first use, then refined online by every verify pass). d, the seconds per drafted token, and the
per-step overheads o (verification, the drafter's catch-up on accepted tokens, bookkeeping) are
measured on every step of the request: a drafter whose cost the model does not know (an int4 copy
of the target on one busy core, say) still loses its steps to plain decoding. When the best k
gives no gain, speculation is off for the request; after `probe_interval` plain steps it drafts
once to re-measure acceptance and cost, and each probe that still finds no gain doubles the wait
(up to MAX_PROBE_INTERVAL; for a drafter too dear even at full acceptance, up to
HOPELESS_INTERVAL_FACTOR times that): a probe costs a drafter's catch-up on every token it missed, which
kept a losing draft model ~5% below plain decoding when probes came every 16 steps. A probe that
measures the drafter cheaper than its estimates replaces them, so estimates inflated by a stall of the
machine recover at the next probe.

A request starts from what the previous request of the same decoder ended with (`previous`): its
acceptance as the prior, the drafter's and the step's measured costs, and its probe wait with the steps
already waited (a wait restarted per request never ended when longer than a request). Starting
each request from the fixed prior (0.6) made a useless draft model draft on every request's second
step, paying its catch-up over the whole prompt each time (0.87-0.98x on 64-token answers). The
decoder does this for model drafters only: a lookup drafter's probe costs one verify column, and
carrying its wait made n-gram and suffix drafting skip a whole translation request after an answer on
a document that copied nothing. After a prompt over twice as long (CONTEXT_SHRINK) only the acceptance
is carried: a drafter's step grows with its context, and costs measured after a long document kept a
bf16 target's int4 draft off for the next requests' short prompts (qdraft+ngram, rag / code / qa / math
prompts alternating, interleaved A/B: bf16 1.04x -> 1.12x, fp32 1.33x -> 1.38x).

A lookup's chains (n-gram, suffix) are estimated apart from a model drafter's, per request and by
the length of the context match that found them (1, 2, ..., >= MAX_MATCH_KEY tokens): the lookup
runs first (it is free), and the step drafts its chain, cut to the k its own estimate favours, when
that pays over plain decoding and the model drafter's best option (a pairing, proposers/hybrid.py)
does not expect LOOKUP_MARGIN (1.15x) more. One
estimate for all of a lookup's chains mixed 1-token matches (mostly wrong) with long copies (mostly
right), so k was too long for the first and too short for the second. Replaying 48 of the target's
greedy answers (8 prompts x 6 categories, up to 256 tokens) through this class and the measured cost
curve: one estimate 1.28-2.99x per category, one per match length 1.41-2.97x (summarization 1.49x ->
1.69x, rag 1.78x -> 1.88x, chat 1.65x -> 1.70x, code 1.28x -> 1.41x); measured, interleaved, 64 tokens,
n-gram decode: summarization 1.35x -> 1.49x, rag 1.10x -> 1.20x, chat 1.46x -> 1.57x.

A tree drafter drafts k NODES, not a chain of k tokens, and is priced by its nodes' chances of lying on
the accepted path (spec/tree_shares.py): a static tree's prior shares scaled by what it yields, a
dynamic (EAGLE-2) tree's shares learned per rank.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from specdec.model.cuda_graph import synchronize
from specdec.spec.tree_shares import RankShares, TreeYield

PRIOR_ACCEPTANCE = 0.6
EMA = 0.3
PLAIN_REFRESH = 32  # one plain step in this many keeps o_plain measured
MAX_PROBE_INTERVAL = 128
HOPELESS_INTERVAL_FACTOR = 8  # waits of a drafter too dear even at full acceptance grow up to 8 x 128 steps
MAX_MATCH_KEY = 8  # lookup chains after matches of >= 8 tokens share one estimate
# acceptance assumed for a lookup's chains at a match length not seen yet in the request (0.8 measured
# the same within +-3% on chat, code, math, summarization for n-gram and both pairings)
LOOKUP_PRIOR = 0.6
# a pairing drafts the lookup's chain unless the model drafter's expected speedup is this much higher:
# the chain is free and the model drafter's estimate swings with a few steps (interleaved, 4 prompts x 2
# rounds, decode: eagle3+ngram chat 1.56x -> 1.69x, qdraft+ngram summarization 1.64x -> 1.79x, rag
# 1.40x -> 1.45x; qdraft+ngram chat 1.86x -> 1.83x and math 1.59x -> 1.57x, against 1.0)
LOOKUP_MARGIN = 1.15
# a measured time enters an estimate at no more than this many times the estimate: one stall of the
# machine (a shared VM paused a request for ~2 s in run S14) made a pairing's int4 draft look 20x
# too dear, switched it off and, as the estimates carry over, kept it off for the next requests too
# (qdraft+ngram 0.88x on qa there; 1.50x rerun). A real change still gets through in a few steps.
MAX_JUMP = 3.0
CONTEXT_SHRINK = 2.0  # a prompt over this many times shorter than the previous does not take its costs


def robust_ema(old: float | None, new: float) -> float:
    """EMA update of a time estimate, the new observation capped at MAX_JUMP times the old estimate."""
    if old is None:
        return new
    if old > 0:
        new = min(new, MAX_JUMP * old)
    return (1 - EMA) * old + EMA * new


class StepOverhead:
    """Seconds of a decode step outside its forward passes (verification, bookkeeping, the drafter's
    catch-up), as EMAs kept apart for steps that drafted (`spec`) and steps that did not (`plain`)."""

    def __init__(self):
        self.spec = 0.0
        self.plain = 0.0

    def observe(self, drafted: bool, seconds: float) -> None:
        if drafted:
            self.spec = robust_ema(self.spec, seconds)
        else:
            self.plain = robust_ema(self.plain, seconds)


class ProbeBackoff:
    """When speculation is off, when to draft once anyway to re-measure acceptance and cost: after
    `interval` plain steps, and each probe that still finds no gain doubles the wait (up to
    `max_interval`); a step that speculates resets it."""

    def __init__(self, interval: int, max_interval: int = MAX_PROBE_INTERVAL):
        self.base_interval = self.interval = interval
        self.max_interval = max_interval
        self.plain_steps = 0  # plain steps since the last probe
        self.probed = False  # the previous step was a probe

    def should_probe(self, speculating: bool, hopeless: bool = False) -> bool:
        """Called once per step with the cost model's verdict; True: this (plain) step probes.
        hopeless: no k would pay even if every draft were accepted (the drafter's measured cost alone
        rules it out), so a probe can only re-measure that cost: wait the longest interval."""
        if speculating:
            self.interval, self.plain_steps, self.probed = self.base_interval, 0, False
            return False
        if hopeless:
            self.interval = max(self.interval, self.max_interval)
        if self.probed:  # the probe did not make speculation pay: wait longer for the next one
            # a hopeless drafter's waits go on doubling: they count across requests, and a probe of a draft
            # model pays its catch-up over the whole context (a universal-tokenizer draft for gemma3-270m
            # probed every 128 steps: 0.89x)
            cap = HOPELESS_INTERVAL_FACTOR * self.max_interval if hopeless else self.max_interval
            self.interval = min(2 * self.interval, cap)
            self.probed = False
        self.plain_steps += 1
        if self.plain_steps >= self.interval:
            self.plain_steps, self.probed = 0, True
            return True
        return False

    def resting(self, after: int, wake_before: int) -> bool:
        """Whether speculation has been off for `after` plain steps and the next probe is more than
        `wake_before` steps away: what only a drafting step needs may stop being kept (the serving
        engine's EAGLE features), and is kept again for the last `wake_before` steps before a probe."""
        return self.plain_steps >= after and self.plain_steps + wake_before < self.interval


class CostModel:
    """Seconds per target forward over T new tokens, T = 1..max_tokens (shared by requests)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.seconds: list[float | None] = [None] * (max_tokens + 1)

    def profile(self, target, prefix_len: int = 64, repeats: int = 3) -> None:
        dev = target.device
        cache = target.new_cache(prefix_len + self.max_tokens + 1)
        ids = torch.zeros(1, prefix_len, dtype=torch.long, device=dev)
        target(ids, torch.arange(prefix_len, device=dev)[None], cache, num_logits=1)
        for T in range(1, self.max_tokens + 1):
            times = []
            for _ in range(repeats):
                cache.rollback(prefix_len)
                t0 = time.perf_counter()
                target(torch.zeros(1, T, dtype=torch.long, device=dev),
                       torch.arange(prefix_len, prefix_len + T, device=dev)[None], cache)
                synchronize(dev)
                times.append(time.perf_counter() - t0)
            self.seconds[T] = sorted(times)[len(times) // 2]

    @property
    def profiled(self) -> bool:
        return self.seconds[1] is not None

    def observe(self, T: int, seconds: float) -> None:
        if 1 <= T <= self.max_tokens:
            self.seconds[T] = robust_ema(self.seconds[T], seconds)

    def relative(self, T: int) -> float:
        """A pass over T tokens against a single-token one. No pass is priced above a longer one: an estimate
        for a T seldom chosen is old and may hold a stall (a tree of 7 nodes once priced at 1.6x, 8 nodes
        at 1.25x, and adaptive k avoided 7 for the rest of the request)."""
        T = min(max(T, 1), self.max_tokens)
        base = self.seconds[1]
        if not base:
            return float(T)
        known = [s for s in self.seconds[T:] if s is not None]
        return min(known) / base if known else float(T)


class Acceptance:
    """Per-position acceptance from truncated-geometric observations: m of k drafts accepted shows m
    successes and, if m < k, one failure; positions after it were never tested. The estimate is
    (EMA of successes) / (EMA of tested positions), the pooled maximum-likelihood one. (It was m / k
    per step, which counts untested positions as failures and so pulled a, and k, down as k grew:
    qdraft at adaptive k drafted 2.5 tokens a step at 0.91 acceptance, 1.49x, where fixed k = 4 gave 1.77x.)
    Each step weighs EMA; with a position_weight w, a step that tested t positions weighs 1 - (1 - w)^t
    instead, so a drafter of short chains is averaged over its last ~1/w positions, not ~3 steps (a
    head's choice: proposers/eagle.py)."""

    def __init__(self, prior: float, position_weight: float | None = None):
        """position_weight: each tested position's weight in the averages (a step's weight grows with the
        positions it tested); None: each step's is EMA, whatever it tested."""
        self.accepted, self.tested = prior, 1.0  # EMAs of positions accepted / observed
        self.position_weight = position_weight

    @property
    def value(self) -> float:
        return min(self.accepted / self.tested, 0.99)

    def update(self, num_drafted: int, num_accepted: int, per_step: bool = False) -> None:
        """per_step: weigh this step EMA whatever it tested (a probe: it exists to re-measure)."""
        if num_drafted == 0:
            return
        tested = num_accepted + (1 if num_accepted < num_drafted else 0)
        if self.position_weight is not None and not per_step:
            keep = (1 - self.position_weight) ** tested
            self.accepted = keep * self.accepted + (1 - keep) * num_accepted / tested
            self.tested = keep * self.tested + (1 - keep)
            return
        self.accepted = (1 - EMA) * self.accepted + EMA * num_accepted
        self.tested = (1 - EMA) * self.tested + EMA * tested


class Choice(NamedTuple):
    k: int  # tokens to draft; 0: a plain step
    lookup: bool  # draft the lookup's chain (else the model drafter's)


class AdaptiveK:
    """Per-request choice of k, and of the drafter on steps where a free lookup and a model drafter
    both could draft (proposers/hybrid.py)."""

    def __init__(self, k_max: int, cost: CostModel, probe_interval: int = 16, previous: "AdaptiveK | None" = None,
                 prior: float = PRIOR_ACCEPTANCE, tree_shares: list[float] | None = None, prompt_len: int = 0,
                 position_weight: float | None = None, dynamic_tree_depth: int = 0):
        """prior: the model drafter's acceptance assumed before any step is seen (its acceptance_prior);
        tree_shares: a tree drafter's node shares, in drafting order (Proposer.tree_shares);
        dynamic_tree_depth > 0: they are a dynamic tree's priors per rank, learned from its verified trees,
        and its k nodes take min(k, this) drafting passes (else a static tree's, priced per node);
        prompt_len: the request's prompt length, 0 if unknown; position_weight: the model drafter's
        estimate weighs each tested position this much instead of each step EMA
        (Proposer.acceptance_position_weight)."""
        self.k_max = k_max
        self.tree: TreeYield | RankShares | None = None
        if tree_shares is not None:
            self.tree = RankShares(tree_shares, dynamic_tree_depth) if dynamic_tree_depth else TreeYield(tree_shares)
        self.cost = cost
        self.model = Acceptance(prior, position_weight)  # the model drafter's tokens
        # a lookup's chains by match length (min(n, MAX_MATCH_KEY)), fresh per request: a chain after a
        # 6-token match is accepted far more often than one after a 1-token match (see the module doc)
        self.lookups: dict[int, Acceptance] = {}
        self.probes = ProbeBackoff(probe_interval)
        self.draft_seconds: float | None = None  # per drafting pass (a token of a chain), EMA over the steps
        self.overhead = StepOverhead()  # outside the draft and verify forwards
        self.steps = 0
        self.prompt_len = prompt_len
        if previous is not None:  # the previous request's estimates are this one's priors
            self.model.accepted, self.model.tested = previous.model.accepted, previous.model.tested
        # a drafter's step grows with the context it attends to (an int4 copy's: 5.7 ms after 60 tokens, 8.0 ms
        # after 860; the bf16 target's 10.3 -> 12.3 ms): costs measured after a prompt more than
        # CONTEXT_SHRINK times this one are not this request's, nor is the wait they made long (after rag
        # answers such costs kept a bf16 target's int4 draft off through the next categories' short prompts)
        if previous is not None and not (prompt_len and previous.prompt_len > CONTEXT_SHRINK * prompt_len):
            self.draft_seconds = previous.draft_seconds
            self.overhead.spec, self.overhead.plain = previous.overhead.spec, previous.overhead.plain
            # the wait goes on counting where the previous request left it: restarted per request, a wait
            # longer than a request (up to 128 steps against 64-token answers) never ended, and a drafter
            # switched off once (a stall of the machine inflating its measured cost, run S16) stayed off
            probes = previous.probes  # (probed too: a request that ended on a fruitless probe still doubles the wait)
            self.probes.interval, self.probes.plain_steps, self.probes.probed = probes.interval, probes.plain_steps, probes.probed

    @property
    def acceptance(self) -> float:
        return self.model.value

    @acceptance.setter
    def acceptance(self, a: float) -> None:
        self.model.accepted, self.model.tested = a, 1.0

    def _estimate(self, match_len: int) -> Acceptance:
        """The model drafter's estimate (match_len 0) or the lookup's for chains after a match_len match."""
        if match_len <= 0:
            return self.model
        key = min(match_len, MAX_MATCH_KEY)
        if key not in self.lookups:
            self.lookups[key] = Acceptance(LOOKUP_PRIOR)
        return self.lookups[key]

    def lookup_acceptance(self, match_len: int) -> float:
        """The estimate for a lookup's chain after a match of match_len tokens (the prior if unseen)."""
        return self._estimate(match_len).value

    def update(self, num_drafted: int, num_accepted: int, match_len: int = 0,
               accepted_nodes: list[int] | None = None) -> None:
        """A verified step: num_accepted of num_drafted tokens, drafted by the model drafter (match_len 0)
        or by a lookup after a match of match_len tokens; accepted_nodes: a tree's accepted path (node
        indices; None: a chain's first num_accepted)."""
        if match_len <= 0 and self.tree is not None and num_drafted > 0:
            self.tree.update(num_drafted, num_accepted, accepted_nodes)
        self._estimate(match_len).update(num_drafted, num_accepted, per_step=self.probes.probed and match_len <= 0)

    def expected_tokens(self, k: int, match_len: int = 0, acceptance: float | None = None) -> float:
        """Tokens a step emits when it drafts k: a chain's 1 + a + ... + a^k at the estimated (or given)
        acceptance a; a tree's 1 + its first k nodes' shares (spec/tree_shares.py)."""
        if match_len <= 0 and acceptance is None and self.tree is not None:
            return self.tree.expected(k)
        a = self._estimate(match_len).value if acceptance is None else acceptance
        return (1 - a ** (k + 1)) / (1 - a)

    def observe_step(self, num_drafted: int, draft_seconds: float, other_seconds: float, model: bool = True) -> None:
        """A step's measured costs: the proposer's time (kept per drafted token for model drafters; a
        lookup's is part of the step's overhead), and what is neither drafting nor the verify forward
        (verification, the drafter's bookkeeping on the accepted tokens, output)."""
        if not model:
            other_seconds += draft_seconds
        # a probe exists to re-measure: what it finds cheaper than the estimates replaces them (estimates
        # inflated by a stall would otherwise decay by one EMA step per probe, 128 steps apart); what it
        # finds dearer enters as any other measurement
        probe = self.probes.probed and num_drafted > 0
        if probe and other_seconds < self.overhead.spec:
            self.overhead.spec = other_seconds
        else:
            self.overhead.observe(num_drafted > 0, other_seconds)
        if num_drafted == 0 or not model:
            return
        per_pass = draft_seconds / self.draft_passes(num_drafted)
        if probe and self.draft_seconds is not None and per_pass < self.draft_seconds:
            self.draft_seconds = per_pass
        else:
            self.draft_seconds = robust_ema(self.draft_seconds, per_pass)

    def draft_passes(self, k: int) -> int:
        """The model drafter's sequential passes for k tokens: k for a chain or a static tree (priced per
        node), fewer for a dynamic tree (one pass drafts a depth)."""
        return self.tree.passes(k) if self.tree is not None else k

    def expected_speedup(self, k: int, draft_cost_rel: float, match_len: int = 0,
                         acceptance: float | None = None) -> float:
        """Tokens per second at k over plain decoding's. draft_cost_rel: the proposer's own estimate of
        a drafted token's cost relative to one target token, used until steps have been measured;
        match_len > 0: a lookup's chain after a match of that length (free to draft); acceptance:
        instead of the estimate (the ceiling: 0.99)."""
        tokens = self.expected_tokens(k, match_len, acceptance)
        base = self.cost.seconds[1]
        if match_len > 0:
            draft_cost_rel = 0.0
        if not base:
            return tokens / (self.cost.relative(k + 1) + self.draft_passes(k) * draft_cost_rel)
        draft = self.draft_seconds if self.draft_seconds is not None and match_len <= 0 else draft_cost_rel * base
        # a drafting step does all of a plain step's work and more: its overhead is never priced below the
        # plain one (on tiny models both are timing noise, and a plain estimate above the spec one made a
        # step at acceptance 0.01 look like it paid)
        spec = (self.cost.relative(k + 1) * base + self.draft_passes(k) * draft
                + max(self.overhead.spec, self.overhead.plain))
        return tokens * (base + self.overhead.plain) / spec

    def _best(self, draft_cost_rel: float, match_len: int, k_max: int) -> tuple[int, float]:
        """(k, expected speedup): k from 1 to k_max, a longer k taken only where it beats the best so far by
        2% (not the plain argmax: a longer draft for a noise-level gain only adds variance); 0 when no k beats
        plain decoding by 2%."""
        best_k, best = 0, 1.0
        for k in range(1, k_max + 1):
            s = self.expected_speedup(k, draft_cost_rel, match_len)
            if s > best * 1.02:  # a 2% margin: do not speculate for noise-level gains
                best_k, best = k, s
        return best_k, best

    def choose(self, draft_cost_rel: float, lookup_match: int = 0, lookup_len: int = 0,
               model: bool = True) -> Choice:
        """This step's draft: lookup_match > 0 offers a lookup's chain of lookup_len tokens after a
        match of that many context tokens; model: whether a model drafter may draft. The lookup's chain
        wins unless the model drafter's expected speedup is LOOKUP_MARGIN times higher; neither paying
        (over plain decoding): a plain step (with probes)."""
        self.steps += 1
        if self.steps % PLAIN_REFRESH == 1:  # the first step, then one in PLAIN_REFRESH: measure plain
            return Choice(0, False)
        best = Choice(0, False), 1.0
        if model:
            k, s = self._best(draft_cost_rel, 0, self.k_max)
            best = Choice(k, False), s
        if lookup_match > 0 and lookup_len > 0:
            k, s = self._best(0.0, lookup_match, min(lookup_len, self.k_max))
            if k > 0 and s * LOOKUP_MARGIN > best[1]:
                best = Choice(k, True), s
        choice = best[0]
        # the probes re-measure the model drafter where there is one: only its own steps reset their wait.
        # (Counting a lookup's chains too, a pairing whose model estimate had fallen (qdraft+ngram on a bf16
        # target, after a document) never probed again while n-gram found chains, and stayed off.)
        model_off = model and (choice.k == 0 or choice.lookup)
        # a model drafter too dear to pay even at full acceptance (an int4 copy drafting for a bf16 target
        # on a CPU whose single-token pass streams fast: 7.4 vs 9.3 ms) is probed at the longest interval
        # (below _best's 2% margin, not 1.0: a best case of 1.00-1.02 can never be chosen either)
        hopeless = model_off and all(
            self.expected_speedup(k, draft_cost_rel, acceptance=0.99) < 1.02 for k in range(1, self.k_max + 1))
        if not model and lookup_match <= 0:  # a lookup alone with no chain this step: nothing a probe could
            return choice  # measure (it drafted nothing and still doubled the wait)
        if self.probes.should_probe(choice.k > 0 and not model_off, hopeless):
            return Choice(1, not model)  # probe: re-measure acceptance and cost
        return choice
