"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024-25): model-free drafting from frequency counts
over a per-request structure (prompt + output so far) and a bounded global cache of earlier
requests' outputs.

Structure: a depth-bounded suffix trie (proposers/suffix_trie.py): one node per substring of length
<= D (D = suffix_decoding_max_tree_depth) with its occurrence count and its most frequent next token,
stored compactly (a substring seen once is a position in its sequence, not a node).

Incremental updates: a cursor keeps the request's current suffixes that were seen before; appending a
token steps each of them into (or creates) its child: O(longest repeated suffix) per token, never a
rebuild. A read cursor over the global trie gives the current context's matches there.

Proposal: every suffix of the context of length m that occurs in a trie (m < D) is a candidate; from
its node follow `best` children while the path probability prod(count(child) / cont(node)) stays at
or above suffix_decoding_min_token_prob, for at most min(k, max_spec_factor * m, D - m) tokens (the
trie holds nothing deeper than D). The candidate with the most expected accepted tokens (sum of path
probabilities; ties: the longer match) is proposed as a chain (SuffixDecoding builds a tree; trees
come later).

Global cache: at the end of a request its output is added to the global trie; at most
suffix_decoding_max_cached_requests outputs are kept, least recently finished first out (a request
with the same prompt as a cached one replaces it), evicted by replaying the output with decrements.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from specdec.proposers.suffix_trie import SuffixTrie
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, register_proposer


@register_proposer("suffix")
class SuffixProposer(Proposer):
    has_model_drafter = False

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.config
        self.depth = cfg.suffix_decoding_max_tree_depth
        self.factor = cfg.suffix_decoding_max_spec_factor
        self.min_prob = cfg.suffix_decoding_min_token_prob
        self.max_cached = cfg.suffix_decoding_max_cached_requests
        self.global_trie = SuffixTrie(self.depth)
        self.cached: OrderedDict[tuple, int] = OrderedDict()  # prompt key -> its output's id in the global trie

    def begin(self, state: RequestState, prefill=None) -> None:
        trie = SuffixTrie(self.depth)
        state.draft.update(trie=trie, seq=trie.new_sequence(), cursor=[trie.root],
                           gcursor=[self.global_trie.root], gseen=0, gversion=self.global_trie.version)

    def _sync(self, state: RequestState) -> None:
        """Bring both cursors up to date with prompt + output (only the new tokens are walked)."""
        d, prompt, output = state.draft, state.prompt_ids, state.output_ids
        trie: SuffixTrie = d["trie"]
        for tok in _tokens_from(prompt, output, len(trie.seqs[d["seq"]])):
            d["cursor"] = trie.append(d["seq"], d["cursor"], tok)
        g, total = self.global_trie, len(prompt) + len(output)
        if d["gversion"] != g.version:
            d["gcursor"], d["gversion"] = g.cursor_for(_tokens_from(prompt, output, total - self.depth)), g.version
        else:
            for tok in _tokens_from(prompt, output, d["gseen"]):
                d["gcursor"] = g.follow(d["gcursor"], tok)
        d["gseen"] = total

    def propose(self, state: RequestState, k: int) -> Proposal:
        best, n = self.lookup(state, k, 1)
        return Proposal(best, match_len=n) if best else EMPTY

    propose_lookup = propose

    def lookup(self, state: RequestState, k: int, min_match: int) -> tuple[list[int], int]:
        """The best-scoring continuation after a match of at least min_match context tokens, and the
        match length."""
        if "trie" not in state.draft:
            self.begin(state)
        self._sync(state)
        best, best_key = [], (0.0, 0)
        for trie, cursor in ((state.draft["trie"], state.draft["cursor"]), (self.global_trie, state.draft["gcursor"])):
            for m in range(min_match, len(cursor)):  # cursor[m]: the context's last m tokens
                limit = min(k, math.floor(self.factor * m), self.depth - m)
                if limit <= 0:
                    continue
                tokens, score = trie.best_chain(cursor[m], limit, self.min_prob)
                if tokens and (score, m) > best_key:
                    best, best_key = tokens, (score, m)
        return best, best_key[1]

    def end(self, state: RequestState) -> None:
        if self.max_cached > 0 and state.output_ids:
            key = tuple(state.prompt_ids)
            if key in self.cached:
                self.global_trie.remove(self.cached.pop(key))
            self.cached[key] = self.global_trie.insert(list(state.output_ids))
            self.global_trie.version += 1  # other requests' cursors may now match deeper
            while len(self.cached) > self.max_cached:
                _, old = self.cached.popitem(last=False)
                self.global_trie.remove(old)
        state.draft.clear()


def _tokens_from(prompt: list[int], output: list[int], start: int) -> list[int]:
    """(prompt + output)[start:] (start >= 0 clamped), without copying the whole context."""
    start = max(start, 0)
    return prompt[start:] + output if start < len(prompt) else output[start - len(prompt):]
