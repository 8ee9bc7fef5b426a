"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) in prompt + output, and propose what followed.

Cost: O(1) a step. Each request keeps an index of its context's n-grams (NgramIndex: n-gram -> its
latest start), extended by the tokens added since the last step, so a lookup is one dict probe per n.
(It was a vectorised scan of the whole context per step: ~0.27 ms a row at ~300 tokens, 4 ms of a
16-row decode step in the server.) The index keys a window by its length and rolling hash, not by the
window itself: tuples of every n up to prompt_lookup_max = 64 took 45 MB and 0.76 s for a 2,048-token
prompt; a hit is checked against the tokens, so a hash collision costs a missed draft, never a wrong one."""
from __future__ import annotations

from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, register_proposer


_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hash's modulus
_BASE = 1_000_003


class NgramIndex:
    """The latest start of every n-gram (n_min <= n <= n_max) of a growing context, among those that
    end before its last token (so a match is followed by at least one token to propose).

    E.g. context [a b c x a b], n = 2: the suffix [a b] was last seen at 0 (its occurrence at 4 is the
    suffix itself), so lookup proposes [c x a ...][:k]."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.prefix = [0]  # prefix[i]: the rolling hash of tokens[:i]
        self.powers = [1]  # powers[n]: _BASE ** n mod _MOD
        self.latest: dict[int, int] = {}  # _key(n-gram) -> its latest start

    def _key(self, start: int, end: int) -> int:
        """The window tokens[start:end] as an int: its rolling hash, and its length."""
        h = (self.prefix[end] - self.prefix[start] * self.powers[end - start]) % _MOD
        return h * 128 + (end - start)  # (n <= 64)

    def follows(self, prompt: list[int], output: list[int]) -> bool:
        """Whether prompt + output still extends what was indexed (else: index afresh)."""
        n = len(self.tokens)
        if n == 0:
            return True
        if self.prompt_len != len(prompt) or n > len(prompt) + len(output):
            return False
        last = prompt[n - 1] if n <= len(prompt) else output[n - 1 - len(prompt)]
        return last == self.tokens[-1]

    def extend(self, prompt: list[int], output: list[int]) -> None:
        """Index the tokens of prompt + output past those already indexed."""
        old = len(self.tokens)
        if old < len(prompt):
            self.tokens.extend(prompt[old:])
        self.tokens.extend(output[max(0, len(self.tokens) - len(prompt)):])
        self.prompt_len = len(prompt)
        toks, prefix = self.tokens, self.prefix
        for t in toks[len(prefix) - 1:]:
            prefix.append((prefix[-1] * _BASE + t + 1) % _MOD)
        while len(self.powers) <= self.n_max:
            self.powers.append(self.powers[-1] * _BASE % _MOD)
        # windows ending (exclusive) at e <= L - 1 are indexed; a later start overwrites an earlier one
        for e in range(max(old, 1), len(toks)):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self.latest[self._key(e - n, e)] = e - n

    def lookup(self, n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
        """Up to k tokens after the latest earlier match of the last n tokens (longest n first), and n."""
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(n_max, self.n_max, L - 1), max(n_min, self.n_min) - 1, -1):
            start = self.latest.get(self._key(L - n, L))
            if start is not None and toks[start:start + n] == toks[L - n:]:
                return toks[start + n:start + n + k], n  # start + n <= L - 1: never empty for k >= 1
        return [], 0


@register_proposer("ngram")
class NgramProposer(Proposer):
    has_model_drafter = False

    def propose(self, state: RequestState, k: int) -> Proposal:
        found, n = self.lookup(state, k, self.ctx.config.prompt_lookup_min)
        return Proposal(found, match_len=n) if found else EMPTY

    propose_lookup = propose

    def lookup(self, state: RequestState, k: int, min_match: int) -> tuple[list[int], int]:
        """Up to k tokens after a match of at least min_match context tokens, and the match length."""
        cfg = self.ctx.config
        n_min = max(cfg.prompt_lookup_min, min_match)
        n_max = max(cfg.prompt_lookup_max, n_min)
        index = state.draft.get("ngram_index")
        if (index is None or index.n_min > n_min or index.n_max < n_max
                or not index.follows(state.prompt_ids, state.output_ids)):
            index = state.draft["ngram_index"] = NgramIndex(n_min, n_max)
        index.extend(state.prompt_ids, state.output_ids)
        return index.lookup(n_min, n_max, k)
