"""Stochastic tree verification is lossless: on a toy vocabulary the emitted tokens follow the
target distribution, within a total-variation bound derived from the sample size (5k-20k samples:
each one runs the real verifier, ~1-7 ms on the shared 2-core machine; bounds 0.03-0.06); a deliberately
wrong verifier (no residual after a rejection) fails the same test (negative control).

Bound: for N samples over V outcomes, E[TV(empirical, p)] <= 0.5 * sqrt(V / N) and TV moves by at
most 1/N per sample, so (McDiarmid) P(TV > 0.5 sqrt(V/N) + sqrt(ln(1/delta) / (2N))) <= delta.
"""
from __future__ import annotations

import math

import pytest
import torch

from specdec.sampling_params import SamplingParams
from specdec.spec.proposer import Proposal
from specdec.spec import tree as tree_mod
from specdec.spec.tree import verify_tree

V = 10
DELTA = 1e-6
PARAMS = SamplingParams(temperature=1.0)


def tv_bound(n: int, v: int = V, delta: float = DELTA) -> float:
    return 0.5 * math.sqrt(v / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def _dirichlet(g: torch.Generator, *shape) -> torch.Tensor:
    x = -torch.log(torch.rand(*shape, V, generator=g, dtype=torch.float64))  # Gamma(1) = Dirichlet(1)
    return (x / x.sum(-1, keepdim=True)).float()


def _draw_without_replacement(q: torch.Tensor, m: int, g: torch.Generator) -> list[int]:
    return torch.multinomial(q, m, replacement=False, generator=g).tolist()


def _make_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    p_root = _dirichlet(g)  # target at the root
    p_next = _dirichlet(g, V)  # target after token x: p_next[x]
    q_root = _dirichlet(g)  # drafter at the root
    q_next = _dirichlet(g, V)
    return p_root, p_next, q_root, q_next


def _sample_tree(p_root, p_next, q_root, q_next, g, with_probs: bool, m1=3, m2=2):
    """Root with m1 children drawn from q_root without replacement; each child x gets m2 children
    from q_next[x]. Returns the proposal and the target logits per row."""
    first = _draw_without_replacement(q_root, m1, g) if with_probs else list(range(m1))
    tokens, parents, probs, rows = list(first), [-1] * m1, [q_root] * m1, [p_root] + [p_next[x] for x in first]
    for i, x in enumerate(first):
        second = _draw_without_replacement(q_next[x], m2, g) if with_probs else [(x + 1 + j) % V for j in range(m2)]
        tokens += second
        parents += [i] * m2
        probs += [q_next[x]] * m2
        rows += [p_next[y] for y in second]  # deeper rows are never used for the first two tokens
    logits = torch.stack(rows).log()
    return Proposal(tokens, torch.stack(probs) if with_probs else None, parents), logits


def _run(n: int, seed: int, with_probs: bool, verifier=verify_tree):
    p_root, p_next, q_root, q_next = _make_problem(seed)
    g = torch.Generator().manual_seed(seed + 1)
    first = torch.zeros(V, dtype=torch.long)
    pairs = torch.zeros(V, V, dtype=torch.long)
    for _ in range(n):
        prop, logits = _sample_tree(p_root, p_next, q_root, q_next, g, with_probs)
        verdict, rows = verifier(prop, logits, PARAMS, g)
        first[verdict.tokens[0]] += 1
        if len(verdict.tokens) >= 2:
            pairs[verdict.tokens[0], verdict.tokens[1]] += 1
    return p_root, p_next, first, pairs


def _first_tv(p_root, first) -> float:
    return 0.5 * float((first.float() / first.sum() - p_root).abs().sum())


def _second_tv(p_next, pairs) -> tuple[float, float]:
    """Weighted mean over x1 of TV(empirical x2 | x1, p_next[x1]) and the matching bound."""
    n = pairs.sum(-1)
    total, tv, bound = float(n.sum()), 0.0, 0.0
    for x in range(V):
        if n[x] < 200:
            continue
        w = float(n[x]) / total
        tv += w * 0.5 * float((pairs[x].float() / n[x] - p_next[x]).abs().sum())
        bound += w * tv_bound(int(n[x]), delta=DELTA / V)
    return tv, bound


@pytest.mark.parametrize("with_probs", [True, False], ids=["sampled-q", "one-hot"])
def test_tree_sampling_matches_target(with_probs):
    n = 20_000 if with_probs else 10_000
    p_root, p_next, first, pairs = _run(n, seed=3, with_probs=with_probs)
    assert _first_tv(p_root, first) < tv_bound(n)
    tv2, bound2 = _second_tv(p_next, pairs)
    assert tv2 < bound2


def _wrong_verifier(prop, logits, params, g):
    """Negative control: after a rejection, keep p instead of the residual max(0, p - q)."""
    orig = tree_mod._rejection_step

    def no_residual(p, candidates, tokens, probs, generator):
        if not candidates:
            return p
        q = probs[candidates[0] - 1]
        for r in candidates:
            x = tokens[r - 1]
            if float(torch.rand((), generator=generator)) < min(1.0, float(p[x] / q[x])):
                return r
        return p

    tree_mod._rejection_step = no_residual
    try:
        return verify_tree(prop, logits, params, g)
    finally:
        tree_mod._rejection_step = orig


def test_negative_control_is_rejected():
    n = 5_000  # its TV is ~0.28, the bound at 5k samples 0.060
    p_root, _, first, _ = _run(n, seed=3, with_probs=True, verifier=_wrong_verifier)
    assert _first_tv(p_root, first) > 2 * tv_bound(n)


def test_chain_with_probs_matches_target():
    """A chain (one child per node) is the classic speculative-sampling case."""
    n = 10_000
    p_root, p_next, q_root, q_next = _make_problem(5)
    g = torch.Generator().manual_seed(9)
    first = torch.zeros(V, dtype=torch.long)
    for _ in range(n):
        x = int(torch.multinomial(q_root, 1, generator=g))
        prop = Proposal([x], q_root[None], [-1])
        verdict, _ = verify_tree(prop, torch.stack([p_root, p_next[x]]).log(), PARAMS, g)
        first[verdict.tokens[0]] += 1
    assert _first_tv(p_root, first) < tv_bound(n)
