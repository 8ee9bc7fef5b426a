"""Held-out acceptance of a trained head, offline (no engine): a chain's tau and acceptance by position from
every start, the tokens a pass greedy decoding would see (decode_tau), and a Medusa head's accuracy by rank.
`specdec train` evaluates with these during training; `specdec eval-draft` reports them."""
from __future__ import annotations

import torch

from specdec.train.features import Shard
from specdec.train.unroll import eagle_unroll, pad_batch, shift, to_device


@torch.no_grad()
def chain_acceptance(head, target, seqs: list[Shard.Sequence], depth: int, aux_layers=(), batch_size: int = 8) -> dict:
    """Greedy chain acceptance on held-out sequences of the target's own greedy output: from every
    assistant position, the number of consecutive draft tokens (depth at most `depth`) equal to the
    target's tokens. On the accepted path the draft sees exactly the teacher tokens, so this is the
    chain drafter's tau. Returns tau = 1 + mean accepted and the acceptance rate by position, both
    averaged over every start position, and `decode_tau`: tokens per target pass as greedy decoding
    sees them, starting a chain only where the last one ended (after its accepted tokens and the
    target's own). Decoding moves fast through easy stretches and slowly through hard ones, so it
    starts more chains in the hard ones: decode_tau is the engine's figure, and usually lower than tau."""
    draft_ids = head.draft_ids
    embed, lm_head_d = target.embed.weight, target.lm_head.weight[draft_ids]
    hits_by_pos, starts, decoded, passes = [0] * depth, 0, 0, 0
    for i in range(0, len(seqs), batch_size):
        tokens, mask, hidden, aux = to_device(pad_batch(seqs[i:i + batch_size], 10 ** 6, aux_layers), embed.device)
        M = hidden.shape[1]
        if head.cfg.kind == "medusa":
            preds = [draft_ids[(head.blocks[j](hidden) @ lm_head_d.t()).argmax(-1)] for j in range(depth)]
            # head j at position p predicts x_{p+j+2}: shift so that preds[j][p + j] is the guess
            preds = [shift(pr[:, None, :, None], j)[:, 0, :, 0] for j, pr in enumerate(preds)]
        else:
            logits, _ = eagle_unroll(head, embed, lm_head_d, tokens, hidden, aux, depth)
            preds = [draft_ids[lg.argmax(-1)] for lg in logits]  # step j at position q guesses x_{q+2}
        match = torch.stack([(pr[:, :M - 1] == tokens[:, 2:]) & mask[:, 2:] for pr in preds])  # [depth, B, M-1]
        for p in range(M - 1):
            run = mask[:, p + 2].clone()
            starts += int(run.sum())
            for j in range(min(depth, M - 1 - p)):
                run = run & match[j, :, p + j]
                hits_by_pos[j] += int(run.sum())
        for b in range(tokens.shape[0]):
            tokens_b, passes_b = _decode_passes(match[:, b].tolist(), mask[b, 2:].tolist())
            decoded, passes = decoded + tokens_b, passes + passes_b
    rate = [h / max(starts, 1) for h in hits_by_pos]
    return {"tau": 1.0 + sum(rate), "acceptance_by_position": [round(r, 4) for r in rate], "starts": starts,
            "decode_tau": decoded / max(passes, 1)}


def _decode_passes(match: list[list[bool]], guessed: list[bool]) -> tuple[int, int]:
    """One sequence decoded greedily with chains: match [depth][M-1] (step j from start p guessed
    right), guessed [M-1] (position p + 2 is a response token). The first chain starts where the
    prompt pass's token is known (p = first response position - 1); each pass yields its accepted
    drafts plus the target's token. Returns (tokens, passes), the prompt pass not counted."""
    response = [p for p, g in enumerate(guessed) if g]
    if len(response) < 2:
        return 0, 0
    p, end, tokens, passes = response[0] + 1, response[-1], 0, 0
    while p <= end:
        accepted = 0
        while accepted < min(len(match), end - p) and match[accepted][p + accepted]:
            accepted += 1
        tokens, passes, p = tokens + accepted + 1, passes + 1, p + accepted + 1
    return tokens, passes


@torch.no_grad()
def medusa_rank_accuracy(head, target, seqs: list[Shard.Sequence], ranks: int = 10) -> list[list[float]]:
    """acc[i][r]: how often the target's token at p + i + 2 is head i's rank-r guess (held out)."""
    K, lm_head_d = head.cfg.medusa_num_heads, target.lm_head.weight[head.draft_ids]
    hits, totals = torch.zeros(K, ranks, device=lm_head_d.device), torch.zeros(K, device=lm_head_d.device)
    for s in seqs:
        tokens, mask, hidden, _ = to_device(pad_batch([s], 10 ** 6, ()), lm_head_d.device)
        M = hidden.shape[1]
        for i in range(K):
            n = M - 1 - i
            if n <= 0:
                break
            top = head.draft_ids[(head.blocks[i](hidden[0, :n]) @ lm_head_d.t()).topk(ranks, -1).indices]  # [n, r]
            valid = mask[0, i + 2:i + 2 + n]
            eq = (top == tokens[0, i + 2:i + 2 + n, None]) & valid[:, None]
            hits[i] += eq.sum(0).float()
            totals[i] += valid.sum()
    return (hits / totals.clamp_min(1)[:, None]).tolist()
