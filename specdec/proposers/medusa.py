"""Medusa-1 drafting: K heads on the target's last hidden state, a static candidate tree.

The hidden state h of the last accepted row (its LM head gave the bonus token, the root of the next
tree) feeds head i, whose top tokens guess the token i + 1 places after the root. The static tree
is a set of paths (r_1, .., r_d): "rank r_1 of head 1, then rank r_2 of head 2, ...", chosen from
the heads' measured held-out accuracy acc[i][r] (stored with the head): a path's value is the
product of its ranks' accuracies, and the best num_draft_tokens - 1 paths are kept (a prefix of
a path is at least as likely as the path, so the cut is a tree), as Medusa picks its choices.
E.g. acc = [[.6, .1], [.4, .1]], 3 nodes: (0,) .6, (0, 0) .24, (1,) .1 -> parents [-1, 0, -1].
"""
from __future__ import annotations

import heapq
import math
from pathlib import Path

import torch

from specdec.proposers.head_io import check_head_fits, default_head, load_head
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer


def static_tree(acc: list[list[float]], num_nodes: int, max_rank: int = 10) -> list[tuple[int, ...]]:
    """The num_nodes most likely paths, most likely first: a path comes after its prefix (the heap yields a
    child only once its parent is out), so the first n of them are the n most likely nodes and a tree."""
    heap = [(-acc[0][r], (r,)) for r in range(min(max_rank, len(acc[0])))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        d = len(path)
        if d < len(acc):
            for r in range(min(max_rank, len(acc[d]))):
                heapq.heappush(heap, (neg * acc[d][r], path + (r,)))
    return chosen  # (sorted by depth, a cut to k nodes kept shallow unlikely ones before a likely path)


def tree_parents(paths: list[tuple[int, ...]]) -> list[int]:
    index = {p: i for i, p in enumerate(paths)}
    return [index[p[:-1]] if len(p) > 1 else -1 for p in paths]


@register_proposer("medusa")
class MedusaProposer(Proposer):

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.config
        path = Path(cfg.model) if cfg.model else default_head("medusa", ctx.target.config)
        # (an upstream Medusa directory too), on the target's device: its hidden states and LM head are there
        self.head = load_head(path, ctx.dtype, ctx.target.config).to(ctx.target.device)
        check_head_fits(self.head, ctx.target.config, path, "medusa")
        self.lm_head = ctx.target.lm_head.weight
        K = self.head.cfg.medusa_num_heads
        acc = [list(r) for r in self.head.cfg.medusa_accuracy] or [[0.5 ** (i + 1) * 0.5 ** r for r in range(10)]
                                                                   for i in range(K)]
        self.paths = static_tree(acc, cfg.num_draft_tokens - 1)
        self.shares = [math.prod(acc[d][r] for d, r in enumerate(p)) for p in self.paths]  # tree_shares
        self.parents = tree_parents(self.paths)
        self.max_rank = 1 + max(max(p) for p in self.paths)
        self.draft_ids = self.head.draft_ids

    def tree_shares(self) -> list[float]:
        return self.shares

    def begin(self, state: RequestState, prefill: TargetOutput | None = None) -> None:
        state.draft["h"] = prefill.forward.hidden[0, -1]

    def on_verified(self, state, proposal, num_accepted, target=None) -> None:
        state.draft["h"] = target.forward.hidden[0, target.accepted_rows[-1]]

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> Proposal:
        h = state.draft.get("h")
        if h is None:
            return EMPTY
        n = min(k, len(self.paths))
        if n <= 0:
            return EMPTY
        paths = self.paths[:n]  # most likely first, a parent before its children: any prefix is a tree
        depth = max(len(p) for p in paths)  # only the heads these nodes use
        logits = self.head(h[None].to(self.ctx.dtype), self.lm_head, depth)[:, 0]  # [depth, Vd]
        top = self.draft_ids[logits.topk(self.max_rank, dim=-1).indices].tolist()  # [depth, ranks] target ids
        return Proposal([top[len(p) - 1][p[-1]] for p in paths], None, self.parents[:n])
