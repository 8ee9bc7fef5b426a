"""Runs one batched target forward over rows of ragged length on the paged KV pool.

A row feeds a sequence's uncomputed tokens token_ids[num_computed:num_computed + num_new] plus its
drafted tokens (a chain, or a token tree with its own mask and per-node positions); rows are left-padded
to the longest (see specdec.cache.paged_cache), positions are explicit per row, and the forward's
outputs are sliced back per row so that row index 0 of a `row_output` is the row's first real token
(what proposers expect of a single-request pass). Where
layer.c runs the batch, the padding costs nothing but attention's share: the linears and the LM head
see the real tokens alone (ForwardOutput.packed; specdec/model/llama.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.cache.paged_cache import BatchKV, PagedKVPool
from specdec.model.llama import ForwardOutput
from specdec.spec.proposer import EMPTY, Proposal
from specdec.spec.tree import tree_mask, tree_positions


@dataclass
class Row:
    seq: "object"  # specdec.engine.sequence.Sequence
    num_new: int  # uncomputed tokens fed: a prefill chunk, or 1 (the newest token) in decode
    proposal: Proposal = field(default_factory=lambda: EMPTY)

    @property
    def in_prompt(self) -> bool:
        """Every token fed is the prompt's: a prefill chunk, not a recomputation of generated tokens."""
        return not self.proposal and self.seq.num_computed + self.num_new <= len(self.seq.prompt_ids)

    @property
    def samples(self) -> bool:
        """The row reaches the end of the sequence: its last logits give the next token(s)."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens

    @property
    def tokens(self) -> list[int]:
        s = self.seq
        return s.token_ids[s.num_computed:s.num_computed + self.num_new] + self.proposal.tokens

    def positions(self) -> torch.Tensor:
        """[len(self)] the fed tokens' positions, then the drafts': a chain's follow on, a tree node's is
        its parent's + 1 (spec/tree.py)."""
        start = self.seq.num_computed
        if not self.proposal.is_tree:
            return torch.arange(start, start + len(self))
        fed = torch.arange(start, start + self.num_new)
        return torch.cat([fed, start + self.num_new - 1 + tree_positions(self.proposal.parents)[1:]])

    def tree_mask(self) -> torch.Tensor | None:
        """[len(self), len(self)] bool for a tree row (one fed token, its root: num_new is 1 in decode),
        which token each input sees among the row's new ones; None for a chain (causal)."""
        return tree_mask(self.proposal.parents) if self.proposal.is_tree else None

    def __len__(self) -> int:
        return self.num_new + len(self.proposal)


def pack_rows(rows: list[Row], max_waste: float = 0.25) -> list[list[Row]]:
    """Group rows into forwards whose left-padding wastes at most `max_waste` of the computed rows.

    E.g. chunk lengths [200, 180, 30, 8, 6]: [[200, 180], [30], [8, 6]] (padding 20, 0 and 2 rows).
    A prefill forward is compute-bound, so splitting costs little while padding costs its full size."""
    groups: list[list[Row]] = []
    for r in sorted(rows, key=len, reverse=True):
        cur = groups[-1] if groups else None
        if cur and (len(cur) + 1) * len(cur[0]) <= (1 + max_waste) * (sum(map(len, cur)) + len(r)):
            cur.append(r)
        else:
            groups.append([r])
    return groups


class ModelRunner:
    def __init__(self, model, pool: PagedKVPool):
        self.model = model
        self.pool = pool

    @torch.inference_mode()
    def run(self, rows: list[Row], all_logits: bool, output_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Logits for every column (decode/verify) or only the last one (prefill). A forward over prompt
        tokens alone is a prompt's pass (LlamaModel.forward(prefill=True)); recomputed outputs are not."""
        B, T = len(rows), max(len(r) for r in rows)
        input_ids = torch.zeros(B, T, dtype=torch.long)  # [B, T] left-padded
        positions = torch.zeros(B, T, dtype=torch.long)
        for b, r in enumerate(rows):
            n = len(r)
            input_ids[b, T - n:] = torch.tensor(r.tokens)
            positions[b, T - n:] = r.positions()
        trees = [r.tree_mask() for r in rows]
        kv = BatchKV(self.pool, [r.seq.block_table for r in rows], [r.seq.num_computed for r in rows],
                     [len(r) for r in rows], trees if any(t is not None for t in trees) else None)
        return self.model(input_ids, positions, kv, num_logits=None if all_logits else 1,
                          output_layers=output_layers,
                          prefill=not all_logits and all(r.in_prompt for r in rows))

    @staticmethod
    def row_output(fwd: ForwardOutput, b: int, n: int) -> ForwardOutput:
        """Row b's last n columns as a batch-of-one output ([1, n, ...])."""
        T = fwd.hidden.shape[1]
        logits = fwd.logits[b:b + 1, -min(n, fwd.logits.shape[1]):]
        layers = None if fwd.layer_hidden is None else {l: h[b:b + 1, T - n:] for l, h in fwd.layer_hidden.items()}
        return ForwardOutput(logits, fwd.hidden[b:b + 1, T - n:], layers)
