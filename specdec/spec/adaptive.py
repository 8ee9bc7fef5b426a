"""Adaptive speculation length from a measured cost model.

    expected tokens per step   E(k) = (1 - a^(k+1)) / (1 - a)       (a: acceptance rate, EMA)
    relative cost of a step    C(k) = c_verify(k+1) / c_1 + k * c_draft / c_1
    choose k in 0..k_max maximising E(k) / C(k);  k = 0 is plain decoding.

c_verify(T) is the target's forward time over T tokens, measured on this machine (a short profile
at first use, then refined online by every verify pass). When the best k gives no gain, speculation
is off for the request; every `probe_interval` plain steps it drafts once to re-measure acceptance.
"""
from __future__ import annotations

import time

import torch

PRIOR_ACCEPTANCE = 0.6
EMA = 0.3


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

    def __init__(self, k_max: int, cost: CostModel, probe_interval: int = 16):
        self.k_max = k_max
        self.cost = cost
        self.acceptance = PRIOR_ACCEPTANCE
        self.probe_interval = probe_interval
        self.plain_steps = 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        # per-position acceptance estimate from a truncated-geometric observation
        rate = num_accepted / num_drafted if num_accepted < num_drafted else 1.0
        self.acceptance = (1 - EMA) * self.acceptance + EMA * min(rate, 0.99)

    def expected_speedup(self, k: int, draft_cost_rel: float) -> float:
        a = min(self.acceptance, 0.99)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (self.cost.relative(k + 1) + k * draft_cost_rel)

    def choose(self, draft_cost_rel: float) -> int:
        best_k, best = 0, 1.0
        for k in range(1, self.k_max + 1):
            s = self.expected_speedup(k, draft_cost_rel)
            if s > best * 1.02:  # a 2% margin: do not speculate for noise-level gains
                best_k, best = k, s
        if best_k == 0:
            self.plain_steps += 1
            if self.plain_steps % self.probe_interval == 0:
                return 1  # probe: re-measure acceptance
        return best_k
