"""A draft model's KV cache in the serving engine's blocks: the drafter drafts every row of a decode
batch together, its keys/values in a pool of its own indexed by the SAME block tables as the target's.

One block id then holds a block of the target's layers and a block of the drafter's (vLLM's layout for
a draft model), so the block manager's budget, prefix sharing, trimming and freeing cover both, and a
request's drafter needs no cache of its own. The engine sizes its blocks with the drafter's bytes
counted (Proposer.kv_bytes_per_block).

Per request (state.draft):
    paged_len  positions [0, paged_len) of the drafter's pool hold this request's context, written by
               this request's own drafter (a prefix block shared through the prefix cache is written
               again: the same tokens at the same positions, so the same keys/values; a request never
               trusts what another wrote, so stale slots left by a finished request are harmless)
    pending    (pre_len, fed) of the last proposal, as draft_model's own-cache path
A step: catch-up (every context token the drafter has not seen, in one forward: rows <= BATCH_CATCHUP
behind together, left-padded; longer ones, a prompt, alone), then the draft steps, one forward over
all rows still drafting. After verification paged_len = pre_len + min(accepted, fed). Preemption frees
the blocks: `reset` (Proposer.on_preempted) sets paged_len back to 0.
"""
from __future__ import annotations

import weakref

import torch

from specdec.cache.kv_cache import kv_dtype
from specdec.cache.paged_cache import BatchKV, PagedKVPool, SeqKV
from specdec.proposers.chain import draft_chains, fit_vocab, within_context
from specdec.spec.proposer import EMPTY, Proposal, RequestState

BATCH_CATCHUP = 8  # rows at most this many tokens behind catch up in one padded forward


class PagedDraft:
    """The drafter's pool for one engine pool, made on first use with the same blocks."""

    def __init__(self, model, vocab: int):
        self.model, self.vocab = model, vocab
        self.pool: PagedKVPool | None = None  # the drafter's pool, mirroring ...
        self._mirrors = None  # ... this engine pool (a weak reference: an id() is reused once a pool is freed)

    @staticmethod
    def applies(states: list[RequestState]) -> bool:
        kvs = [s.draft.get("target_cache") for s in states]
        return bool(kvs) and all(type(kv) is SeqKV and kv.pool is kvs[0].pool for kv in kvs)

    def pool_for(self, target: PagedKVPool) -> PagedKVPool:
        if self._mirrors is None or self._mirrors() is not target:  # one engine at a time: a new pool replaces
            self.pool = None                                          # the last one's
            self.pool = PagedKVPool.for_model(self.model.config, target.num_blocks, target.block_size,
                                              kv_dtype(self.model), target.k.device)
            self._mirrors = weakref.ref(target)
        return self.pool

    def _forward(self, pool, tables: list[list[int]], past: list[int], new: list[list[int]]) -> torch.Tensor:
        """Feed new[i] after past[i] cached tokens of rows tables[i], left-padded; logits [B, V] after each."""
        T = max(len(n) for n in new)
        ids = torch.tensor([[0] * (T - len(n)) + n for n in new])  # [B, T]
        pos = torch.tensor([[max(p + j - (T - len(n)), 0) for j in range(T)] for p, n in zip(past, new)])
        kv = BatchKV(pool, tables, past, [len(n) for n in new])
        return fit_vocab(self.model(ids, pos, kv, num_logits=1).logits[:, -1], self.vocab)

    def _catch_up(self, pool, states: list[RequestState]) -> torch.Tensor:
        """Feed each row's unseen context; its logits after the last token [B, V]."""
        tables = [s.draft["target_cache"].block_table for s in states]
        past = [min(s.draft.get("paged_len", 0), len(s.token_ids) - 1) for s in states]
        out: list[torch.Tensor | None] = [None] * len(states)
        short = [b for b, s in enumerate(states) if len(s.token_ids) - past[b] <= BATCH_CATCHUP]
        if short:
            logits = self._forward(pool, [tables[b] for b in short], [past[b] for b in short],
                                   [states[b].token_ids[past[b]:] for b in short])
            for i, b in enumerate(short):
                out[b] = logits[i]
        for b in set(range(len(states))) - set(short):  # a prompt: alone, no padding to its length
            ids = states[b].token_ids[past[b]:]
            cache = SeqKV(pool, tables[b], past[b])
            logits = self.model(torch.tensor([ids]), torch.arange(past[b], past[b] + len(ids))[None], cache,
                                num_logits=1).logits[0, -1]
            out[b] = fit_vocab(logits, self.vocab)
        for s in states:
            s.draft["paged_len"] = len(s.token_ids)
        return torch.stack(out)

    def room(self, state: RequestState, k: int) -> int:
        """k cut to the drafter's context (a draft model may have a shorter one than its target: past it, the
        row drafts nothing, and the other rows go on drafting)."""
        return within_context(k, self.model.max_len, len(state.token_ids))

    def propose(self, states: list[RequestState], ks: list[int], threshold: float) -> list[Proposal]:
        ks = [self.room(s, k) for s, k in zip(states, ks)]
        live = [b for b, k in enumerate(ks) if k > 0]
        proposals = [EMPTY] * len(states)
        if not live:
            return proposals
        rows = [states[b] for b in live]
        pool = self.pool_for(rows[0].draft["target_cache"].pool)
        pre_len = [len(s.token_ids) for s in rows]
        logits = self._catch_up(pool, rows)

        def step(idx: list[int], tokens: list[int]) -> torch.Tensor:
            sel = [rows[i] for i in idx]
            past = [s.draft["paged_len"] for s in sel]
            logits = self._forward(pool, [s.draft["target_cache"].block_table for s in sel], past,
                                   [[t] for t in tokens])
            for s in sel:
                s.draft["paged_len"] += 1
            return logits

        drafted = draft_chains(logits, step, rows, [ks[b] for b in live], threshold)
        for i, (b, p) in enumerate(zip(live, drafted)):
            rows[i].draft["pending"] = (pre_len[i], rows[i].draft["paged_len"] - pre_len[i])
            proposals[b] = p
        return proposals

    @staticmethod
    def on_verified(state: RequestState, num_accepted: int) -> bool:
        """Roll paged_len back to the accepted drafts; False if the last proposal was not paged."""
        if "paged_len" not in state.draft or "pending" not in state.draft:
            return False
        pre_len, fed = state.draft.pop("pending")
        state.draft["paged_len"] = pre_len + min(num_accepted, fed)
        return True

    @staticmethod
    def reset(state: RequestState) -> None:
        state.draft.pop("paged_len", None)
        state.draft.pop("pending", None)
