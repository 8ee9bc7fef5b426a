"""The target's hidden states on disk (safetensors shards) or computed on the fly.

Shard layout (one file per generation batch, S sequences, N tokens in all):
    tokens       int32   [N]          prompt + response ids, sequences back to back
    offsets      int64   [S + 1]      token offsets: sequence s is tokens[offsets[s]:offsets[s+1]]
    prompt_lens  int64   [S]          the first prompt_lens[s] tokens are the prompt (no loss there)
    hidden       float16 [N - S, H]   final normed hidden state of every position but each sequence's
                                      last (sequence s: rows offsets[s] - s .. offsets[s+1] - s - 1)
    aux.<l>      float16 [N - S, H]   output of target layer l (EAGLE-3 low/mid/high), same rows
E.g. two sequences of 4 and 3 tokens: offsets [0, 4, 7], feature rows [0..3) and [3..5).

Online mode (`specdec train data --online`, for when the disk is short: features take ~4.6 KB a token
for EAGLE-3 on the default model, tokens 4 bytes): shards hold tokens, offsets and prompt_lens only,
and `with_features` runs the target over each sequence when a batch needs it (one pass each, the
same features as the offline shards' up to their fp16 rounding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdec.config import ConfigError, read_json_object
from specdec.model.output_dir import sync_replace


@dataclass
class Shard:
    @dataclass
    class Sequence:
        tokens: list[int]  # [n]
        prompt_len: int
        hidden: torch.Tensor | None  # [n - 1, H]; None: online, computed when needed (with_features)
        aux: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n - 1, H]

        @property
        def loss_mask(self) -> torch.Tensor:
            """[n] True at assistant (response) tokens."""
            m = torch.zeros(len(self.tokens), dtype=torch.bool)
            m[self.prompt_len:] = True
            return m

    sequences: list[Sequence]


def write_shard(path: Path, seqs: list[Shard.Sequence]) -> None:
    lens = torch.tensor([len(s.tokens) for s in seqs])
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.long),
    }
    online = [s.hidden is None for s in seqs]
    if any(online) and not all(online):
        raise ValueError("a shard holds features for every sequence or for none")
    if not online[0]:
        tensors["hidden"] = torch.cat([s.hidden for s in seqs]).half().contiguous()
        for layer in seqs[0].aux:
            tensors[f"aux.{layer}"] = torch.cat([s.aux[layer] for s in seqs]).half().contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    sync_replace(tmp, path)  # neither a killed run nor a crashed machine leaves a half-written shard behind


def read_shard(path: Path) -> list[Shard.Sequence]:
    try:
        t = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); delete it and run the data step again to remake it") from None
    off, seqs = t["offsets"].tolist(), []
    aux_keys = [k for k in t if k.startswith("aux.")]
    for s in range(len(off) - 1):
        a, b = off[s], off[s + 1]
        rows = slice(a - s, b - s - 1)
        hidden = t["hidden"][rows] if "hidden" in t else None
        seqs.append(Shard.Sequence(t["tokens"][a:b].tolist(), int(t["prompt_lens"][s]), hidden,
                                   {int(k[4:]): t[k][rows] for k in aux_keys}))
    return seqs


def read_split(directory: Path, limit: int | None = None) -> list[Shard.Sequence]:
    seqs: list[Shard.Sequence] = []
    for path in sorted(directory.glob("shard-*.safetensors")):
        seqs.extend(read_shard(path))
        if limit is not None and len(seqs) >= limit:
            return seqs[:limit]
    return seqs


def read_data_meta(data_dirs, target_config) -> dict:
    """The first data directory's meta.json, every directory's checked against the target and the others
    (data made from another model failed deep in a matmul; features from other layers trained nonsense),
    with "heldout_prompts": every directory's held-out prompt digests, None where one records none."""
    metas = []
    for d in data_dirs:
        path = Path(d) / "meta.json"
        if not path.exists():
            raise ConfigError(f"{d}: no meta.json (not a directory made by `specdec train data`)")
        meta = read_json_object(path)
        made = (meta.get("hidden_size"), meta.get("num_layers"))
        if made != (target_config.hidden_size, target_config.num_hidden_layers):
            raise ConfigError(f"{d}: data from a model of hidden size {made[0]} and {made[1]} layers, not this "
                              f"target's {target_config.hidden_size} and {target_config.num_hidden_layers}")
        metas.append(meta)
    if len({tuple(m.get("aux_layers") or ()) for m in metas}) > 1:
        raise ConfigError("the data directories hold features of different target layers (aux_layers)")
    recorded = [m.get("heldout_prompts") for m in metas]
    held = None if any(r is None for r in recorded) else sorted({d for r in recorded for d in r})
    return {**metas[0], "heldout_prompts": held}


def train_and_heldout(data_dirs, max_train: int | None = None) -> tuple[list[Shard.Sequence], list[Shard.Sequence]]:
    """The train and held-out sequences of the data directories; a train sequence whose prompt is, or
    begins with, a held-out prompt (another directory's: teacher-forced data draws on the same ShareGPT
    first turns, and a later turn carries its conversation's first) is left out, as it would measure a
    drafter on what it was trained on."""
    held = [s for d in data_dirs for s in read_split(Path(d) / "heldout")]
    held_prompts = {tuple(s.tokens[:s.prompt_len]) for s in held}
    lengths = sorted({len(p) for p in held_prompts})

    def on_held(s) -> bool:
        return any(tuple(s.tokens[:n]) in held_prompts for n in lengths if n <= s.prompt_len)

    train = [s for d in data_dirs for s in read_split(Path(d) / "train") if not on_held(s)][:max_train]
    return train, held


@torch.inference_mode()
def compute_features(model, tokens: list[int], prompt_len: int, aux_layers: tuple[int, ...] = ()) -> Shard.Sequence:
    """Online mode: one target pass with our engine gives the same features as the shards."""
    n, device = len(tokens), model.device
    cache = model.new_cache(n)
    out = model(torch.tensor([tokens], device=device), torch.arange(n, device=device)[None], cache, num_logits=1,
                output_layers=aux_layers)
    return Shard.Sequence(list(tokens), prompt_len, out.hidden[0, :n - 1].float().cpu(),
                          {l: out.layer_hidden[l][0, :n - 1].float().cpu() for l in aux_layers})


def with_features(model, seqs: list[Shard.Sequence], aux_layers: tuple[int, ...] = (),
                  max_len: int | None = None) -> list[Shard.Sequence]:
    """seqs, each with its features: stored ones as they are, online ones (hidden None) computed by a
    target pass over their first max_len tokens (the trainer's cut: no pass over tokens it drops)."""
    return [s if s.hidden is not None else
            compute_features(model, s.tokens[:max_len] if max_len else s.tokens, s.prompt_len, aux_layers)
            for s in seqs]


def token_counts(seqs: list[Shard.Sequence], vocab_size: int, response_only: bool = True) -> torch.Tensor:
    """[V] how often each token occurs (for the reduced draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        ids = torch.tensor(s.tokens[s.prompt_len:] if response_only else s.tokens)
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts
