"""Repetition, frequency and presence penalties and logit bias (vLLM / OpenAI semantics), applied to
the target's logits row by row, so that speculation stays exact with them.

For one row of logits, with c[v] the number of times token v occurs in the output so far and P the
tokens of the prompt and the output (vLLM's order: the bias, then the penalties):

    logits[v] += logit_bias[v]
    logits[v]  = logits[v] / r if logits[v] > 0 else logits[v] * r     for v in P  (repetition_penalty r)
    logits[v] -= frequency_penalty * c[v] + presence_penalty * (c[v] > 0)

A verify pass scores k drafted tokens at once, and its row i predicts the token after the drafts
x_1..x_i, so row i's output so far is the emitted output plus those i drafts (for a token tree, the
drafts on the node's root path: `row_prefixes`). That is what plain decoding would see had it
emitted them: every row is plain decoding's distribution, and the greedy and rejection-sampling
verifiers keep their guarantees. Model drafters (proposers/chain.py) penalize their own logits the
same way, which only raises acceptance. Logprobs are reported from the logits before this, as vLLM's
default (raw) logprobs are.
"""
from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams


def row_prefixes(tokens: list[int], parents: list[int] | None = None) -> list[list[int]]:
    """For each row of a verify pass over [last, drafts...]: the drafted tokens before it.
    A chain: row i follows tokens[:i]. A tree (parents[j]: node j's parent, -1 the root): row 0
    follows nothing, row j + 1 follows the tokens on node j's path from the root, j's own last."""
    if parents is None:
        return [tokens[:i] for i in range(len(tokens) + 1)]
    paths: list[list[int]] = []
    for j, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[j]])
    return [[]] + paths


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                    prefixes: list[list[int]] | None = None) -> torch.Tensor:
    """logits [T, V] -> penalized fp32 logits [T, V] (logits itself when params set no penalty).
    prefixes[i]: the drafted tokens before row i (row_prefixes); None: no drafts (every row sees
    output_ids alone)."""
    if not params.penalized:
        return logits
    T, V = logits.shape
    dev = logits.device
    logits = logits.float().clone()
    counts = torch.zeros(T, V, dtype=torch.float32)  # [T, V]: each row's output counts
    if output_ids:
        counts += torch.bincount(torch.tensor(output_ids), minlength=V)[:V].float()
    drafted = [(i, tok) for i, prefix in enumerate(prefixes or ()) for tok in prefix]
    if drafted:
        rows, toks = zip(*drafted)
        counts.index_put_((torch.tensor(rows), torch.tensor(toks)), torch.ones(len(rows)), accumulate=True)
    counts = counts.to(dev)
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)  # ids < V (check_bias)
        logits[:, list(ids)] += torch.tensor(biases, device=dev)
    r = params.repetition_penalty
    if r != 1.0:
        seen = counts > 0
        if prompt_ids:
            in_prompt = torch.zeros(V, dtype=torch.bool)
            in_prompt[torch.tensor(prompt_ids)] = True
            seen |= in_prompt.to(dev)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits


def check_bias(params: SamplingParams, vocab_size: int) -> None:
    """A ValueError naming the first biased token id outside the model's vocabulary."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
