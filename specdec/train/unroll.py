"""Batches of precomputed features, and the EAGLE training-time-test unroll that trains and evaluates heads.

See trainer.py's docstring for the notation (tokens x_0..x_{N-1}, feature rows 0..M-1, step j at position p).
"""
from __future__ import annotations

import torch

from specdec.train.features import Shard


def pad_batch(seqs: list[Shard.Sequence], max_len: int, aux_layers: tuple[int, ...]):
    """Right-padded batch: tokens [B, N], loss mask [B, N], hidden [B, N-1, H], aux [B, N-1, 3H]; the
    features in their stored dtype (fp16 shards: half the bytes to copy; `to_device` widens them on the device)."""
    N = min(max_len, max(len(s.tokens) for s in seqs))
    B, H, dtype = len(seqs), seqs[0].hidden.shape[-1], seqs[0].hidden.dtype
    tokens = torch.zeros(B, N, dtype=torch.long)
    mask = torch.zeros(B, N, dtype=torch.bool)
    hidden = torch.zeros(B, N - 1, H, dtype=dtype)
    aux = torch.zeros(B, N - 1, H * len(aux_layers), dtype=dtype) if aux_layers else None
    for b, s in enumerate(seqs):
        n = min(len(s.tokens), N)
        tokens[b, :n] = torch.tensor(s.tokens[:n])
        mask[b, :n] = s.loss_mask[:n]
        hidden[b, :n - 1] = s.hidden[:n - 1]
        if aux is not None:
            aux[b, :n - 1] = torch.cat([s.aux[l][:n - 1] for l in aux_layers], dim=-1)
    return tokens, mask, hidden, aux


def to_device(batch: tuple, device: torch.device) -> tuple:
    """A `pad_batch` batch on `device`, features widened to fp32 there."""
    moved = (None if t is None else t.to(device, non_blocking=True) for t in batch)
    return tuple(t.float() if t is not None and t.is_floating_point() else t for t in moved)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, H, M, D] shifted n positions later along M (zeros in front)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :n]), x[:, :, :-n]], dim=2)


def eagle_unroll(head, embed, lm_head_d, tokens, hidden, aux, steps: int):
    """Training-time-test unroll (see trainer.py's docstring). tokens [B, N], hidden [B, M, H], aux
    [B, M, 3H] or None. Returns per step the draft logits [B, M, Vd] and outputs [B, M, H]."""
    layer = head.layer
    B, N = tokens.shape
    M = N - 1
    emb = embed[tokens[:, 1:]]  # [B, M, H]: embedding of x_{p+1}
    pos = torch.arange(M, device=tokens.device)[None].expand(B, M)
    cos, sin = head.rotary(pos, emb.dtype)
    h = head.fuse(aux if head.cfg.kind == "eagle3" else hidden, emb)
    ks, vs, logits, outs = [], [], [], []
    rep = layer.self_attn.n_heads // layer.self_attn.n_kv
    scale = layer.self_attn.head_dim ** -0.5
    for j in range(steps):
        if j > 0:
            prev = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)  # o_{j-1}[p-1]
            h = head.step_input(emb, prev)
        x, residual = layer.attn_input(emb, h)
        q, k, v = layer.self_attn.qkv(x, cos, sin)  # [B, Hq|Hkv, M, D]
        ks.append(k.repeat_interleave(rep, 1))
        vs.append(v.repeat_interleave(rep, 1))
        s0 = (q @ ks[0].transpose(-1, -2)) * scale  # [B, Hq, M, M]: step-0 keys at positions <= p - j
        s0 = s0.masked_fill(~torch.ones(M, M, dtype=torch.bool, device=s0.device).tril(-j), float("-inf"))
        diag = [(q * shift(ks[i], j - i)).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]
        probs = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
        att = probs[..., :M] @ vs[0]
        for n, i in enumerate(range(1, j + 1)):
            att = att + probs[..., M + n:M + n + 1] * shift(vs[i], j - i)
        out = layer.finish(residual, layer.self_attn.o_proj(att.transpose(1, 2).reshape(B, M, -1)))
        outs.append(out)
        logits.append(head.lm_head(head.norm(out)) if head.cfg.kind == "eagle3" else out @ lm_head_d.t())
    return logits, outs
