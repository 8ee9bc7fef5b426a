"""Token-tree verification (SpecInfer, Medusa, EAGLE): one target pass scores every drafted node.

Vocabulary (Proposal.parents, see specdec.spec.proposer):
  row      input row of the verify pass: row 0 is the last emitted token (the root, depth 0), row i >= 1
           is drafted node i - 1;
  depth    row 0 has depth 0, a node has its parent's depth + 1; its position is prefix_len + depth;
  mask     a row sees the prefix, its ancestors and itself (tree_mask gives the [T, T] block part,
           with_prefix the whole [T, prefix + T]);
  path     the accepted rows, from the root down; the KV cache keeps exactly these.
E.g. parents [-1, -1, 0] (nodes a, b children of the root, c child of a): rows 0 (root), 1 (a), 2 (b),
3 (c); depths [0, 1, 1, 2]; row 3 sees rows 0, 1, 3; accepting a then c gives rows [0, 1, 3].

Greedy: from the root move to the child whose token is argmax p; stop where none is, emit argmax p.
Sampling (recursive rejection sampling over the children c_1..c_m of the current node, in order):
  accept c_j with probability min(1, p(c_j) / q(c_j)); on rejection p <- norm(max(0, p - q)) and
  q <- q with c_j removed, renormalised (the siblings were drawn without replacement from q); if
  all are rejected emit a sample of the final p. proposal.probs None means deterministic drafts:
  q is one-hot on each candidate in turn, i.e. accept with p(c_j), else zero p(c_j) and renormalise.
  With probs, probs[j] is the distribution node j and its siblings were drawn from (at its parent).
Every emitted token is distributed as under the target alone (tests/test_tree_distribution.py).
"""
from __future__ import annotations

import torch

from specdec.sampler import argmax, sample, warp
from specdec.sampling_params import SamplingParams
from specdec.spec.proposer import Proposal, node_depths
from specdec.spec.rejection import Verdict


def tree_positions(parents: list[int]) -> torch.Tensor:
    """[T] depth of each row (T = 1 + len(parents)); add the prefix length for positions."""
    return torch.tensor([0] + node_depths(parents), dtype=torch.long)


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: row r sees itself and its ancestors (row 0 is everyone's ancestor)."""
    T = 1 + len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[0, 0] = True
    for j, par in enumerate(parents):
        mask[j + 1] = mask[par + 1]
        mask[j + 1, j + 1] = True
    return mask


def with_prefix(tree: torch.Tensor, length: int) -> torch.Tensor:
    """A tree block's mask [T, T] with the `length` cached keys every row sees before it: [T, length + T]
    (an EAGLE head's torch layer and graphs take it so)."""
    return torch.cat([torch.ones(tree.shape[0], length, dtype=torch.bool, device=tree.device), tree], dim=1)


def root_path_columns(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """How the attention kernel reads a tree pass's new keys in the order of their positions, as plain
    decoding does (specdec/kernels/attention.c): None when every row's ancestors are columns 0..depth
    already (a chain), else

        vis   [T, T] bool   row r sees columns 0..depth_r: its root path, laid out by depth
        path  [T, T] int64  path[r, d] = the column of row r's ancestor at depth d; past depth_r, d itself

    mask: [T, T] tree_mask (parents before children, so ancestors ascend with depth)."""
    T = mask.shape[0]
    cols = torch.arange(T)
    depth = mask.sum(dim=1) - 1  # [T]
    ancestors = torch.where(mask, cols[None], T + cols[None]).sort(dim=1).values  # visible columns first
    vis = cols[None] <= depth[:, None]  # [T, T]
    path = torch.where(vis, ancestors, cols[None])
    if torch.equal(path, cols[None].expand(T, T)):
        return None
    return vis, path.to(torch.int64)


def children_of(parents: list[int]) -> list[list[int]]:
    """children[r] = rows whose parent row is r, in proposal order."""
    kids: list[list[int]] = [[] for _ in range(1 + len(parents))]
    for j, par in enumerate(parents):
        kids[par + 1].append(j + 1)
    return kids


def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def verify_tree(proposal: Proposal, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None, row_argmax: list[int] | None = None) -> tuple[Verdict, list[int]]:
    """logits: [T, V] target logits per row (row_argmax: their argmax, where the pass computed it).
    Returns the verdict and the accepted path's rows (starting with 0); verdict.tokens = the accepted
    nodes' tokens + one recovered/bonus token."""
    parents = proposal.parents if proposal.parents is not None else chain_parents(len(proposal))
    kids = children_of(parents)
    tokens = proposal.tokens
    rows, cur = [0], 0
    if params.greedy:
        best = row_argmax if row_argmax is not None else argmax(logits).tolist()  # [T]
        while True:
            nxt = next((r for r in kids[cur] if tokens[r - 1] == best[cur]), None)
            if nxt is None:
                return Verdict(len(rows) - 1, [tokens[r - 1] for r in rows[1:]] + [best[cur]]), rows
            rows.append(nxt)
            cur = nxt
    while True:
        p = warp(logits[cur:cur + 1], params)[0]  # [V]
        accepted = _rejection_step(p, kids[cur], tokens, proposal.probs, generator)
        if isinstance(accepted, int) and accepted > 0:
            rows.append(accepted)
            cur = accepted
            continue
        final = accepted if isinstance(accepted, torch.Tensor) else p
        return Verdict(len(rows) - 1, [tokens[r - 1] for r in rows[1:]] + [sample(final, generator)]), rows


def _rejection_step(p: torch.Tensor, candidates: list[int], tokens: list[int], probs: torch.Tensor | None,
                    generator: torch.Generator | None) -> int | torch.Tensor:
    """Try the candidate rows in order: the accepted row, or the residual distribution to sample from
    when every candidate was rejected (p itself when there are none)."""
    if not candidates:
        return p
    q = None if probs is None else probs[candidates[0] - 1].float().clone()  # [V]
    for r in candidates:
        x = tokens[r - 1]
        u = float(torch.rand((), generator=generator))
        if q is None:
            if u < float(p[x]):
                return r
            p = p.clone()
            p[x] = 0.0
        else:
            q_x = float(q[x])
            # NOTE: q(x) == 0 cannot happen for a token drawn from q; if it does, reject.
            if q_x > 0.0 and u < min(1.0, float(p[x]) / q_x):
                return r
            residual = (p - q).clamp_min(0.0)
            if float(residual.sum()) > 0.0:  # else p == q up to rounding: rejection had probability ~0
                p = residual
            q[x] = 0.0
            if float(q.sum()) > 0.0:
                q = q / q.sum()
        total = float(p.sum())
        if total <= 0.0:  # cannot happen for a valid p; keep the sampler defined
            raise ValueError("tree verification: the residual distribution vanished")
        p = p / total
    return p
