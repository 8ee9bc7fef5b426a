"""Drafting with a model whose tokenizer differs from the target's (universal assisted generation, as
transformers' `assistant_tokenizer`): the two token sequences meet through text.

    speculative_config={"method": "draft_model", "model": "other-model",
                        "extra": {"universal_tokenizer": True}}

Each step (all tokenizer work is in Rust; the text of the context is re-tokenized, not the model run):
  1. context text = target.decode(token_ids); draft ids = draft.encode(text). The draft's KV cache
     keeps the ids it was fed; only what follows their longest common prefix with the new draft ids
     is fed (after a rejection, or where re-tokenization moved a boundary, it is rolled back first).
  2. the draft model greedily drafts k tokens of its own vocabulary.
  3. their text is re-tokenized for the target together with the last few target tokens, whose
     encoding must come back unchanged (else a shorter tail is tried, down to none); what follows
     the tail is proposed. E.g. context [..., " the", " qu"], drafted text "ick brown": tail
     [" the", " qu"] -> encode(" the quick brown") = [" the", " quick", " brown"] does not start with
     the tail, nor does [" qu"] -> [" quick", " brown"]; no tail -> encode("ick brown") =
     ["ick", " brown"] is proposed.
Proposals are deterministic (q one-hot): lossless for greedy AND sampling requests (the verifier
accepts x with probability p(x)), and no random numbers are drawn.
"""
from __future__ import annotations

import time

import torch

from specdec.cache.kept_prefix import common_prefix
from specdec.proposers.chain import feed_tokens
from specdec.sampler import argmax
from specdec.spec.proposer import EMPTY, Proposal, RequestState

TAIL_TOKENS = 4  # target tokens re-encoded with the drafted text


class UniversalDrafter:
    """Drafting through text for DraftModelProposer when the vocabularies differ."""

    def __init__(self, model, target_tok, draft_tok):
        self.model, self.target_tok, self.draft_tok = model, target_tok, draft_tok

    def begin(self, state: RequestState, target_len: int) -> None:
        # draft tokens per target token vary by tokenizer: room for twice as many, within the draft's context
        state.draft["ucache"] = self.model.new_cache(min(2 * target_len + 16, self.model.max_len))
        state.draft["fed"] = []  # draft ids whose k/v are in ucache, in order

    def _feed(self, cache, fed: list[int], tokens: list[int]) -> torch.Tensor:
        logits = feed_tokens(self.model, cache, tokens)  # [V_draft]
        fed.extend(tokens)
        return logits

    def draft_ids(self, state: RequestState) -> list[int]:
        return self.draft_tok.encode(self.target_tok.decode(state.token_ids, skip_special_tokens=False))

    def to_target(self, ids: list[int], d_ctx: list[int], drafted: list[int]) -> list[int]:
        """The drafted tokens' text as target tokens continuing ids (see the module doc, step 3)."""
        base = self.draft_tok.decode(d_ctx, skip_special_tokens=False)
        full = self.draft_tok.decode(d_ctx + drafted, skip_special_tokens=False)
        text = full[len(base):] if full.startswith(base) else self.draft_tok.decode(drafted, skip_special_tokens=False)
        if not text:
            return []
        for m in range(min(TAIL_TOKENS, len(ids)), -1, -1):
            tail = ids[len(ids) - m:]
            tail_text = self.target_tok.decode(tail, skip_special_tokens=False)
            cand = self.target_tok.encode(tail_text + text, add_special_tokens=False)
            if cand[:m] == tail and len(cand) > m:
                return cand[m:]
        return []

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> tuple[Proposal, float]:
        """The proposal and seconds per drafted (target) token."""
        t0 = time.perf_counter()
        cache, fed = state.draft["ucache"], state.draft["fed"]
        d_ctx = self.draft_ids(state)
        if not d_ctx or len(d_ctx) + k > cache.max_len:
            return EMPTY, 0.0
        keep = min(common_prefix(fed, d_ctx), len(d_ctx) - 1)  # feed at least one token for fresh logits
        cache.rollback(keep)
        del fed[keep:]
        logits = self._feed(cache, fed, d_ctx[keep:])
        drafted = []
        for i in range(k):
            drafted.append(int(argmax(logits)))
            if i < k - 1:
                logits = self._feed(cache, fed, drafted[-1:])
        tokens = self.to_target(state.token_ids, d_ctx, drafted)[:k]
        return (Proposal(tokens) if tokens else EMPTY), (time.perf_counter() - t0) / max(len(tokens), 1)
