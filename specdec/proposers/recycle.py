"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure"): a training-free tree drafter
that reuses the candidates every target pass already computed and decoding throws away.

Adjacency matrix M [V, W]: M[t] = the target's top-W next tokens the last time token t was an input
row of a target pass (every verify row, accepted or not, in any request; and the prompt's last
PREFILL_ROWS tokens, whose logits the LM head computes from the prefill's hidden states). A
draft is a static tree read out of M from the last token: node path (r1, r2, ...) is the r1-th
candidate after the last token, then the r2-th candidate after that one, and so on. Nodes whose
candidates are not known yet (M[t] = -1) are left out with their subtrees.

The tree's shape is fixed: every path up to MAX_DEPTH deep with ranks < W, ordered by the product of
RANK_SHARE[r] over its ranks (the share of steps whose next token was M's rank-r candidate); a step
drafts the first k paths of that order, which is a tree (a path's prefix scores higher, so it comes
first): (0), (0 0), (1), (2), (0 0 0), (0 1), (1 0), ... Measured with a 16-node tree (greedy, fp32,
chat/code/qa/math/summarization, 643 steps), the accepted path went through (0) in 37% of the steps,
(0 0) 16%, (1) 8%, (2) 6.5%, (0 0 0) 6.4%, (1 0) 2.8%, (0 1) 2.6%, (3) 2%. The paper verifies ~80 nodes on a GPU; a CPU pass over 8 rows
already costs more than one over 1, so k stays small and adaptive k chooses it.

M lives on the proposer (one per engine), shared by its requests: what one request's passes saw
drafts for the next. It changes only what is drafted, never what is accepted: drafts are verified
as deterministic proposals (q one-hot), so greedy and sampled outputs stay exact.
"""
from __future__ import annotations

import heapq
import math

import torch

from specdec.kernels import linear
from specdec.sampler import top_tokens
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer

WIDTH = 4  # candidates kept per token (the paper keeps 8 for its 80-node trees)
PREFILL_ROWS = 64  # a request's last prompt tokens recorded from its prefill
MAX_DEPTH = 6
# the share of steps whose next token was M's rank-r candidate (measured, see above); only the order of
# the paths depends on these
RANK_SHARE = (0.40, 0.08, 0.065, 0.02)


def path_share(path: tuple[int, ...], rank_share: tuple[float, ...] = RANK_SHARE) -> float:
    """The prior chance that the accepted path goes through this node: the product of its ranks' shares."""
    return math.prod(rank_share[r] for r in path)


def tree_order(num_nodes: int, width: int = WIDTH, max_depth: int = MAX_DEPTH,
               rank_share: tuple[float, ...] = RANK_SHARE) -> list[tuple[int, ...]]:
    """The num_nodes most likely paths (tuples of candidate ranks), best first; prefix-closed."""
    order: list[tuple[int, ...]] = []
    frontier = [(-rank_share[r], (r,)) for r in range(width)]  # max-heap by path probability
    heapq.heapify(frontier)
    while frontier and len(order) < num_nodes:
        neg, path = heapq.heappop(frontier)
        order.append(path)
        if len(path) < max_depth:
            for r in range(width):
                heapq.heappush(frontier, (neg * rank_share[r], path + (r,)))
    return order


@register_proposer("recycle")
class TokenRecyclingProposer(Proposer):
    acceptance_prior = 0.45

    def __init__(self, ctx):
        super().__init__(ctx)
        vocab = ctx.target.config.vocab_size
        self.candidates = torch.full((vocab, WIDTH), -1, dtype=torch.int64)  # M [V, W]; -1: not seen yet
        self.order = tree_order(max(ctx.config.k_max, 1))
        self.shares = [path_share(path) for path in self.order]  # tree_shares

    def tree_shares(self) -> list[float]:
        return self.shares

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        """Record the prompt's last PREFILL_ROWS tokens: the prefill computed logits for its last row
        only; the LM head over the other rows' hidden states costs about one decode step."""
        if prefill is None:
            return
        out = prefill.forward
        n = min(PREFILL_ROWS, len(state.prompt_ids), out.hidden.shape[1])
        if n > 1:
            logits = linear(out.hidden[0, -n:-1], self.ctx.target.lm_head.weight)  # [n - 1, V]
            self._record(state.prompt_ids[-n:-1], logits)
        self._record(state.prompt_ids[-1:], out.logits[0, -1:])

    def propose(self, state: RequestState, k: int) -> Proposal:
        M = self.candidates
        row_of: dict[tuple[int, ...], int] = {(): -1}  # path -> node index (-1: the last token)
        token_of: dict[tuple[int, ...], int] = {(): state.token_ids[-1]}
        tokens: list[int] = []
        parents: list[int] = []
        for path in self.order:
            if len(tokens) >= k:
                break
            parent = path[:-1]
            if parent not in row_of:  # its parent was left out
                continue
            token = int(M[token_of[parent], path[-1]])
            if token < 0:
                continue
            row_of[path], token_of[path] = len(tokens), token
            tokens.append(token)
            parents.append(row_of[parent])
        return Proposal(tokens, parents=parents) if tokens else EMPTY

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        if target is None:
            return
        # the pass's last k + 1 logits rows belong to [last token, node 1, ..., node k]
        inputs = [state.token_ids[-2 - num_accepted]] + proposal.tokens
        self._record(inputs, target.forward.logits[0, -len(inputs):])  # [k + 1, V]

    def _record(self, inputs: list[int], logits: torch.Tensor) -> None:
        """M[inputs[i]] = the top-W tokens of logits[i] (a token seen twice keeps its later row)."""
        top = top_tokens(logits.float(), WIDTH)  # [T, W]
        self.candidates[torch.tensor(inputs)] = top.cpu()  # M stays on the CPU (the drafting reads it there)
