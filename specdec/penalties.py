"""Repetition, frequency and presence penalties, logit bias and min_tokens (vLLM / OpenAI semantics),
applied to the target's logits row by row, so that speculation stays exact with them.

For one row of logits, with c[v] the number of times token v occurs in the output so far and P the
tokens of the prompt and the output (vLLM's order: the bias, then the penalties):

    logits[v] += logit_bias[v]
    logits[v]  = logits[v] / r if logits[v] > 0 else logits[v] * r     for v in P  (repetition_penalty r)
    logits[v] -= frequency_penalty * c[v] + presence_penalty * (c[v] > 0)
    logits[v]  = -inf   for v in EOS (unless ignore_eos) and stop_token_ids, while the output is
                        shorter than min_tokens
    logits[v]  = -inf   for v outside allowed_token_ids, when given

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
                    drafts: list[int] = (), parents: list[int] | None = None, eos_ids=()) -> torch.Tensor:
    """logits [T, V] of a pass over [last, drafts...] (T = len(drafts) + 1; parents: a token tree's, None
    for a chain) -> penalized fp32 logits [T, V] (logits itself when nothing changes); row i sees
    output_ids plus the drafts before it (row_prefixes). eos_ids: the tokenizer's, for min_tokens. Only
    the columns of tokens a penalty, the bias or min_tokens can touch are computed (prompt, output,
    drafts, biased and stop ids: U of them), so a row costs ~U, not the vocabulary."""
    if not params.adjusts_logits:
        return logits
    if params.allowed_token_ids is not None:
        logits = _only_allowed(logits, params.allowed_token_ids)
    prefixes = row_prefixes(list(drafts), parents)
    assert len(prefixes) == logits.shape[0], "one row of logits per drafted token, plus one"
    stops = _min_tokens_stops(params, len(output_ids), prefixes, eos_ids)
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
            or params.logit_bias or stops):
        return logits
    T = logits.shape[0]
    r = params.repetition_penalty
    long = dict(dtype=torch.long)
    output = torch.tensor(output_ids, **long)
    prompt = torch.tensor(prompt_ids if r != 1.0 else [], **long)
    drafted = torch.tensor([tok for prefix in prefixes for tok in prefix], **long)
    bias_ids = torch.tensor([tok for tok, _ in params.logit_bias], **long)
    stop_ids = torch.tensor(sorted(t for t in stops[0] if t < logits.shape[1]) if stops else [], **long)
    touched = torch.unique(torch.cat((output, drafted, prompt, bias_ids, stop_ids)))  # [U] sorted token ids
    if touched.numel() == 0:
        return logits
    U = touched.numel()
    counts = _row_counts(touched, output, drafted, prefixes)  # [T, U]
    dev = logits.device
    counts, index = counts.to(dev), touched.to(dev)
    sub = logits[:, index].float()  # [T, U]
    if params.logit_bias:
        shift = torch.zeros(U)
        shift[torch.searchsorted(touched, bias_ids)] = torch.tensor([b for _, b in params.logit_bias])
        sub += shift.to(dev)
    if r != 1.0:
        seen = torch.zeros(U, dtype=torch.bool)
        seen[torch.searchsorted(touched, prompt)] = True
        seen = (counts > 0) | seen.to(dev)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    if params.frequency_penalty:
        sub -= params.frequency_penalty * counts
    if params.presence_penalty:
        sub -= params.presence_penalty * (counts > 0).float()
    if stops:  # the rows still short of min_tokens may not end
        short = stops[1]
        banned = torch.zeros(T, U, dtype=torch.bool)
        banned[torch.tensor(short)[:, None], torch.searchsorted(touched, stop_ids)[None]] = True
        sub = sub.masked_fill(banned.to(dev), float("-inf"))
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    out[:, index] = sub
    return out


def _only_allowed(logits: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    """fp32 logits with every column outside `allowed` at -inf (ids past the logits are none of them)."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[torch.tensor([t for t in allowed if t < logits.shape[-1]], dtype=torch.long, device=logits.device)] = True
    return logits.float().masked_fill(~keep, float("-inf"))


def _row_counts(touched: torch.Tensor, output: torch.Tensor, drafted: torch.Tensor,
                prefixes: list[list[int]]) -> torch.Tensor:
    """[T, U]: how often each touched token occurs in each row's output (the output, then the row's drafts;
    drafted: the prefixes' tokens, flattened)."""
    counts = torch.bincount(torch.searchsorted(touched, output), minlength=touched.numel()).float()
    counts = counts.repeat(len(prefixes), 1)
    rows = [i for i, prefix in enumerate(prefixes) for _ in prefix]
    if rows:
        counts.index_put_((torch.tensor(rows), torch.searchsorted(touched, drafted)), torch.ones(len(rows)),
                          accumulate=True)
    return counts


def _min_tokens_stops(params: SamplingParams, num_output: int, prefixes: list[list[int]],
                      eos_ids) -> tuple[set[int], list[int]] | None:
    """(the stop ids to mask, the rows whose output is still shorter than min_tokens), or None."""
    short = [i for i, prefix in enumerate(prefixes) if num_output + len(prefix) < params.min_tokens]
    ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    return (ids, short) if short and ids else None


def check_token_ids(params: SamplingParams, vocab_size: int, eos_ids=()) -> None:
    """A ValueError naming the first biased, allowed or stop token id outside the model's vocabulary, or
    allowed_token_ids that min_tokens would leave empty (each of them ends the output: nothing could be
    sampled before min_tokens). eos_ids: the tokenizer's."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if params.min_tokens and params.allowed_token_ids is not None:
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if ending.issuperset(params.allowed_token_ids):
            raise ValueError("allowed_token_ids: each of them ends the output (a stop token or EOS), so no token "
                             f"could be sampled before min_tokens ({params.min_tokens})")
