"""Draft-model distillation: fine-tune a small draft (e.g. a layer-truncated copy of the target) on
target-generated data, with KL(target || draft) over the frequent-token draft vocabulary.

    specdec train draft-model --data runs/data --layers 0,1,2,3,29 --out runs/draft

Only the decoder layers and the final norm train (the embedding is tied to the LM head and stays
frozen). Acceptance before/after is the greedy chain acceptance on held-out target outputs: from
every assistant position, how many consecutive draft argmax tokens equal the target's tokens. Resumable:
a rerun of the same command continues from the last checkpoint (out/checkpoint.pt).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import struct
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.config import ConfigError
from specdec.model.layers import apply_rotary
from specdec.model.output_dir import write_atomic
from specdec.train.checkpoint import check_settings, read_checkpoint, write_checkpoint
from specdec.train.features import Shard, token_counts, train_and_heldout, with_features


def train_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Autograd-friendly forward of our LlamaModel (its own forward runs in inference mode).
    ids [B, T] -> final normed hidden [B, T, H]."""
    if model.config.model_type == "gemma3":
        raise ConfigError("distillation trains Llama-family drafts; a gemma3 draft is not supported yet")
    B, T = ids.shape
    x = model.embed(ids)
    cos, sin = model.rotary(torch.arange(T)[None].expand(B, T), x.dtype)
    for L in model.layers:
        h = L.input_norm(x)
        q, k, v = F.linear(h, L.qkv.weight, L.qkv.bias).split(L.split, dim=-1)
        q = q.view(B, T, L.n_heads, L.head_dim).transpose(1, 2)
        k = k.view(B, T, L.n_kv, L.head_dim).transpose(1, 2)
        v = v.view(B, T, L.n_kv, L.head_dim).transpose(1, 2)
        if L.q_norm is not None:
            q, k = L.q_norm(q), L.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, -1), L.o_proj.weight)
        gate, up = F.linear(L.post_norm(x), L.gate_up.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, L.down.weight)
    return model.norm(x)


@torch.no_grad()
def chain_acceptance_draft(draft, seqs: list[Shard.Sequence], depth: int) -> dict:
    """Greedy chain acceptance of a draft model on held-out target outputs (teacher forcing)."""
    hits, starts = [0] * depth, 0
    for s in seqs:
        ids = torch.tensor([s.tokens])
        pred = (train_forward(draft, ids) @ draft.lm_head.weight.t()).argmax(-1)[0]  # [N]: guess of x_{p+1}
        tok = ids[0]
        match = torch.zeros(len(tok), dtype=torch.bool)
        match[1:] = pred[:-1] == tok[1:]
        mask = s.loss_mask
        for p in range(s.prompt_len, len(tok)):  # the draft starts after the last emitted token p - 1
            starts += 1
            for j in range(min(depth, len(tok) - p)):
                if not (match[p + j] and mask[p + j]):
                    break
                hits[j] += 1
    rate = [h / max(starts, 1) for h in hits]
    return {"tau": 1 + sum(rate), "acceptance_by_position": [round(r, 4) for r in rate]}


def distill(target, draft, data_dirs: list[str], out: Path, epochs: float = 1.0, lr: float = 1e-4,
            draft_vocab_size: int = 8192, max_len: int = 384, seed: int = 0, depth: int = 5,
            progress: bool = True, ckpt_every: int = 50) -> dict:
    """Fine-tune `draft` in place; returns the report (acceptance before and after, tokens, seconds), also
    written to out/distill_report.json. A checkpoint (the trained tensors, the optimiser, the step) every
    `ckpt_every` steps and at the end: a rerun of the same command resumes where it stopped and ends with
    the same weights (one with other settings or data is refused)."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    train, held = train_and_heldout(data_dirs)
    if not train:
        raise ConfigError(f"no training sequences under {', '.join(str(Path(d) / 'train') for d in data_dirs)} "
                          f"(a dataset from `specdec train data`)")
    counts = token_counts(train, target.config.vocab_size).float()
    ids_d = counts.topk(draft_vocab_size).indices.sort().values
    lm_t = target.lm_head.weight.detach()[ids_d]
    for p in draft.parameters():
        p.requires_grad_(False)
    params = [p for L in draft.layers for p in L.parameters()] + list(draft.norm.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    settings = {"epochs": epochs, "lr": lr, "draft_vocab_size": draft_vocab_size, "max_len": max_len, "seed": seed,
                "depth": depth, "train_data": _data_digest(train), "draft": _tensors_digest(_trained(draft))}
    out.mkdir(parents=True, exist_ok=True)
    run = _resume(out / "checkpoint.pt", settings, draft, opt)
    if run is None:
        run = {"step": 0, "seen": 0, "seconds": 0.0, "before": chain_acceptance_draft(draft, held, depth)}
    total = max(1, int(epochs * len(train)))
    order = [i % len(train) for i in range(total)]
    random.Random(seed).shuffle(order)
    t0 = time.perf_counter()
    for step in tqdm(range(run["step"], total), desc="distill draft", disable=not progress, initial=run["step"],
                     total=total):
        s = with_features(target, [train[order[step]]], (), max_len)[0]  # online shards: one target pass
        n = min(len(s.tokens), max_len)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / total))
        h = train_forward(draft, torch.tensor([s.tokens[:n]]))[0, :n - 1]  # predicts x_{p+1}
        t_prob = torch.softmax(s.hidden[:n - 1].float() @ lm_t.t(), -1)  # the target at p
        loss_tok = -(t_prob * torch.log_softmax(h @ draft.lm_head.weight[ids_d].t(), -1)).sum(-1)
        w = s.loss_mask[1:n].float()
        loss = (loss_tok * w).sum() / w.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        run["step"], run["seen"] = step + 1, run["seen"] + n
        if run["step"] % ckpt_every == 0 or run["step"] == total:
            _checkpoint(out / "checkpoint.pt", settings, draft, opt, run, time.perf_counter() - t0)
    for p in draft.parameters():
        p.requires_grad_(False)
    after = chain_acceptance_draft(draft, held, depth)
    seconds = run["seconds"] + time.perf_counter() - t0  # (the runs before a resume included)
    report = {"before": run["before"], "after": after, "train_tokens": run["seen"], "seconds": round(seconds, 1),
              "sequences": len(train), "epochs": epochs}
    write_atomic(out / "distill_report.json", json.dumps(report, indent=2))
    return report


def _data_digest(train) -> str:
    """The training sequences themselves (tokens and where each prompt ends): a rerun on other data is refused."""
    digest = hashlib.sha1()
    for seq in train:
        digest.update(struct.pack("<qq", len(seq.tokens), seq.prompt_len))
        digest.update(torch.tensor(seq.tokens, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """The draft as it starts (its trained tensors before training): a rerun with another draft is refused."""
    digest = hashlib.sha1()
    for name, t in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(t.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _trained(draft) -> dict[str, torch.Tensor]:
    """The tensors distillation trains: the decoder layers and the final norm."""
    return {k: v for k, v in draft.state_dict().items() if k.startswith(("layers.", "norm."))}


def _checkpoint(path: Path, settings: dict, draft, opt, run: dict, seconds_this_run: float) -> None:
    write_checkpoint(path, {"draft": _trained(draft), "opt": opt.state_dict(), "settings": json.dumps(settings),
                            "run": json.dumps({**run, "seconds": run["seconds"] + seconds_this_run}),
                            "rng": torch.get_rng_state()})


def _resume(path: Path, settings: dict, draft, opt) -> dict | None:
    """The run a checkpoint holds, its tensors and optimiser restored into draft and opt; None: no checkpoint."""
    if not path.exists():
        return None
    state = read_checkpoint(path)
    check_settings(state, settings, path.parent)
    try:
        run = json.loads(state["run"])
        missing, unexpected = draft.load_state_dict(state["draft"], strict=False)
        if unexpected or set(_trained(draft)) & set(missing):
            raise ValueError("other tensor names")
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # (a tensor of another shape: RuntimeError)
        raise ConfigError(f"{path}: not a checkpoint of this draft ({(str(e).splitlines() or [''])[0][:120]}); "
                          "use a new --out") from None
    return run
