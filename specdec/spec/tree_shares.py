"""What a drafted tree of k nodes is worth: adaptive k's pricing of token trees (spec/adaptive.py).

A tree's nodes are worth their chance of lying on the accepted path, its `shares`, and a tree of k
nodes emits 1 + shares[0] + ... + shares[k-1] tokens a step on average. The chain formula has the
wrong shape for a tree: it values the i-th drafted token at a^i, while a tree's later nodes are often
siblings of earlier ones, worth several times that.

    static trees (Token Recycling, Medusa)   the proposer's prior shares, in drafting order, scaled by
                                             what the request's trees yield against them (TreeYield)
    dynamic trees (EAGLE-2)                  node i is the drafter's i-th likeliest; each rank's share
                                             is learned from the request's verified trees (RankShares)

TreeYield: a tree of k nodes is priced at 1 + s * sum(shares[:k]) tokens (each node's scaled share at
most 1), where s = EMA(accepted) / EMA(sum of the drafted nodes' shares). Recycling, chain-priced vs
tree-priced vs plain, interleaved per prompt (6 categories x 6 prompts, 64 tokens, a 2-vCPU Zen 4):
fp32 1.013x -> 1.049x (every category at least as fast); bf16 0.977x -> 0.973x (its verify passes cost
1.3x a plain one there: neither pricing finds a gain).

RankShares: an EAGLE-2 tree's nodes change every step, but their ranks do not: rank 0 is the head's
top first token, and the tree of k nodes is ranks 0..k-1 (proposers/eagle_tree.py's rerank). The accepted
path of a smaller tree is the part of this one's path that ranks below its size (a parent ranks before
its children), so one verified tree of k nodes tests every rank < k. Measured on 12 qa/code/math/
multi-turn prompts (eagle3, 3 candidates a node, 6 deep, 16 nodes, bf16): 0.44, 0.32, 0.22, 0.15, 0.14,
0.11, 0.08, 0.08, then 0.02-0.04: 2.56 tokens a step at 8 nodes, 2.79 at 16.
"""
from __future__ import annotations


class TreeYield:
    """A static-tree drafter's accepted tokens against what its node shares predicted: the pooled ratio
    of EMAs (1 until a step is seen), the scale applied to the shares."""

    MAX_SCALE = 3.0  # a request far above its prior saturates anyway: every node's share is capped at 1
    # slower than the chains' EMA: a small tree's step mostly accepts 0 or 1 token, and at 0.3 a run of
    # misses at a 40% node drove the estimate to a quarter of its truth and switched a paying tree off
    EMA = 0.1

    def __init__(self, shares: list[float]):
        self.shares = shares
        self.accepted, self.predicted = 1.0, 1.0

    @property
    def scale(self) -> float:
        return min(self.accepted / self.predicted, self.MAX_SCALE) if self.predicted > 0 else 1.0

    def expected(self, k: int) -> float:
        """Tokens a step emits drafting the first k nodes."""
        return 1.0 + sum(min(1.0, self.scale * share) for share in self.shares[:k])

    def passes(self, k: int) -> int:
        """Drafting passes of k nodes, as adaptive k prices them: one a node."""
        return k

    def update(self, num_drafted: int, num_accepted: int, accepted_nodes: list[int] | None = None) -> None:
        self.accepted = (1 - self.EMA) * self.accepted + self.EMA * num_accepted
        self.predicted = (1 - self.EMA) * self.predicted + self.EMA * sum(self.shares[:num_drafted])


class RankShares:
    """Each rank's chance of lying on the accepted path, an EMA over the steps that drafted it (starting
    from the proposer's prior). A rank never drafted in the request keeps its prior, and no rank is
    valued above the ranks before it: an estimate that fell at rank r holds for the ranks after it."""

    EMA = 0.1  # as TreeYield's: one step mostly accepts 0-2 nodes

    def __init__(self, prior: list[float], depth: int):
        """depth: the drafter's passes for a whole tree (one a depth; k nodes lie at most k deep)."""
        self.shares = list(prior)
        self.depth = depth

    def passes(self, k: int) -> int:
        return min(k, self.depth)

    def expected(self, k: int) -> float:
        """Tokens a step emits drafting the k likeliest nodes."""
        total, cap = 1.0, 1.0
        for share in self.shares[:k]:
            cap = min(cap, share)
            total += cap
        return total

    def update(self, num_drafted: int, num_accepted: int, accepted_nodes: list[int] | None = None) -> None:
        """accepted_nodes: the accepted path's node indices (None: a chain's first num_accepted; k = 1)."""
        accepted = set(range(num_accepted) if accepted_nodes is None else accepted_nodes)
        for rank in range(min(num_drafted, len(self.shares))):
            hit = 1.0 if rank in accepted else 0.0
            self.shares[rank] = (1 - self.EMA) * self.shares[rank] + self.EMA * hit

