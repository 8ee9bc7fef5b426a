"""EAGLE-2's dynamic draft tree, step by step (eagle_graph.py captures the same tree for CUDA graphs,
keeping each depth's keys in the cache where this recomputes the frontier's ancestors in one block).

Depth 1 is the top-k of the head's log-probabilities at the last emitted token. Each further depth
forwards the frontier nodes through the head and scores their top-k children by cumulative
log-probability; only the eagle_topk best nodes of a depth are expanded. After num_steps depths every
node is reranked and the best `budget` are verified. A parent scores at least as high as its children,
so the cut is a tree.
"""
from __future__ import annotations

from typing import Callable

import torch

from specdec.spec.proposer import Proposal
from specdec.spec.tree import tree_mask


def rerank(tok: list[int], par: list[int], val: list[float], budget: int) -> Proposal:
    """EAGLE-2's final cut: the `budget` nodes of highest cumulative log-probability, in that order (node i
    is the i-th most likely: adaptive k learns each rank's acceptance, spec/tree_shares.py's RankShares). A
    child's value is at most its parent's and the sort is stable, so a parent comes before its children and
    the cut is a tree, in topological order."""
    keep = sorted(range(len(tok)), key=lambda n: -val[n])[:budget]
    index = {n: i for i, n in enumerate(keep)}
    return Proposal([tok[n] for n in keep], None, [index[par[n]] if par[n] != -1 else -1 for n in keep])


def dynamic_tree(root_logprobs: torch.Tensor, root_out: torch.Tensor, committed: int, cache, budget: int,
                 topk: int, num_steps: int, draft_ids: torch.Tensor,
                 forward: Callable[[list[int], torch.Tensor, list[int], torch.Tensor], torch.Tensor],
                 logprobs: Callable[[torch.Tensor], torch.Tensor]) -> Proposal:
    """root_logprobs [Vd] and root_out [H]: the head at the last emitted token; committed: the draft
    cache's committed rows (every node attends to them); cache: the draft KV. Each depth forwards a block,
    the frontier's root paths (its forwarded ancestors, then itself), written over the cache from
    `committed` on: `forward(tokens, parent_outs [m, H], depths, tree [m, m] bool) -> outs [m, H]`, each
    row seeing the committed rows and its ancestors (tree_mask); logprobs(outs) -> [m, Vd]. An ancestor
    is computed again rather than kept: its row costs nothing beside the frontier's (the head's weights
    are read once a pass), and a block is a verify pass's tree, which the C layer runs as one. Returns the
    `budget` likeliest nodes as a Proposal."""
    K = topk
    top = root_logprobs.topk(K)
    # node lists: target token, parent node (-1 root), cumulative log-prob, depth
    tok = draft_ids[top.indices].tolist()
    par, val, dep = [-1] * K, top.values.tolist(), [1] * K
    frontier, outs = list(range(K)), {-1: root_out}
    # the `budget` likeliest nodes lie at most `budget` deep (each has its ancestors before it): the
    # expansion stops there, and a small budget drafts the same nodes in fewer head passes
    for depth in range(2, min(num_steps, budget) + 1):
        block = set(frontier)
        for nd in frontier:
            a = par[nd]
            while a != -1 and a not in block:
                block.add(a)
                a = par[a]
        block = sorted(block, key=lambda n: (dep[n], n))  # parents first
        row = {n: i for i, n in enumerate(block)}
        tree = tree_mask([row.get(par[n], -1) for n in block])[1:, 1:]  # [m, m] on the host, without the root
        cache.length = committed
        out = forward([tok[n] for n in block], torch.stack([outs[par[n]] for n in block]),
                      [dep[n] for n in block], tree)
        out = out[[row[n] for n in frontier]]  # [m, H]
        for i, nd in enumerate(frontier):
            outs[nd] = out[i]
        scores = torch.tensor([val[n] for n in frontier], device=out.device)[:, None] + logprobs(out)  # [m, Vd]
        cand = scores.topk(K, dim=-1)  # [m, K]
        values, children = cand.values.tolist(), draft_ids[cand.indices].tolist()
        new = []
        for i, nd in enumerate(frontier):
            for v, child in zip(values[i], children[i]):
                tok.append(child)
                par.append(nd)
                val.append(v)
                dep.append(depth)
                new.append(len(tok) - 1)
        frontier = sorted(new, key=lambda n: -val[n])[:K]
    return rerank(tok, par, val, budget)
