"""A random EAGLE head for a tiny target, saved as a head directory (the EAGLE tests and the engine's)."""
from __future__ import annotations

from pathlib import Path

import torch

from specdec.proposers.head_io import make_head, save_head
from specdec.proposers.heads import HeadConfig


def random_head(target, kind: str, out: Path, draft_vocab: int = 0, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    L = target.config.num_hidden_layers
    cfg = HeadConfig.for_target(kind, target.config, draft_vocab, 3, (0, L // 2, L - 1) if kind == "eagle3" else ())
    head = make_head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    if draft_vocab:
        head.set_vocab(torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values)
    head.cfg = HeadConfig(**{**head.cfg.__dict__, "training": {"target_config": {"num_hidden_layers": L}}})
    return save_head(head, out, torch.float32)
