"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) in prompt + output, and propose what followed.
Cost: one vectorised scan of the context per step (numpy), no model."""
from __future__ import annotations

import numpy as np

from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, register_proposer


def find_continuation(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """Tokens following the most recent earlier match of the last n tokens (longest n first), and n.

    E.g. tokens = [a b c x a b] with n=2: suffix [a b] matches at 0, so propose [c x a ...][:k]."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist(), n  # start + n <= L - 1: never empty for k >= 1
    return [], 0


@register_proposer("ngram")
class NgramProposer(Proposer):
    deterministic = True
    has_model_drafter = False

    def propose(self, state: RequestState, k: int) -> Proposal:
        found, n = self.lookup(state, k, self.ctx.config.prompt_lookup_min)
        return Proposal(found, match_len=n) if found else EMPTY

    propose_lookup = propose

    def lookup(self, state: RequestState, k: int, min_match: int) -> tuple[list[int], int]:
        """Up to k tokens after a match of at least min_match context tokens, and the match length."""
        cfg = self.ctx.config
        tokens = state.draft.get("array")
        ids = state.token_ids
        if tokens is None or len(tokens) != len(ids):
            tokens = np.asarray(ids, dtype=np.int64)
            state.draft["array"] = tokens
        n_min = max(cfg.prompt_lookup_min, min_match)
        return find_continuation(tokens, n_min, max(cfg.prompt_lookup_max, n_min), k)
