"""The autoregressive drafting loop shared by every model drafter (draft model, quantized self-draft,
layer skipping, and the draft model's paged path in the serving engine), and its helpers:

    draft_chains  up to k tokens for each of B requests, the rows still drafting fed together: argmax
                  for greedy requests, a sample from q = warp(logits) with the request's generator
                  otherwise (q returned, so verification is exact), a confidence early stop
    unsure        which rows' draft probability max(softmax(logits)) falls below a threshold (that stop)
    fit_vocab     a drafter's logits cut or padded to the target's vocabulary
    time_one_step a first estimate of a drafter's seconds per token
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from specdec.penalties import apply_penalties
from specdec.sampler import argmax, sample, warp
from specdec.spec.proposer import Proposal, RequestState


def draft_chain(logits: torch.Tensor, step: Callable[[int], torch.Tensor], state: RequestState, k: int,
                threshold: float = 0.0) -> Proposal:
    """Draft up to k tokens. logits [V]: the drafter's prediction for the token after the context;
    step(tok) feeds a drafted token and returns the logits [V] after it. (draft_chains, one row.)"""
    return draft_chains(logits[None], lambda rows, toks: step(toks[0])[None], [state], [k], threshold)[0]


def draft_chains(logits: torch.Tensor, step: Callable[[list[int], list[int]], torch.Tensor],
                 states: list[RequestState], ks: list[int], threshold: float = 0.0) -> list[Proposal]:
    """Draft up to ks[b] tokens for each of B requests, the rows still drafting fed together.
    logits [B, V]: the drafter's prediction after each context; step(rows, tokens) feeds tokens[i] to
    row rows[i] and returns the logits [len(rows), V] after them.

    Each row's logits are penalized as the target's are (specdec/penalties.py; a no-op without
    penalties), except min_tokens' EOS mask: a drafted EOS the target masks is rejected, q being the true
    draft distribution either way. Greedy requests take the argmax (q is then irrelevant: probs None);
    sampling requests draw from q = warp(logits, params) with the request's generator and return q [k, V], so
    verification is exact. A row stops after a token whose draft probability max(softmax(logits)) < threshold (the
    low-confidence token itself is still proposed: verifying it costs almost nothing)."""
    tokens: list[list[int]] = [[] for _ in states]
    qs: list[list[torch.Tensor]] = [[] for _ in states]
    rows = list(range(len(states)))  # logits[i] belongs to rows[i]
    while rows:
        going = []
        for i, b in enumerate(rows):
            if ks[b] <= 0:
                continue
            state = states[b]
            params = state.params
            # penalized as the target's rows are (after the output and this row's drafts so far)
            row = apply_penalties(logits[i][None], params, state.prompt_ids, state.output_ids + tokens[b])[0]
            if params.greedy:
                tok = int(argmax(row))
            else:
                q = warp(row[None], params)[0]  # [V]
                tok = sample(q, state.generator)
                qs[b].append(q)
            tokens[b].append(tok)
            if len(tokens[b]) < ks[b] and not unsure(row, threshold)[0]:
                going.append(b)
        if going:
            logits = step(going, [tokens[b][-1] for b in going])
        rows = going
    return [Proposal(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]


def unsure(logits: torch.Tensor, threshold: float) -> list[bool]:
    """logits [..., V] -> per row (flattened), whether its draft probability max(softmax(logits)) is below
    threshold; all False, with no tensor work, when threshold is 0 (the stop is off)."""
    rows = logits.numel() // logits.shape[-1]
    if threshold <= 0.0:
        return [False] * rows
    return (torch.softmax(logits.float(), -1).amax(-1) < threshold).reshape(rows).tolist()


def within_context(k: int, max_len: int, num_tokens: int) -> int:
    """k cut to what a drafter of context max_len can draft after num_tokens of context: it takes the
    context's positions, then the drafted tokens' but the last (never fed); 0 past its context."""
    return max(0, min(k, max_len - num_tokens + 1))


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., V_d] -> [..., vocab]: padded embedding rows of either model never hold a
    token the (identical) tokenizer can produce; they are cut, or padded with -inf."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - v), float("-inf"))
    return torch.cat((logits, pad), dim=-1)


def feed_tokens(model, cache, tokens: list[int], layers: list[int] | None = None) -> torch.Tensor:
    """Feed tokens at the cache's next positions (through `layers` only, where given); the logits [V] after
    the last one. Inputs go to the model's device (a GraphedModel takes them on the host and copies them)."""
    start = cache.length
    dev = "cpu" if getattr(model, "takes_host_inputs", False) else model.device
    out = model(torch.tensor([tokens], device=dev), torch.arange(start, start + len(tokens), device=dev)[None], cache,
                num_logits=1, layers=layers)
    return out.logits[0, -1]


@torch.inference_mode()
def time_one_step(model, layers: list[int] | None = None, repeats: int = 3) -> float:
    """A first estimate of seconds per drafted token: a one-token forward after a short prefix
    (proposers refine it from every proposal)."""
    cache, dev = model.new_cache(16), model.device
    model(torch.zeros(1, 4, dtype=torch.long, device=dev), torch.arange(4, device=dev)[None], cache, num_logits=1,
          layers=layers)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        model(torch.zeros(1, 1, dtype=torch.long, device=dev), torch.tensor([[4 + i]], device=dev), cache,
              layers=layers)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
