"""Lookahead decoding (Fu et al. 2024): Jacobi iteration over a window of W guessed future tokens
fills an n-gram pool; n-grams from the pool that start with the last token are verified.

Vocabulary: slot s = the (s+1)-th position after the last token; the window holds a guess (and its
trajectory, the tokens it was generated from) for slots 0..W-1. A Jacobi update of slot s is the
target's argmax at slot s given the guesses before it. An n-gram (N tokens) is harvested from every
trajectory of length N: (t_1, ..., t_N) where t_{j+1} was the update produced at the position after
t_j one iteration later (the paper's diagonal n-grams). The pool keeps, per first token, the G most
recently seen (N-1)-token continuations (G = lookahead_guess_set); as in the reference
implementation's POOL_FROM_PROMPT, n-grams of the prompt and of the emitted text are added too.

How this differs from the paper (a chain decoder, no extra forward):
  * the lookahead branch rides in the verify pass as part of the drafted chain: the proposal is
    [pool candidate (N-1 tokens, if any)] + [window guesses for the slots after it], so one causal
    forward both verifies the candidate and Jacobi-updates the window (row i's argmax is the update
    of slot i). The paper uses a 2-D window (N-1 levels x W) with its own attention mask in the same
    forward; here each level is one iteration of the chain, and a window token's update conditions on
    the chain before it (candidate tokens included) rather than on its own level's trajectory.
  * window guesses are verified too (an accepted guess counts like any draft token).
  * only ONE of the G candidates is verified per step (the most recent); the paper verifies all G in
    parallel, which needs tree verification (planned with the learned-drafter issue).
  * the window is at most k long (k from the decoder: fixed or adaptive), so the adaptive k trades
    lookahead width against verify cost on this machine.
Proposals are deterministic (q one-hot); no random numbers are drawn, so sampling stays reproducible.
"""
from __future__ import annotations

from collections import OrderedDict

from specdec.config import ConfigError
from specdec.sampler import argmax
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer


class NgramPool:
    """first token -> up to G continuations of N-1 tokens, most recent last."""

    def __init__(self, n: int, guess_set: int):
        self.n, self.guess_set = n, guess_set
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        first, rest = ngram[0], ngram[1:]
        entries = self.table.setdefault(first, OrderedDict())
        entries[rest] = None
        entries.move_to_end(rest)
        if len(entries) > self.guess_set:
            entries.popitem(last=False)

    def add_sequence(self, tokens: list[int], start: int = 0) -> None:
        """Every n-gram of tokens that ends at index >= start + n - 1."""
        for j in range(max(start, 0), len(tokens) - self.n + 1):
            self.add(tuple(tokens[j:j + self.n]))

    def candidate(self, first: int) -> tuple[int, ...] | None:
        entries = self.table.get(first)
        return next(reversed(entries)) if entries else None


@register_proposer("lookahead")
class LookaheadProposer(Proposer):

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.config
        self.W, self.N, self.G = cfg.lookahead_window, cfg.lookahead_ngram, cfg.lookahead_guess_set
        if self.W < 1 or self.N < 2 or self.G < 1:
            raise ConfigError("lookahead needs lookahead_window >= 1, lookahead_ngram >= 2, lookahead_guess_set >= 1")

    def begin(self, state: RequestState, prefill=None) -> None:
        pool = NgramPool(self.N, self.G)
        pool.add_sequence(state.token_ids)
        ids = state.token_ids
        # initial guesses: context tokens (deterministic; no random numbers are drawn)
        window = [(ids[(7 * s + len(ids)) % len(ids)], ()) for s in range(self.W)]
        state.draft.update(pool=pool, window=window, pooled=len(ids), pending=None)

    def propose(self, state: RequestState, k: int) -> Proposal:
        d = state.draft
        if "pool" not in d:
            self.begin(state)
        last = state.token_ids[-1]
        cand = d["pool"].candidate(last) or ()
        # chain: the candidate covers slots 0..len(cand)-1, window guesses the slots after it
        chain = [(tok, tuple([last, *cand[:j]])[-(self.N - 2):] if self.N > 2 else ())
                 for j, tok in enumerate(cand)]
        chain += d["window"][len(cand):]
        chain = chain[:k]
        d["pending"] = chain
        return Proposal([tok for tok, _ in chain]) if chain else EMPTY

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        d = state.draft
        if "pool" not in d:
            return
        chain = (d.pop("pending", None) or [])[:len(proposal.tokens)]
        window = d["window"]
        keep = self.N - 2  # trajectory tokens kept before a slot's own token
        updates = []  # slot i's Jacobi update (from row i), with its trajectory, for i = 1..k
        if chain and target is not None:
            best = argmax(target.forward.logits[0, :len(chain) + 1]).tolist()  # [k + 1]
            for i, (tok, hist) in enumerate(chain, start=1):
                traj = (*hist, tok)
                if len(traj) == self.N - 1:
                    d["pool"].add((*traj, best[i]))  # a diagonal n-gram
                updates.append((best[i], traj[-keep:] if keep else ()))
        # shift: emitted a + 1 tokens, so new slot s is old slot s + a + 1
        shift = num_accepted + 1
        ids = state.token_ids
        new = []
        for s in range(self.W):
            old = s + shift
            if old <= len(updates):
                new.append(updates[old - 1])
            elif old < len(window):
                new.append(window[old])
            else:
                new.append((ids[(7 * s + len(ids)) % len(ids)], ()))
        d["window"] = new
        d["pool"].add_sequence(ids, d["pooled"] - self.N + 1)
        d["pooled"] = len(ids)
