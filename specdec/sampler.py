"""Logits processing and sampling: temperature, top-k, top-p, min-p, per-request generators.

The same `warp` is applied to the target's logits and to a drafter's logits, which is what makes
speculative sampling exact (p and q must be processed identically).
"""
from __future__ import annotations

import math

import torch

from specdec.kernels import top_indices
from specdec.sampling_params import SamplingParams


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...]: torch.argmax(-1) (the first index of the maximum), through topk.c for
    fp32 CPU rows (0.35 -> ~0.03 ms for 5 rows of a 49k vocabulary)."""
    top = top_indices(logits, 1)
    return logits.argmax(-1) if top is None else top[..., 0]


def top_tokens(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [..., V] -> [..., k]: the k most likely tokens per row, most likely first (torch.topk's
    indices; ties in another order)."""
    top = top_indices(logits, k)
    return torch.topk(logits, k, dim=-1).indices if top is None else top


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k, top-p, min-p.
    Greedy (temperature 0) gives a one-hot of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] (non-negative, any positive total; drawn on the CPU, where per-request
    generators live), by inverting the cumulative distribution: the first token whose float64 running
    sum exceeds u x total, u uniform in [0, 1). A token of probability 0 is never drawn (its running sum
    equals the one before it). torch.multinomial took ~1.1 ms for a 49k vocabulary on a 2-vCPU Zen 4
    (one exponential variate per token), this ~0.14 ms: ~1 ms off every sampled token."""
    cdf = torch.cumsum(probs.detach().cpu(), 0, dtype=torch.float64)  # [V]
    total = float(cdf[-1])
    if not (total > 0.0 and math.isfinite(total)):
        raise ValueError(f"cannot sample: the probabilities sum to {total}")
    # u < 1 is a multiple of 2^-53, so u x total rounds to below the total: some running sum exceeds it
    u = torch.rand((), generator=generator, dtype=torch.float64) * total
    return int(torch.searchsorted(cdf, u, right=True))


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def logprobs_of(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[dict]:
    """For each row of logits [N, V] (raw, as OpenAI reports): the chosen token's logprob and the top n."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for row, tok in zip(lp, tokens):
        top = torch.topk(row, top_n) if top_n > 0 else None
        out.append({"token_id": tok, "logprob": float(row[tok]),
                    "top": [(int(i), float(v)) for v, i in zip(top.values, top.indices)] if top is not None else []})
    return out


PROMPT_LOGPROB_ROWS = 64  # LM-head rows per call: a long prompt's logits [N, V] are never held at once


def prompt_logprobs_of(model, hidden: torch.Tensor, prompt_ids: list[int], start: int, top_n: int) -> list[dict]:
    """Logprobs of prompt tokens start+1.. from the final normed hidden states hidden [N, H] of prompt
    positions start..start+N-1 (position i predicts token i+1; a last position that predicts past the
    prompt gives nothing)."""
    targets = prompt_ids[start + 1:start + 1 + hidden.shape[0]]
    out = []
    for s in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        logits = model.logits_of(hidden[s:s + PROMPT_LOGPROB_ROWS])
        out += logprobs_of(logits[:len(targets) - s], targets[s:s + PROMPT_LOGPROB_ROWS], top_n)
    return out
