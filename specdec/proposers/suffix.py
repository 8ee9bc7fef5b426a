"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024-25): model-free drafting from frequency counts
over a per-request structure (prompt + output so far) and a bounded global cache of earlier
requests' outputs.

Structure: a depth-bounded suffix trie. Node = one substring of length <= D (D =
suffix_decoding_max_tree_depth); `count` = its occurrences, `cont` = occurrences followed by another
token (the sum of the children's counts), `best` = the most frequent child (ties: the latest).
E.g. [a b a b c] with D = 3 holds a(2) ab(2) aba(1) abc(1) b(2) ba(1) bab(1) bc(1) c(1) ...

Incremental updates: a cursor keeps the nodes of the sequence's current suffixes of length 0..D-1;
appending a token steps every one of them into (or creates) its child: O(D) per token, never a
rebuild. The same cursor over the global trie gives the current context's matches there.

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

from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, register_proposer


class Node:
    __slots__ = ("count", "cont", "best", "children")

    def __init__(self):
        self.count = 0
        self.cont = 0
        self.best: int | None = None  # token of the most frequent child; None: none or unknown
        self.children: dict[int, Node] = {}

    def best_child(self) -> tuple[int, "Node"] | None:
        if self.best is None or self.best not in self.children:
            if not self.children:
                return None
            self.best = max(self.children, key=lambda t: self.children[t].count)
        return self.best, self.children[self.best]


class SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()
        self.version = 0  # bumped by removals (cursors over this trie must be rebuilt)

    def step(self, cursor: list[Node], tok: int, delta: int = 1) -> list[Node]:
        """Append tok to the sequence whose suffix nodes are `cursor` ([root, len-1 node, ...]):
        add delta to each extended substring's count; returns the new cursor."""
        new = [self.root]
        for node in cursor:
            child = node.children.get(tok)
            if child is None:
                if delta < 0:
                    continue  # removal of something never inserted: nothing to undo
                child = node.children[tok] = Node()
            child.count += delta
            node.cont += delta
            if delta > 0:
                best = node.children.get(node.best) if node.best is not None else None
                if best is None or child.count >= best.count:
                    node.best = tok
            else:
                node.best = None  # recomputed on demand
                if child.count <= 0:
                    del node.children[tok]
            if len(new) < self.depth:  # keep suffixes of length < depth: they can still grow
                new.append(child)
        return new

    def insert(self, tokens: list[int], delta: int = 1) -> list[Node]:
        cursor = [self.root]
        for tok in tokens:
            cursor = self.step(cursor, tok, delta)
        return cursor

    def remove(self, tokens: list[int]) -> None:
        self.insert(tokens, -1)
        self.version += 1

    def cursor_for(self, context: list[int]) -> list[Node]:
        """Nodes of the context's suffixes of length 0..depth-1 that occur in the trie (a prefix of
        that list: if a suffix occurs, so do all shorter ones)."""
        cursor = [self.root]
        for m in range(1, min(self.depth, len(context) + 1)):
            node = self.root
            for tok in context[len(context) - m:]:
                node = node.children.get(tok)
                if node is None:
                    return cursor
            cursor.append(node)
        return cursor

    def follow(self, cursor: list[Node], tok: int) -> list[Node]:
        """Advance a read-only cursor by one context token (no counts change)."""
        new = [self.root]
        for node in cursor:
            child = node.children.get(tok)
            if child is None:
                break  # deeper suffixes cannot occur when a shorter one does not
            if len(new) < self.depth:
                new.append(child)
        return new


def best_chain(node: Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """Most frequent continuation from node: tokens and expected accepted count (sum of path probs)."""
    tokens, prob, score = [], 1.0, 0.0
    while len(tokens) < limit and node.cont > 0:
        found = node.best_child()
        if found is None:
            break
        tok, child = found
        prob *= child.count / node.cont
        if prob < min_prob:
            break
        tokens.append(tok)
        score += prob
        node = child
    return tokens, score


@register_proposer("suffix")
class SuffixProposer(Proposer):
    deterministic = True
    has_model_drafter = False

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.config
        self.depth = cfg.suffix_decoding_max_tree_depth
        self.factor = cfg.suffix_decoding_max_spec_factor
        self.min_prob = cfg.suffix_decoding_min_token_prob
        self.max_cached = cfg.suffix_decoding_max_cached_requests
        self.global_trie = SuffixTrie(self.depth)
        self.cached: OrderedDict[tuple, list[int]] = OrderedDict()  # prompt key -> output, oldest first

    def begin(self, state: RequestState, prefill=None) -> None:
        trie = SuffixTrie(self.depth)
        state.draft.update(trie=trie, cursor=[trie.root], seen=0, gcursor=[self.global_trie.root], gseen=0,
                           gversion=self.global_trie.version)

    def _sync(self, state: RequestState) -> None:
        """Bring both cursors up to date with token_ids (only the new tokens are walked)."""
        d, ids = state.draft, state.token_ids
        trie: SuffixTrie = d["trie"]
        for tok in ids[d["seen"]:]:
            d["cursor"] = trie.step(d["cursor"], tok)
        d["seen"] = len(ids)
        g = self.global_trie
        if d["gversion"] != g.version:
            d["gcursor"], d["gversion"] = g.cursor_for(ids), g.version
        else:
            for tok in ids[d["gseen"]:]:
                d["gcursor"] = g.follow(d["gcursor"], tok)
        d["gseen"] = len(ids)

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
        for cursor in (state.draft["cursor"], state.draft["gcursor"]):
            for m in range(min_match, len(cursor)):  # cursor[m]: the node of the context's last m tokens
                limit = min(k, math.floor(self.factor * m), self.depth - m)
                if limit <= 0:
                    continue
                tokens, score = best_chain(cursor[m], limit, self.min_prob)
                if tokens and (score, m) > best_key:
                    best, best_key = tokens, (score, m)
        return best, best_key[1]

    def end(self, state: RequestState) -> None:
        if self.max_cached > 0 and state.output_ids:
            key = tuple(state.prompt_ids)
            if key in self.cached:
                self.global_trie.remove(self.cached.pop(key))
            self.cached[key] = list(state.output_ids)
            self.global_trie.insert(self.cached[key])
            self.global_trie.version += 1  # other requests' cursors may now match deeper
            while len(self.cached) > self.max_cached:
                _, old = self.cached.popitem(last=False)
                self.global_trie.remove(old)
        state.draft.clear()
