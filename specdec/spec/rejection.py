"""Verification of a drafted chain: greedy and speculative (rejection) sampling.

Vocabulary (as vLLM's RejectionSampler, arXiv 2211.17192 / 2302.01318):
  draft tokens    x_1..x_k proposed by the drafter, with draft distributions q_1..q_k
                  (None: a deterministic proposal, i.e. q_i is one-hot on x_i);
  target probs    p_1..p_{k+1} from ONE target pass over [last token, x_1..x_k];
  accepted        x_i kept while u_i < min(1, p_i(x_i) / q_i(x_i))  (greedy: x_i == argmax p_i);
  recovered       on the first rejection, a token drawn from norm(max(0, p_i - q_i));
  bonus           when all k are accepted, a token drawn from p_{k+1} (or, where a drafted x_{k+1} was cut
                  because p_{k+1}(x_{k+1}) = 0, from norm(max(0, p_{k+1} - q_{k+1})): the recovered token
                  of its certain rejection).
Every emitted token is distributed exactly as the target alone would produce it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampler import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # accepted draft tokens
    tokens: list[int]  # accepted drafts + one recovered or bonus token


def verify_greedy(draft: list[int], target_argmax: list[int]) -> Verdict:
    """target_argmax: argmax of p_1..p_{k+1} (k+1 entries)."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return Verdict(n, list(draft[:n]) + [target_argmax[n]])


def verify_sampling(draft: list[int], p: torch.Tensor, q: torch.Tensor | None,
                    generator: torch.Generator | None, cut_q: torch.Tensor | None = None) -> Verdict:
    """p: [k+1, V] warped target probs; q: [k, V] warped draft probs or None (one-hot drafts); cut_q: [V]
    the draft distribution of a token drafted after x_k and cut for having no target probability
    (Proposal.cut_probs), or None."""
    for i, x in enumerate(draft):
        q_x = float(q[i, x]) if q is not None else 1.0
        p_x = float(p[i, x])
        u = float(torch.rand((), generator=generator))
        # NOTE: q_x == 0 cannot happen for a token the drafter sampled; if it does, reject.
        if q_x > 0.0 and u < min(1.0, p_x / q_x):
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp_min(0.0)
        else:
            residual = p[i].clone()
            residual[x] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return Verdict(i, list(draft[:i]) + [sample(residual / residual.sum(), generator)])
    last = p[len(draft)]
    if cut_q is not None:
        residual = (last - cut_q).clamp_min(0.0)
        last = residual if float(residual.sum()) > 0.0 else last
    return Verdict(len(draft), list(draft) + [sample(last, generator)])
