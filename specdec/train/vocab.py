"""The draft vocabulary of an EAGLE-3 head: chosen from token counts, and grown from a trained head.

EAGLE-3 drafts over a reduced vocabulary (Li et al. 2025): the Vd most frequent target tokens, mapped
by d2t/t2d. A token outside it can never be drafted, so the draft vocabulary caps acceptance: the
shipped head's 4,096 tokens cover 89% of ShareGPT answer tokens but 62-98% (mean 83%) of MT-bench
answers (session 36).

Growing a trained head's vocabulary needs rows of its LM head for the new tokens. A trained EAGLE-3
LM head stays close to the target's own (it starts as the target's rows; cosine 0.89 per row for the
shipped head), so a linear map M [H, H] fitted by least squares on the tokens both have,
    W_head[t] ~ W_target[t] @ M,
carries the target's rows of the new tokens into the head's space. The old tokens keep their rows
exactly, so their logits do not move; the new ones then compete on the mapped rows, and fine-tuning
(`specdec train eagle3 --init-from`) refines them. On held-out ShareGPT answers, growing the shipped
head from 4,096 to 16,384 tokens with no training raised the chain tau from 2.99 to 3.24.
"""
from __future__ import annotations

from dataclasses import replace

import torch


def rank_vocab(counts: torch.Tensor, size: int, always: list[int] = (), keep: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` draft ids [size] (ascending target ids): `keep` (a trained head's vocabulary) first, the
    `always` ids (end of turn), then the most frequent by `counts` [V] (ties: lower id first)."""
    priority = torch.zeros(counts.numel(), dtype=torch.long)
    priority[list(always)] = 1
    if keep is not None:
        if keep.numel() > size:
            raise ValueError(f"a vocabulary of {keep.numel()} tokens cannot shrink to {size}")
        priority[keep.cpu()] = 2
    order = torch.argsort(counts.cpu(), descending=True, stable=True)
    order = order[torch.argsort(priority[order], descending=True, stable=True)]  # by priority, then count
    return order[:size].sort().values


def fit_row_map(target_rows: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """M [H, H] minimising ||target_rows @ M - head_rows|| (rows [n, H] of the same tokens, n >= H)."""
    return torch.linalg.lstsq(target_rows.double(), head_rows.double()).solution.to(head_rows.dtype)


@torch.no_grad()
def grow_vocab(head, target_lm_head: torch.Tensor, draft_ids: torch.Tensor):
    """A copy of EAGLE-3 `head` drafting over `draft_ids` [Vd'] (ascending, a superset of its own): every
    weight but the LM head as it was, the LM head's old rows as they were and the new tokens' rows the
    target's [V, H] rows through fit_row_map. Returns the new head (fp32)."""
    from specdec.proposers.head_io import make_head

    if head.cfg.kind != "eagle3" or not head.cfg.draft_vocab_size:
        raise ValueError("only an EAGLE-3 head with a reduced draft vocabulary can grow one")
    old_ids = head.draft_ids.cpu()
    draft_ids = draft_ids.cpu()
    missing = set(old_ids.tolist()) - set(draft_ids.tolist())
    if missing:
        raise ValueError(f"the new vocabulary lacks {len(missing)} of the head's tokens (e.g. {min(missing)})")
    old_rows = head.lm_head.weight.detach().float().cpu()  # [Vd, H]
    target_rows = target_lm_head.detach().float().cpu()  # [V, H]
    grown = make_head(replace(head.cfg, draft_vocab_size=draft_ids.numel()))
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    grown.load_state_dict(state, strict=False)
    grown.set_vocab(draft_ids)
    rows = target_rows[draft_ids] @ fit_row_map(target_rows[old_ids], old_rows)  # [Vd', H]
    rows[torch.searchsorted(draft_ids, old_ids)] = old_rows
    grown.lm_head.weight.copy_(rows)
    return grown.float()
