"""The compact suffix trie of suffix decoding (specdec/proposers/suffix_trie.py): its counts equal brute
force, read cursors advance incrementally, and every chain it proposes equals the uncompressed trie's
(every substring a node; the structure it replaced, kept here as the reference), through growth,
caching and eviction; plus what the compaction is for: few objects per token."""
import gc
import random

from specdec.proposers.suffix_trie import SuffixTrie, count_of

from conftest import substring_counts


class _RefNode:
    __slots__ = ("count", "cont", "best", "children")

    def __init__(self):
        self.count, self.cont, self.best, self.children = 0, 0, None, {}


class _ExplicitTrie:
    """Reference: one node per substring of length <= depth, the same count/cont/best rules."""

    def __init__(self, depth):
        self.depth, self.root = depth, _RefNode()

    def step(self, cursor, tok, delta=1):
        new = [self.root]
        for node in cursor:
            child = node.children.get(tok)
            if child is None:
                if delta < 0:
                    continue
                child = node.children[tok] = _RefNode()
            child.count += delta
            node.cont += delta
            if delta > 0:
                best = node.children.get(node.best) if node.best is not None else None
                if best is None:  # unknown since a removal: the most frequent child
                    node.best = max(node.children, key=lambda t: node.children[t].count)
                elif child.count >= best.count:
                    node.best = tok
            else:
                node.best = None
                if child.count <= 0:
                    del node.children[tok]
            if len(new) < self.depth:
                new.append(child)
        return new

    def insert(self, tokens, delta=1):
        cursor = [self.root]
        for tok in tokens:
            cursor = self.step(cursor, tok, delta)
        return cursor

    def cursor_for(self, context):
        cursor = [self.root]
        for m in range(1, min(self.depth, len(context) + 1)):
            node = self.root
            for tok in context[len(context) - m:]:
                node = node.children.get(tok)
                if node is None:
                    return cursor
            cursor.append(node)
        return cursor

    @staticmethod
    def best_chain(node, limit, min_prob):
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and node.cont > 0:
            if node.best is None or node.best not in node.children:
                node.best = max(node.children, key=lambda t: node.children[t].count)
            child = node.children[node.best]
            prob *= child.count / node.cont
            if prob < min_prob:
                break
            tokens.append(node.best)
            score += prob
            node = child
        return tokens, score


def test_counts_match_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        D = rng.randint(1, 6)
        seqs = [[rng.randint(0, 3) for _ in range(rng.randint(0, 25))] for _ in range(4)]
        trie = SuffixTrie(D)
        ids = [trie.insert(s) for s in seqs]
        trie.remove(ids[1])
        live = [seqs[0], seqs[2], seqs[3]]
        paths = {tuple(s[i:i + n]) for s in seqs for n in range(1, D + 2) for i in range(len(s) - n + 1)}
        for path in paths:  # the removed sequence's and too-long substrings included
            count = substring_counts(live, len(path)).get(path, 0) if len(path) <= D else 0
            cont = 0
            if len(path) < D:
                cont = sum(c for g, c in substring_counts(live, len(path) + 1).items() if g[:-1] == path)
            assert trie.stats(list(path)) == (count, cont), (D, path)


def test_read_cursor_is_incremental_and_matches_walk():
    rng = random.Random(1)
    g = SuffixTrie(5)
    g.insert([rng.randint(0, 4) for _ in range(60)])
    g.insert([rng.randint(0, 4) for _ in range(30)])
    ctx, cursor = [], [g.root]
    key = lambda entries: [e if type(e) is int else id(e) for e in entries]  # noqa: E731
    for _ in range(60):
        ctx.append(rng.randint(0, 4))
        cursor = g.follow(cursor, ctx[-1])
        assert key(cursor) == key(g.cursor_for(ctx))


def _chains(trie, cursor, rng, k):
    out = []
    for m in range(1, len(cursor)):
        limit, min_prob = min(k, trie.depth - m), rng.choice([0.0, 0.1, 0.4])
        out.append((m, limit, min_prob, trie.best_chain(cursor[m], limit, min_prob)))
    return out


def test_chains_equal_the_uncompressed_trie():
    """Per-request growth (the insertion cursor) and a global cache with eviction (read cursors): at
    every step every match length proposes what the uncompressed trie proposes, tokens and score."""
    rng = random.Random(2)
    for trial in range(30):
        D, vocab = rng.randint(2, 8), rng.randint(2, 6)
        compact, ref = SuffixTrie(D), _ExplicitTrie(D)
        cached = []
        for _ in range(rng.randint(1, 5)):  # earlier outputs, some evicted again
            s = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            cached.append((compact.insert(s), s))
            ref.insert(s)
            if rng.random() < 0.4:
                seq_id, s = cached.pop(rng.randrange(len(cached)))
                compact.remove(seq_id)
                ref.insert(s, -1)
        own, own_ref = SuffixTrie(D), _ExplicitTrie(D)
        seq, cur, cur_ref, ctx = own.new_sequence(), [own.root], [own_ref.root], []
        for _ in range(rng.randint(1, 40)):
            tok = rng.randrange(vocab)
            ctx.append(tok)
            cur, cur_ref = own.append(seq, cur, tok), own_ref.step(cur_ref, tok)
            k = rng.randint(1, 8)
            for m, limit, min_prob, got in _chains(own, cur, random.Random(len(ctx)), k):
                assert got == ref.best_chain(cur_ref[m], limit, min_prob), (trial, ctx, m)
            for node in cur_ref[len(cur):]:  # lengths the compact cursor leaves out: seen only here
                assert node.count == 1 and node.cont == 0
            g_cur = compact.cursor_for(ctx)
            g_ref = ref.cursor_for(ctx)
            assert len(g_cur) == len(g_ref)
            for m, limit, min_prob, got in _chains(compact, g_cur, random.Random(len(ctx)), k):
                assert got == ref.best_chain(g_ref[m], limit, min_prob), (trial, ctx, m)


def test_the_best_child_is_the_most_frequent_after_removals():
    """remove() clears each node's best child on its path; the next append through such a node took the
    appended token as best whatever the counts ([1, 2, 9] x 3, [1, 3, 9] removed, [1, 4, 9] added: after
    1 the chain said 4 at 0.25, not 2 at 0.75). At random, every node's best is a child of the largest count."""
    trie = SuffixTrie(4)
    for _ in range(3):
        trie.insert([1, 2, 9])
    trie.remove(trie.insert([1, 3, 9]))
    trie.insert([1, 4, 9])
    assert trie.best_chain(trie.cursor_for([1])[1], 1, 0.0) == ([2], 0.75)
    rng = random.Random(5)
    for _ in range(100):
        trie, ids = SuffixTrie(rng.randint(2, 6)), []
        for _ in range(rng.randint(2, 12)):
            ids.append(trie.insert([rng.randrange(4) for _ in range(rng.randint(1, 12))]))
            if rng.random() < 0.4:
                trie.remove(ids.pop(rng.randrange(len(ids))))
        stack = [trie.root]
        while stack:
            node = stack.pop()
            stack.extend(c for c in node.children.values() if type(c) is not int)
            if node.best in node.children:
                assert count_of(node.children[node.best]) == max(map(count_of, node.children.values()))


def test_a_negative_control_the_chain_test_catches():
    """A compact trie that forgets to carry a position's continuation into the Node it becomes must fail
    the comparison above (so that test can fail)."""
    rng = random.Random(3)

    class Forgetful(SuffixTrie):
        def _node_from(self, pos, length):
            node = super()._node_from(pos, length)
            node.children.clear()
            node.cont, node.best = 0, None
            return node

    diverged = False
    for _ in range(20):
        D = 6
        trie, ref = Forgetful(D), _ExplicitTrie(D)
        s = [rng.randrange(3) for _ in range(40)]
        trie.insert(s)
        ref.insert(s)
        ctx = s[-3:]
        a, b = trie.cursor_for(ctx), ref.cursor_for(ctx)
        for m in range(1, min(len(a), len(b))):
            diverged |= trie.best_chain(a[m], 4, 0.0) != ref.best_chain(b[m], 4, 0.0)
    assert diverged


def test_few_objects_per_token():
    """What the compaction is for: 2000 tokens of varied text at depth 24 leave a few entries per token
    (the uncompressed trie: ~D nodes per token), and few of them objects the GC tracks."""
    rng = random.Random(4)
    words = [[rng.randrange(5000) for _ in range(rng.randint(1, 3))] for _ in range(300)]
    text = [t for _ in range(800) for t in rng.choice(words)][:2000]
    before = len(gc.get_objects())
    trie = SuffixTrie(24)
    trie.insert(text)
    tracked = len(gc.get_objects()) - before
    entries, stack = 0, [trie.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            entries += 1
            if type(child) is not int:
                stack.append(child)
    ref = _ExplicitTrie(24)
    ref.insert(text)
    ref_nodes, stack = 0, [ref.root]
    while stack:
        node = stack.pop()
        ref_nodes += len(node.children)
        stack.extend(node.children.values())
    assert entries < ref_nodes / 4, (entries, ref_nodes)
    assert tracked < 2 * len(text), tracked  # Nodes and their dicts only: positions are plain ints
