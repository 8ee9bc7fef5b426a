"""The depth-bounded suffix trie behind suffix decoding (proposers/suffix.py), stored compactly.

Logically it is a trie of every substring of length <= D (`depth`) of a set of token sequences:
node = one substring, `count` = its occurrences, `cont` = its occurrences followed by another token
within depth (the sum of its children's counts), `best` = its most frequent child (ties: the latest to
reach the top count). E.g. [a b a b c] with D = 3 holds a(2) ab(2) aba(1) abc(1) b(2) ba(1) bab(1)
bc(1) c(1) ...

Stored compactly: a substring seen once is no node but a *position*, an int (sequence id << 32 | the
index just past its end), since what follows it is the rest of that sequence. Only the root and the
substrings seen twice or more are Node objects, and a Node's child seen once is a position. A position
seen again becomes a Node, one level at a time (its own child stays a position). Text repeats few long
substrings, so this keeps ~2-3 entries per token instead of ~D (SmolLM2's answers, D = 24: 19.8 -> 2.4
within a request's prompt and answer, 15.1 -> 3.2 over a cache of answers), and most of them are ints,
which Python's garbage collector does not track (a full collection walked every node of the old trie:
~0.15 s per 100k nodes, ~1 GB and seconds of pauses for a cache of 1000 answers).

Cursors. A sequence being added keeps the Nodes of its current suffixes of lengths 0..j: the suffixes
seen before, always the shortest ones (a substring is seen at least as often as any longer one); longer
suffixes were seen only here and cost nothing. A context matched against the trie (`follow`,
`cursor_for`) keeps one entry per matching suffix length, a Node or a position.
"""
from __future__ import annotations

SEQ_SHIFT = 32
END_MASK = (1 << SEQ_SHIFT) - 1


class Node:
    __slots__ = ("count", "cont", "best", "children")

    def __init__(self, count: int = 0):
        self.count = count
        self.cont = 0
        self.best: int | None = None  # token of the most frequent child; None: none or unknown
        self.children: dict[int, Node | int] = {}  # token -> Node, or a position (seen once)


def count_of(entry: Node | int) -> int:
    return 1 if type(entry) is int else entry.count


class SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()
        self.seqs: dict[int, list[int]] = {}  # sequence id -> its tokens (positions point into them)
        self.version = 0  # bumped by removals (read cursors over this trie must be rebuilt)
        self._next_id = 0

    # ------------------------------------------------------------------------ adding and removing

    def new_sequence(self) -> int:
        """An empty sequence to grow token by token with append(); returns its id."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.seqs[seq_id] = []
        return seq_id

    def append(self, seq_id: int, cursor: list[Node], tok: int) -> list[Node]:
        """Append tok to a sequence whose suffix Nodes are `cursor` ([root, length-1 Node, ...]): every
        substring ending at tok gains an occurrence; returns the new cursor."""
        seq = self.seqs[seq_id]
        seq.append(tok)
        pos = (seq_id << SEQ_SHIFT) | len(seq)
        new = [self.root]
        for length, node in enumerate(cursor):  # node: the suffix of this length before tok
            child = node.children.get(tok)
            node.cont += 1
            if child is None:  # first seen here
                node.children[tok] = pos
                child_count = 1
            else:
                if type(child) is int:  # seen once before: now a Node
                    child = node.children[tok] = self._node_from(child, length + 1)
                child.count += 1
                child_count = child.count
                if len(new) == length + 1 and len(new) < self.depth:
                    new.append(child)
            best = node.children.get(node.best) if node.best is not None else None
            if best is None:  # unknown since a removal (or a first child): the most frequent, this one included
                node.best = max(node.children, key=lambda t: count_of(node.children[t]))
            elif child_count >= count_of(best):
                node.best = tok
        return new

    def _node_from(self, pos: int, length: int) -> Node:
        """The Node of a substring of `length` seen once, ending at pos, with that one occurrence (the
        caller adds the new one); its continuation there, if any within depth, is its one child."""
        node = Node(1)
        seq, end = self.seqs[pos >> SEQ_SHIFT], pos & END_MASK
        if length < self.depth and end < len(seq):
            node.children[seq[end]] = pos + 1
            node.cont = 1
            node.best = seq[end]
        return node

    def insert(self, tokens: list[int]) -> int:
        """Add a whole sequence; returns its id (for remove)."""
        seq_id = self.new_sequence()
        cursor = [self.root]
        for tok in tokens:
            cursor = self.append(seq_id, cursor, tok)
        return seq_id

    def remove(self, seq_id: int) -> None:
        """Take a sequence's occurrences out again (what it alone held goes; a Node stays a Node)."""
        cursor = [self.root]
        for tok in self.seqs.pop(seq_id):
            new = [self.root]
            for length, node in enumerate(cursor):
                child = node.children.get(tok)
                if child is None:
                    continue  # cannot happen for an added sequence
                node.cont -= 1
                node.best = None  # recomputed on demand
                if count_of(child) <= 1:
                    del node.children[tok]  # with everything under it: all within this sequence
                    continue
                child.count -= 1
                if len(new) == length + 1 and len(new) < self.depth:
                    new.append(child)
            cursor = new
        self.version += 1

    # --------------------------------------------------------------------------------- reading

    def child(self, entry: Node | int, tok: int) -> Node | int | None:
        """The entry of entry's substring + tok, or None if that was never seen."""
        if type(entry) is int:
            seq, end = self.seqs.get(entry >> SEQ_SHIFT), entry & END_MASK
            return entry + 1 if seq is not None and end < len(seq) and seq[end] == tok else None
        return entry.children.get(tok)

    def stats(self, path: list[int]) -> tuple[int, int]:
        """(count, cont) of a substring (0, 0 if never seen); for tests and inspection."""
        if len(path) > self.depth:
            return 0, 0
        entry: Node | int | None = self.root
        for tok in path:
            entry = self.child(entry, tok)
            if entry is None:
                return 0, 0
        if type(entry) is int:
            seq, end = self.seqs[entry >> SEQ_SHIFT], entry & END_MASK
            return 1, int(len(path) < self.depth and end < len(seq))
        return entry.count, entry.cont  # the root: (0, number of tokens)

    def cursor_for(self, context: list[int]) -> list[Node | int]:
        """Entries of the context's suffixes of length 0..depth-1 that occur in the trie (a prefix of
        that list: if a suffix occurs, so do all shorter ones)."""
        cursor: list[Node | int] = [self.root]
        for m in range(1, min(self.depth, len(context) + 1)):
            entry: Node | int | None = self.root
            for tok in context[len(context) - m:]:
                entry = self.child(entry, tok)
                if entry is None:
                    return cursor
            cursor.append(entry)
        return cursor

    def follow(self, cursor: list[Node | int], tok: int) -> list[Node | int]:
        """Advance a read cursor by one context token (no counts change)."""
        new: list[Node | int] = [self.root]
        for entry in cursor:
            child = self.child(entry, tok)
            if child is None:
                break  # deeper suffixes cannot occur when a shorter one does not
            if len(new) < self.depth:
                new.append(child)
        return new

    def best_chain(self, entry: Node | int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of an entry, at most `limit` tokens, while its path probability
        prod(count(child) / cont(node)) stays >= min_prob: tokens and expected accepted count (the sum
        of the path probabilities)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            if type(entry) is int:  # seen once: the rest of its sequence, each token with probability 1
                seq, end = self.seqs.get(entry >> SEQ_SHIFT, ()), entry & END_MASK  # (): removed since
                rest = seq[end:end + limit - len(tokens)]
                tokens += rest
                for _ in rest:  # summed one by one, as a walk over nodes would (scores are compared)
                    score += prob
                break
            if entry.cont <= 0:
                break
            tok = best_child(entry)
            child = entry.children[tok]
            prob *= count_of(child) / entry.cont
            if prob < min_prob:
                break
            tokens.append(tok)
            score += prob
            entry = child
        return tokens, score


def best_child(node: Node) -> int:
    """The token of a Node's most frequent child (the node has children)."""
    if node.best is None or node.best not in node.children:
        node.best = max(node.children, key=lambda t: count_of(node.children[t]))
    return node.best
