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
(up to MAX_PROBE_INTERVAL): a probe costs a drafter's catch-up on every token it missed, which kept
a losing draft model ~5% below plain decoding when probes came every 16 steps.

A request starts from what the previous request of the same decoder ended with (`previous`): its
acceptance as the prior, the drafter's and the step's measured costs, and its probe wait. Starting
each request from the fixed prior (0.6) made a useless draft model draft on every request's second
step, paying its catch-up over the whole prompt each time (0.87-0.98x on 64-token answers). The
decoder does this for model drafters only: a lookup drafter's probe costs one verify column, and
carrying its wait made n-gram and suffix drafting skip a whole translation request after an answer on
a document that copied nothing.
"""
from __future__ import annotations

import time

import torch

PRIOR_ACCEPTANCE = 0.6
EMA = 0.3
PLAIN_REFRESH = 32  # one plain step in this many keeps o_plain measured
MAX_PROBE_INTERVAL = 128


class StepOverhead:
    """Seconds of a decode step outside its forward passes (verification, bookkeeping, the drafter's
    catch-up), as EMAs kept apart for steps that drafted (`spec`) and steps that did not (`plain`)."""

    def __init__(self):
        self.spec = 0.0
        self.plain = 0.0

    def observe(self, drafted: bool, seconds: float) -> None:
        if drafted:
            self.spec = (1 - EMA) * self.spec + EMA * seconds
        else:
            self.plain = (1 - EMA) * self.plain + EMA * seconds


class ProbeBackoff:
    """When speculation is off, when to draft once anyway to re-measure acceptance and cost: after
    `interval` plain steps, and each probe that still finds no gain doubles the wait (up to
    `max_interval`); a step that speculates resets it."""

    def __init__(self, interval: int, max_interval: int = MAX_PROBE_INTERVAL):
        self.base_interval = self.interval = interval
        self.max_interval = max_interval
        self.plain_steps = 0  # plain steps since the last probe
        self.probed = False  # the previous step was a probe

    def should_probe(self, speculating: bool) -> bool:
        """Called once per step with the cost model's verdict; True: this (plain) step probes."""
        if speculating:
            self.interval, self.plain_steps, self.probed = self.base_interval, 0, False
            return False
        if self.probed:  # the probe did not make speculation pay: wait longer for the next one
            self.interval = min(2 * self.interval, self.max_interval)
            self.probed = False
        self.plain_steps += 1
        if self.plain_steps >= self.interval:
            self.plain_steps, self.probed = 0, True
            return True
        return False


class CostModel:
    """Seconds per target forward over T new tokens, T = 1..max_tokens (shared by requests)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.seconds: list[float | None] = [None] * (max_tokens + 1)

    def profile(self, target, prefix_len: int = 64, repeats: int = 3) -> None:
        cache = target.new_cache(prefix_len + self.max_tokens + 1)
        ids = torch.zeros(1, prefix_len, dtype=torch.long)
        target(ids, torch.arange(prefix_len)[None], cache, num_logits=1)
        for T in range(1, self.max_tokens + 1):
            times = []
            for _ in range(repeats):
                cache.rollback(prefix_len)
                t0 = time.perf_counter()
                target(torch.zeros(1, T, dtype=torch.long), torch.arange(prefix_len, prefix_len + T)[None], cache)
                times.append(time.perf_counter() - t0)
            self.seconds[T] = sorted(times)[len(times) // 2]

    @property
    def profiled(self) -> bool:
        return self.seconds[1] is not None

    def observe(self, T: int, seconds: float) -> None:
        if 1 <= T <= self.max_tokens:
            old = self.seconds[T]
            self.seconds[T] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def relative(self, T: int) -> float:
        T = min(max(T, 1), self.max_tokens)
        base = self.seconds[1]
        return (self.seconds[T] or base * T) / base if base else float(T)


class AdaptiveK:
    """Per-request choice of k."""

    def __init__(self, k_max: int, cost: CostModel, probe_interval: int = 16, previous: "AdaptiveK | None" = None,
                 prior: float = PRIOR_ACCEPTANCE):
        """prior: the acceptance assumed before any step is seen (the proposer's acceptance_prior)."""
        self.k_max = k_max
        self.cost = cost
        self.acceptance = prior
        self._accepted, self._tested = prior, 1.0  # EMAs of positions accepted / observed
        self.probes = ProbeBackoff(probe_interval)
        self.draft_seconds: float | None = None  # per drafted token, EMA over this request's steps
        self.overhead = StepOverhead()  # outside the draft and verify forwards
        self.steps = 0
        if previous is not None:  # the previous request's estimates are this one's priors
            self._accepted, self._tested, self.acceptance = previous._accepted, previous._tested, previous.acceptance
            self.draft_seconds = previous.draft_seconds
            self.overhead.spec, self.overhead.plain = previous.overhead.spec, previous.overhead.plain
            self.probes.interval = previous.probes.interval

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Per-position acceptance a from truncated-geometric observations: m of k drafts accepted shows
        m successes and, if m < k, one failure; positions after it were never tested. The estimate is
        (EMA of successes) / (EMA of tested positions), the pooled maximum-likelihood one. (It was m / k
        per step, which counts untested positions as failures and so pulled a, and k, down as k grew:
        qdraft at adaptive k drafted 2.5 tokens a step at 0.91 acceptance, 1.49x, where fixed k = 4 gave 1.77x.)"""
        if num_drafted == 0:
            return
        tested = num_accepted + (1 if num_accepted < num_drafted else 0)
        self._accepted = (1 - EMA) * self._accepted + EMA * num_accepted
        self._tested = (1 - EMA) * self._tested + EMA * tested
        self.acceptance = min(self._accepted / self._tested, 0.99)

    def observe_step(self, num_drafted: int, draft_seconds: float, other_seconds: float) -> None:
        """A step's measured costs: the proposer's time, and what is neither drafting nor the verify
        forward (verification, the drafter's bookkeeping on the accepted tokens, output)."""
        self.overhead.observe(num_drafted > 0, other_seconds)
        if num_drafted == 0:
            return
        per_token = draft_seconds / num_drafted
        self.draft_seconds = per_token if self.draft_seconds is None else (1 - EMA) * self.draft_seconds + EMA * per_token

    def expected_speedup(self, k: int, draft_cost_rel: float) -> float:
        """Tokens per second at k over plain decoding's. draft_cost_rel: the proposer's own estimate of
        a drafted token's cost relative to one target token, used until steps have been measured."""
        a = min(self.acceptance, 0.99)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        base = self.cost.seconds[1]
        if not base:
            return tokens / (self.cost.relative(k + 1) + k * draft_cost_rel)
        draft = self.draft_seconds if self.draft_seconds is not None else draft_cost_rel * base
        spec = self.cost.relative(k + 1) * base + k * draft + self.overhead.spec
        return tokens * (base + self.overhead.plain) / spec

    def choose(self, draft_cost_rel: float) -> int:
        self.steps += 1
        if self.steps % PLAIN_REFRESH == 1:  # the first step, then one in PLAIN_REFRESH: measure plain
            return 0
        best_k, best = 0, 1.0
        for k in range(1, self.k_max + 1):
            s = self.expected_speedup(k, draft_cost_rel)
            if s > best * 1.02:  # a 2% margin: do not speculate for noise-level gains
                best_k, best = k, s
        if self.probes.should_probe(best_k > 0):
            return 1  # probe: re-measure acceptance and cost
        return best_k
