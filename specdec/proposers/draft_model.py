"""Draft-model speculation: a separate, smaller model with the target's tokenizer drafts k tokens
autoregressively with its own KV cache (Leviathan et al. 2023; Chen et al. 2023).

Per request (state.draft):
    cache     the draft's KV cache; invariant: it holds exactly token_ids[:cache.length]
    pending   (pre_len, fed) of the last proposal: the draft cache held pre_len tokens of the context
              plus `fed` drafted tokens when the proposal was returned
Lazy catch-up: propose() first feeds every context token the draft has not seen (the prompt on the
first call, then the recovered/bonus token and anything emitted during plain steps) in ONE forward.
After verification the cache is rolled back to the accepted drafts, e.g. context [a b c] (pre_len 3),
drafts [x y z] with x, y fed, 1 accepted -> keep [a b c x] (length 4); the next call feeds the
recovered token.

A draft with a different tokenizer is refused (ConfigError) unless extra={"universal_tokenizer": True},
which drafts through text instead (specdec/proposers/universal.py).

`draft_chain` / `draft_chains` (the autoregressive loop for one request or a batch of them: argmax
for greedy requests, a sample from warp(logits) with the request's generator otherwise, a confidence
early stop) is shared with the layer-skip and quantized self-draft drafters.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from specdec.config import ConfigError
from specdec.sampler import sample, warp
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer


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

    Greedy requests take the argmax (q is then irrelevant: probs None); sampling requests draw from
    q = warp(logits, params) with the request's generator and return q [k, V], so verification is
    exact. A row stops after a token whose draft probability max(softmax(logits)) < threshold (the
    low-confidence token itself is still proposed: verifying it costs almost nothing)."""
    tokens: list[list[int]] = [[] for _ in states]
    qs: list[list[torch.Tensor]] = [[] for _ in states]
    rows = list(range(len(states)))  # logits[i] belongs to rows[i]
    while rows:
        going = []
        for i, b in enumerate(rows):
            if ks[b] <= 0:
                continue
            params = states[b].params
            if params.greedy:
                tok = int(logits[i].argmax())
            else:
                q = warp(logits[i][None], params)[0]  # [V]
                tok = sample(q, states[b].generator)
                qs[b].append(q)
            tokens[b].append(tok)
            unsure = threshold > 0.0 and float(torch.softmax(logits[i].float(), -1).max()) < threshold
            if len(tokens[b]) < ks[b] and not unsure:
                going.append(b)
        if going:
            logits = step(going, [tokens[b][-1] for b in going])
        rows = going
    return [Proposal(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]


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


@torch.inference_mode()
def time_one_step(model, layers: list[int] | None = None, repeats: int = 3) -> float:
    """A first estimate of seconds per drafted token: a one-token forward after a short prefix
    (proposers refine it from every proposal)."""
    cache = model.new_cache(16)
    model(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], cache, num_logits=1, layers=layers)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[4 + i]]), cache, layers=layers)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def check_same_vocab(target_tok, draft_tok, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError(f"draft model {draft_name!r} has a different vocabulary than the target "
                          f"({draft_tok.vocab_size} vs {target_tok.vocab_size} tokens); draft_model needs the "
                          f"same tokenizer, or extra={{\"universal_tokenizer\": true}} to draft through text "
                          f"(lossless, deterministic drafts)")


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    deterministic = False  # sampling requests get q

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.load_model is None:
            raise ConfigError("draft_model needs a model loader (use LLM(...) or the CLI)")
        unknown = sorted(set(ctx.config.extra) - {"universal_tokenizer"})
        if unknown:
            raise ConfigError(f"unknown draft_model option(s) in extra: {', '.join(unknown)}")
        loaded = ctx.load_model(ctx.config.model)
        self.model, draft_tok = loaded[0], loaded[1]
        self.universal = None  # a UniversalDrafter when the tokenizers differ and that is allowed
        if ctx.config.extra.get("universal_tokenizer") and ctx.tokenizer.get_vocab() != draft_tok.get_vocab():
            from specdec.proposers.universal import UniversalDrafter
            self.universal = UniversalDrafter(self.model, ctx.tokenizer, draft_tok)
        else:
            check_same_vocab(ctx.tokenizer, draft_tok, ctx.config.model)
        self.vocab = ctx.target.config.vocab_size
        self.threshold = ctx.config.draft_confidence_threshold
        self.draft_cost_per_token = time_one_step(self.model)

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        cap = len(state.prompt_ids) + state.params.max_tokens + self.ctx.config.k_max + 1
        if self.universal is not None:
            self.universal.begin(state, cap)
            return
        state.draft["cache"] = self.model.new_cache(min(cap, self.model.max_len))

    def _forward(self, cache, tokens: list[int]) -> torch.Tensor:
        """Feed tokens at the next positions of the draft cache; logits [V] after the last one."""
        start = cache.length
        out = self.model(torch.tensor([tokens]), torch.arange(start, start + len(tokens))[None], cache,
                         num_logits=1)
        return fit_vocab(out.logits[0, -1], self.vocab)

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> Proposal:
        if self.universal is not None:
            if "ucache" not in state.draft:
                self.begin(state)
            proposal, per_token = self.universal.propose(state, k)
            if proposal.tokens:
                self.observe_draft_cost(per_token)
            return proposal
        cache = state.draft.get("cache")
        ids = state.token_ids
        if cache is None or len(ids) + k > cache.max_len:
            return EMPTY  # the draft's context is full: the target goes on alone
        t0 = time.perf_counter()
        if cache.length >= len(ids):  # never expected; keep the invariant anyway
            cache.rollback(len(ids) - 1)
        pre_len = len(ids)
        logits = self._forward(cache, ids[cache.length:])  # lazy catch-up, one forward
        proposal = draft_chain(logits, lambda tok: self._forward(cache, [tok]), state, k, self.threshold)
        state.draft["pending"] = (pre_len, cache.length - pre_len)
        if proposal.tokens:
            per_token = (time.perf_counter() - t0) / len(proposal.tokens)
            self.observe_draft_cost(per_token)
        return proposal

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        pending = state.draft.pop("pending", None)
        if pending is None:
            return
        pre_len, fed = pending
        state.draft["cache"].rollback(pre_len + min(num_accepted, fed))
