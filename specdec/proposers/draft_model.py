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

In the serving engine (propose_batch) the drafter's keys/values live in the engine's KV blocks
(specdec/proposers/paged_draft.py), and the rows of a decode batch draft together.
"""
from __future__ import annotations

import time
import warnings

import torch

from specdec.cache.kv_cache import kv_dtype
from specdec.cache.paged_cache import PagedKVPool
from specdec.config import ConfigError
from specdec.proposers.chain import (draft_chain, draft_chains, feed_tokens, fit_vocab,  # noqa: F401 (re-exported)
                                     time_one_step, within_context)
from specdec.proposers.paged_draft import BATCH_CATCHUP, PagedDraft
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer


def check_same_vocab(target_tok, draft_tok, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError(f"draft model {draft_name!r} has a different vocabulary than the target "
                          f"({draft_tok.vocab_size} vs {target_tok.vocab_size} tokens); draft_model needs the "
                          f"same tokenizer, or extra={{\"universal_tokenizer\": true}} to draft through text "
                          f"(lossless, deterministic drafts)")


@register_proposer("draft_model")
class DraftModelProposer(Proposer):

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
        self.paged = None if self.universal is not None else PagedDraft(self.model, self.vocab)
        if self.universal is None and self.model.max_len < ctx.target.max_len:
            warnings.warn(f"the draft model's context ({self.model.max_len} tokens) is shorter than the target's "
                          f"({ctx.target.max_len}): past it a request decodes without drafts", RuntimeWarning,
                          stacklevel=2)

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        """The own cache is made when propose() first needs it: in the serving engine the drafter's
        keys/values live in the engine's blocks instead (propose_batch, specdec/proposers/paged_draft.py)."""
        if self.universal is not None:
            cap = len(state.prompt_ids) + state.params.max_tokens + self.ctx.config.k_max + 1
            self.universal.begin(state, cap)

    def _own_cache(self, state: RequestState):
        if "cache" not in state.draft:
            cap = len(state.prompt_ids) + state.params.max_tokens + self.ctx.config.k_max + 1
            state.draft["cache"] = self.model.new_cache(min(cap, self.model.max_len))
        return state.draft["cache"]

    def kv_bytes_per_block(self, block_size: int) -> int:
        if self.paged is None:
            return 0
        return PagedKVPool.bytes_per_block(self.model.config, block_size, kv_dtype(self.model))

    @torch.inference_mode()
    def propose_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        """The engine's rows: one forward per draft step for all of them, keys/values in the engine's blocks."""
        if self.paged is None or not PagedDraft.applies(states):
            return super().propose_batch(states, ks)
        behind = max((len(s.token_ids) - s.draft.get("paged_len", 0) for s, k in zip(states, ks)
                      if self.paged.room(s, k) > 0), default=0)  # (a row past the draft's context catches up never)
        t0 = time.perf_counter()
        proposals = self.paged.propose(states, ks, self.threshold)
        n = sum(len(p.tokens) for p in proposals)
        if n and behind <= BATCH_CATCHUP:  # a prompt's catch-up is not a per-token drafting cost
            self.observe_draft_cost((time.perf_counter() - t0) / n)
        return proposals

    def on_preempted(self, state: RequestState) -> None:
        PagedDraft.reset(state)

    def _forward(self, cache, tokens: list[int]) -> torch.Tensor:
        """Feed tokens at the next positions of the draft cache; logits [V] after the last one."""
        return fit_vocab(feed_tokens(self.model, cache, tokens), self.vocab)

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> Proposal:
        if self.universal is not None:
            if "ucache" not in state.draft:
                self.begin(state)
            proposal, per_token = self.universal.propose(state, k)
            if proposal.tokens:
                self.observe_draft_cost(per_token)
            return proposal
        cache = self._own_cache(state)
        ids = state.token_ids
        k = within_context(k, cache.max_len, len(ids))
        if k <= 0:
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
        if PagedDraft.on_verified(state, num_accepted):
            return
        pending = state.draft.pop("pending", None)
        if pending is None:
            return
        pre_len, fed = pending
        state.draft["cache"].rollback(pre_len + min(num_accepted, fed))

