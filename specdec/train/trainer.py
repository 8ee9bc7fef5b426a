"""Training of draft heads (Medusa-1, EAGLE-1, EAGLE-3) on precomputed target features.

    specdec train eagle3 --data runs/data --out runs/eagle3 --epochs 3 --draft-vocab-size 4096

Notation per sequence (tokens x_0..x_{N-1}, feature rows 0..M-1 with M = N - 1, see features.py):
  EAGLE step 0 at position p: input (feature f_p, embedding of x_{p+1}), output o_0[p] predicts x_{p+2};
  target distribution = softmax of the target's logits at p + 1 restricted to the draft vocabulary;
  loss only where x_{p+2} is an assistant token.
  Training-time test (EAGLE-3, also used for EAGLE-1 here): step j at position p takes o_{j-1}[p-1] as
  its hidden and attends to step-0 keys at positions <= p - j plus step-i keys at p - j + i (i = 1..j),
  exactly what a chain draft at depth j sees at inference (committed prefix + its own ancestors).
  EAGLE-1 adds smooth-L1 feature regression o_j[p] ~ f_{p+1} (weight 1, token loss weight 0.1).
  Medusa head i at position p: h = f_p, predicts x_{p+i+2} (target distribution at p + i + 1).
Step losses are weighted 0.8^j (EAGLE-3) / 0.8^i (Medusa). AdamW, linear warmup + cosine decay, grad
clipping, a checkpoint (head + optimiser + step + RNG) every `ckpt_every` steps: a rerun resumes.
Sequences are batched with right padding (causal attention never sees the padding).
The head trains on the target's device (`--device cuda`: features go to the GPU batch by batch).
`max_seconds` fits the schedule to a time budget: after the first steps, and at every evaluation, the
total becomes the steps the measured pace leaves room for, at most the planned ones (the cosine decay
follows the new total; a slow start, CUDA's warm-up, cut a GPU run to 743 steps of a 95 s budget that
took 54 s before later fits could raise it again).
"""
from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.config import ConfigError, check_minimums
from specdec.proposers.head_io import load_head, make_head, save_head
from specdec.proposers.heads import HeadConfig
from specdec.train.checkpoint import check_settings, read_checkpoint, write_checkpoint
from specdec.train.features import read_data_meta, token_counts, train_and_heldout, with_features
from specdec.train.unroll import eagle_unroll, pad_batch, to_device
from specdec.train.vocab import grow_vocab, rank_vocab


@dataclass(frozen=True)
class TrainSpec:
    kind: str  # medusa | eagle | eagle3
    data: tuple[str, ...]  # dataset dirs (each with train/ and maybe heldout/)
    out: str
    epochs: float = 2.0
    lr: float = 1e-3
    warmup: int = 10
    batch_size: int = 8
    max_len: int = 512  # tokens per sequence used for training
    ttt_steps: int = 2  # training-time test depth (1 = plain teacher forcing)
    draft_vocab_size: int = 4096
    intermediate_size: int = 0  # 0: the target's
    medusa_heads: int = 4
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    eval_every: int = 50
    ckpt_every: int = 10
    max_train_seqs: int | None = None
    save_dtype: str = "bfloat16"
    init_from: str | None = None  # a head dir: fine-tune its weights and draft vocabulary (fresh optimizer)
    max_seconds: float | None = None  # fit the number of steps to this budget (see the module docstring)

    def __post_init__(self):
        check_minimums(self, {"warmup": 0, "batch_size": 1, "max_len": 2, "ttt_steps": 1, "draft_vocab_size": 0,
                              "intermediate_size": 0, "medusa_heads": 1, "weight_decay": 0, "eval_every": 1,
                              "ckpt_every": 1, "max_train_seqs": 1, "max_seconds": 0})
        if not (self.lr > 0 and self.grad_clip > 0):
            raise ConfigError(f"lr and grad_clip must be > 0, got {self.lr} and {self.grad_clip}")
        if not self.epochs >= 0 or (self.epochs == 0 and not self.init_from):  # (NaN too)
            raise ConfigError("epochs must be > 0 (0 with init_from: export the head it starts from, "
                              "its vocabulary grown to draft_vocab_size)")


class Trainer:
    def __init__(self, spec: TrainSpec, target, progress: bool = True):
        self.spec, self.target, self.progress = spec, target, progress
        self.device = target.device
        self.out = Path(spec.out)
        torch.manual_seed(spec.seed)
        meta = read_data_meta(spec.data, target.config)
        self.aux_layers = tuple(meta.get("aux_layers", ())) if spec.kind == "eagle3" else ()
        # digests, or None: the data does not say. With init_from: those the starting head was held out from
        # too (what this head was never trained on), set by _heldout_from_head
        self.heldout_prompts = meta["heldout_prompts"]
        self.train, held = train_and_heldout(spec.data, spec.max_train_seqs)
        if not self.train:  # (the batches would cycle over empty epochs forever)
            raise ConfigError(f"no training sequences in {', '.join(map(str, spec.data))} (train/ shards)")
        self.heldout = with_features(target, held, self.aux_layers)  # online shards: computed once here
        tc = target.config
        if spec.draft_vocab_size > tc.vocab_size:
            raise ConfigError(f"draft_vocab_size {spec.draft_vocab_size} is more than the target's vocabulary "
                              f"({tc.vocab_size} tokens)")
        cfg = HeadConfig.for_target(spec.kind, tc, spec.draft_vocab_size, spec.medusa_heads, self.aux_layers,
                                    target=meta.get("model", ""))
        if spec.intermediate_size:
            cfg = replace(cfg, intermediate_size=spec.intermediate_size)
        self.head = make_head(cfg)  # on the CPU until its vocabulary is set, then on self.device
        self.counts = token_counts(self.train, tc.vocab_size)
        self.embed = target.embed.weight.detach()
        self._use_vocab(rank_vocab(self.counts, spec.draft_vocab_size or tc.vocab_size,
                                   always=list(tc.eos_token_id)))  # the end-of-turn token is always draftable
        self.head.set_vocab(self.draft_ids.cpu())
        self.head.to(self.device)
        if spec.init_from:
            self._init_from_head(Path(spec.init_from))
        else:
            self._init_from_target()
        self.opt = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=spec.lr,
                                     weight_decay=spec.weight_decay, betas=(0.9, 0.95))
        steps_per_epoch = math.ceil(len(self.train) / spec.batch_size)
        self.total_steps = self.planned_steps = max(int(spec.epochs > 0), int(spec.epochs * steps_per_epoch))
        self.step, self.history = 0, []
        self.seconds_before = 0.0  # training time of the runs this one resumes (max_seconds spans them all)

    def _use_vocab(self, draft_ids: torch.Tensor) -> None:
        """The draft vocabulary [Vd] (ascending target ids) that the loss and the head share."""
        self.draft_ids = draft_ids.to(self.device)
        self.coverage = float(self.counts[draft_ids.cpu()].sum() / self.counts.sum().clamp_min(1))
        self.lm_head_d = self.target.lm_head.weight.detach()[self.draft_ids]  # [Vd, H]

    def _init_from_head(self, path: Path) -> None:
        """Start from a trained head (fine-tuning on other data): its weights, and its draft vocabulary,
        which its rows follow; the optimizer and the schedule start afresh. An EAGLE-3 head with a
        smaller draft vocabulary than this run's grows into it (vocab.grow_vocab: its tokens, then the
        most frequent of this run's data)."""
        src = load_head(path)
        self._heldout_from_head(path, src.cfg.training.get("heldout_prompts"))
        shape = ("kind", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "aux_layers", "medusa_num_heads")
        differ = [f"{f} ({getattr(src.cfg, f)} vs {getattr(self.head.cfg, f)})" for f in shape
                  if getattr(src.cfg, f) != getattr(self.head.cfg, f)]
        size = self.draft_ids.numel()
        if not differ and src.cfg.kind == "eagle3" and 0 < src.cfg.draft_vocab_size < size:
            ids = rank_vocab(self.counts, size, always=list(self.target.config.eos_token_id), keep=src.draft_ids)
            src = grow_vocab(src, self.target.lm_head.weight, ids)
        if src.draft_ids.numel() != size:  # a larger one, or a Medusa/EAGLE-1 head's other size
            differ.append(f"draft vocabulary ({src.draft_ids.numel()} vs {size} tokens)")
        if differ:
            raise ConfigError(f"{path}: its {src.cfg.kind} head differs from this run's {self.spec.kind} head in "
                              + ", ".join(differ))
        self._use_vocab(src.draft_ids.clone())
        self.head.load_state_dict(src.state_dict())  # the vocabulary buffers (d2t/t2d, token_map) too

    def _heldout_from_head(self, path: Path, theirs: list[str] | None) -> None:
        """This head's held-out record, starting from the head at `path`: the prompts both were held out
        from. A fine-tune's held-out figures mean something only there, so it warns where the data's
        held-out prompts are not among those the head's record lists (S45's GPU fine-tune measured tau 4.4
        on prompts the shipped head had trained on; its own held-out gave 3.3)."""
        ours = self.heldout_prompts
        if ours is None or theirs is None:
            whose = "this data" if ours is None else str(path)
            warnings.warn(f"{whose} records no held-out prompts: held-out figures may include prompts {path} "
                          "trained on", stacklevel=3)
        elif not set(ours) <= set(theirs):
            warnings.warn(f"{len(set(ours) - set(theirs))} of the data's {len(ours)} held-out prompts are not "
                          f"held out by {path}, which may have trained on them; make the data with "
                          f"`specdec train data --heldout-from {path}`", stacklevel=3)
        # the new head is held out from what both were: its record must not pass the others on as unseen
        self.heldout_prompts = None if ours is None or theirs is None else sorted(set(ours) & set(theirs))

    def _init_from_target(self) -> None:
        with torch.no_grad():
            if self.spec.kind == "eagle3":
                self.head.lm_head.weight.copy_(self.lm_head_d)
                self.head.norm.weight.copy_(self.target.norm.weight)
            elif self.spec.kind == "eagle":  # fc starts as "pass the feature through"
                H = self.head.cfg.hidden_size
                self.head.fc.weight[:, :H].mul_(0.1)
                self.head.fc.weight[:, H:].copy_(torch.eye(H))

    # -- losses ---------------------------------------------------------------------------------
    def _target_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.softmax(hidden @ self.lm_head_d.t(), dim=-1)  # [.., Vd]

    def _draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "eagle3":
            return self.head.lm_head(self.head.norm(out))
        return out @ self.lm_head_d.t()

    def eagle_forward(self, tokens, hidden, aux, steps: int):
        return eagle_unroll(self.head, self.embed, self.lm_head_d, tokens, hidden, aux, steps)

    def eagle_loss(self, batch, steps: int):
        tokens, mask, hidden, aux = batch
        logits, outs = self.eagle_forward(tokens, hidden, aux, steps)
        M = hidden.shape[1]
        tp = self._target_probs(hidden[:, 1:])  # [B, M-1, Vd]: target at p+1 for p = 0..M-2
        tgt_tok = tokens[:, 2:]  # x_{p+2}
        total, stats = 0.0, {}
        for j in range(steps):
            valid = mask[:, 2:].clone()
            valid[:, :j] = False
            lg = logits[j][:, :M - 1]
            w = valid.float()
            ce = -(tp * torch.log_softmax(lg.float(), -1)).sum(-1)
            loss = (ce * w).sum() / w.sum().clamp_min(1)
            if self.spec.kind == "eagle":
                reg = F.smooth_l1_loss(outs[j][:, :M - 1], hidden[:, 1:], reduction="none").mean(-1)
                loss = 0.1 * loss + (reg * w).sum() / w.sum().clamp_min(1)
            total = total + (0.8 ** j) * loss
            pred = self.draft_ids[lg.argmax(-1)]
            stats[f"acc{j}"] = float(((pred == tgt_tok) & valid).sum() / valid.sum().clamp_min(1))
        return total, stats

    def medusa_loss(self, batch, heads: int | None = None):
        tokens, mask, hidden, _ = batch
        M = hidden.shape[1]
        K = heads or self.head.cfg.medusa_num_heads
        total, stats = 0.0, {}
        for i in range(K):
            n = M - 1 - i  # positions p with a target at p + i + 1
            if n <= 0:
                break
            h = hidden[:, :n]
            lg = self.head.blocks[i](h) @ self.lm_head_d.t()
            tp = self._target_probs(hidden[:, i + 1:i + 1 + n])
            valid = mask[:, i + 2:i + 2 + n].float()
            ce = -(tp * torch.log_softmax(lg, -1)).sum(-1)
            total = total + (0.8 ** i) * (ce * valid).sum() / valid.sum().clamp_min(1)
            pred = self.draft_ids[lg.argmax(-1)]
            stats[f"acc{i}"] = float(((pred == tokens[:, i + 2:i + 2 + n]) & valid.bool()).sum() / valid.sum().clamp_min(1))
        return total, stats

    def loss(self, seqs):
        seqs = with_features(self.target, seqs, self.aux_layers, self.spec.max_len)  # online shards: a pass each
        batch = to_device(pad_batch(seqs, self.spec.max_len, self.aux_layers), self.device)
        if self.spec.kind == "medusa":
            return self.medusa_loss(batch)
        return self.eagle_loss(batch, self.spec.ttt_steps)

    # -- loop -----------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        if step < self.spec.warmup:
            return self.spec.lr * (step + 1) / self.spec.warmup
        t = (step - self.spec.warmup) / max(1, self.total_steps - self.spec.warmup)
        return self.spec.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    def _batches(self):
        """Deterministic order per epoch (seed + epoch); batches of similar length."""
        bs, epoch = self.spec.batch_size, 0
        while True:
            order = list(range(len(self.train)))
            random.Random(self.spec.seed + epoch).shuffle(order)
            chunks = [order[i:i + bs * 8] for i in range(0, len(order), bs * 8)]
            for chunk in chunks:
                chunk.sort(key=lambda i: len(self.train[i].tokens))
                for i in range(0, len(chunk), bs):
                    yield [self.train[j] for j in chunk[i:i + bs]]
            epoch += 1

    def settings(self) -> dict:
        """What a resumed run must share with the run it resumes: the head's shape and the schedule. The data
        may grow (a run resumed on more shards; the checkpoint's vocabulary wins) but keeps its held-out
        prompts (maybe_resume checks the record), and the output, the cadence of evaluations and checkpoints
        and the saved dtype may change."""
        return {k: v for k, v in asdict(self.spec).items()
                if k not in ("data", "max_train_seqs", "out", "eval_every", "ckpt_every", "save_dtype")}

    def save_checkpoint(self, seconds_this_run: float = 0.0) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                 "rng": torch.get_rng_state(), "history": json.dumps(self.history),
                 "settings": json.dumps(self.settings()), "total_steps": self.total_steps,
                 "heldout_prompts": json.dumps(self.heldout_prompts),
                 "seconds": self.seconds_before + seconds_this_run}
        write_checkpoint(self.out / "checkpoint.pt", state)

    def maybe_resume(self) -> bool:
        path = self.out / "checkpoint.pt"
        if not path.exists():
            return False
        state = read_checkpoint(path, self.device)
        check_settings(state, self.settings(), self.out)
        if json.loads(state.get("heldout_prompts", "null")) not in (None, self.heldout_prompts):
            # its head trained on data of another split: this run's record would call some of the prompts
            # it trained on held out
            raise ConfigError(f"{self.out} holds a run on data with other held-out prompts; resume on that data "
                              "(more of its shards may be added), or use a new --out")
        self.head.load_state_dict(state["head"])
        # the checkpoint's draft vocabulary wins: new data (a resumed run on more shards) would rank
        # another top-Vd set, and the head's rows follow the vocabulary it was trained with
        self._use_vocab(self.head.draft_ids.clone())
        self.opt.load_state_dict(state["opt"])
        self.step, self.history = int(state["step"]), json.loads(state["history"])
        if self.spec.max_seconds is not None:  # the steps as the time budget had cut them
            self.total_steps = int(state.get("total_steps", self.total_steps))
        self.seconds_before = float(state.get("seconds", 0.0))
        torch.set_rng_state(state["rng"].cpu())
        return True

    def run(self, evaluate=None) -> dict:
        from tqdm import tqdm

        resumed = self.maybe_resume()
        batches = self._batches()
        for _ in range(self.step):  # skip what a previous run already trained on
            next(batches)
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.spec.kind}", disable=not self.progress)
        if self.step == 0 and self.spec.init_from and evaluate is not None:  # the head it starts from
            self.head.eval()
            self.history.append({"step": 0, **evaluate(self)})
            bar.write(json.dumps(self.history[-1]))
        t0, seen, start_step = time.perf_counter(), 0, self.step
        self.head.train()
        while self.step < self.total_steps:
            seqs = next(batches)
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.step)
            loss, stats = self.loss(seqs)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.spec.grad_clip)
            self.opt.step()
            self.step += 1
            seen += sum(len(s.tokens) for s in seqs)
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", **{k: f"{v:.2f}" for k, v in stats.items()})
            if self.step - start_step == 10:
                self._fit_budget(start_step, time.perf_counter() - t0, bar)
            if self.step % self.spec.eval_every == 0 or self.step == self.total_steps:
                rec = {"step": self.step, "loss": loss.item(), **stats}
                if evaluate is not None:
                    self.head.eval()
                    rec.update(evaluate(self))
                    self.head.train()
                self.history.append(rec)
                bar.write(json.dumps(rec))
                self._fit_budget(start_step, time.perf_counter() - t0, bar)
            if self.step % self.spec.ckpt_every == 0:
                self.save_checkpoint(time.perf_counter() - t0)
        bar.close()
        self.save_checkpoint(time.perf_counter() - t0)
        return {"resumed": resumed, "train_tokens_this_run": seen, "seconds_this_run": time.perf_counter() - t0}

    def _fit_budget(self, start_step: int, elapsed: float, bar) -> None:
        """Set total_steps to what max_seconds leaves room for at the pace measured so far (evaluations
        included), never past the planned steps nor below the steps taken."""
        if self.spec.max_seconds is None or self.step <= start_step:
            return
        pace = elapsed / (self.step - start_step)
        fits = self.step + max(0, int((self.spec.max_seconds - self.seconds_before - elapsed) / pace))
        self.total_steps = max(self.step, min(self.planned_steps, fits))
        bar.total = self.total_steps
        bar.refresh()

    def export(self, extra: dict) -> Path:
        cfg = replace(self.head.cfg, training={**extra, "spec": asdict(self.spec), "history": self.history,
                                               "draft_vocab_coverage": self.coverage,
                                               "heldout_prompts": self.heldout_prompts,
                                               "target_config": {"num_hidden_layers": self.target.config.num_hidden_layers}})
        self.head.cfg = cfg
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.spec.save_dtype]
        return save_head(self.head.eval(), self.out / "head", dtype)  # save_head copies to the CPU
