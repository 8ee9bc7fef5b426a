"""Batched greedy generation on our own runtime, for training data (`specdec train data --generator specdec`).

transformers' loop (train/data.py, generate_batch) regenerated ~7k tokens/s at batch 512 on a lent H200
(sessions 24-25): ~66 ms a step for a few ms of work, which capped a 15-minute lease at ~2 M tokens of
training data. Here a batch of left-padded prompts goes through LlamaModel.forward_static in lock step
over a static KV cache: the prompts in one uncaptured pass, then every decode step one CUDA-graph replay
per key span (a power of two; model/cuda_graph.py), each row's padding masked (key_valid). The
features are those our engine computes at inference (the final normed state and the aux layers'
outputs), as fp16. Without CUDA the same passes run uncaptured (the tests compare them with
transformers' generate_batch).
"""
from __future__ import annotations

import time

import torch

from specdec.cache.kv_cache import KVCache
from specdec.model.cuda_graph import CapturedCalls, key_span
from specdec.train.data import assemble_sequences
from specdec.train.features import Shard


PROMPT_ROUND = 64  # padded prompt lengths are multiples of this: a few cache shapes, a few graphs


class StaticGenerator:
    """generate_batch's contract (tokens; features of every position but the last, or None when not
    `features`) on a LlamaModel. Graphs bake in the KV cache's address, so the cache of a batch size and
    padded length and its step graphs are kept across batches, until a batch of another shape drops them
    (512 rows of 900 positions take 22 GB of cache, which a GPU holds a few of, not eight)."""

    def __init__(self, model, graphs: bool = True):
        self.model = model
        self.calls = CapturedCalls(model.device, graphs)
        self.shape, self.cache = None, None  # (batch size, positions) of the cache kept, and the cache
        # the graphs of the shapes dropped so far (graph_stats)
        self._graphs_before = {"captured": 0, "replays": 0, "capture_failure": None}
        # where the time goes, summed over batches (a GPU synchronized at each boundary): the prompt passes,
        # the decode steps, and turning a batch's steps into sequences on the host
        self.seconds = {"prompt": 0.0, "decode": 0.0, "assemble": 0.0}

    def graph_stats(self) -> dict:
        """The decode steps' CUDA graphs over every batch so far: graphs captured, steps that went through
        them (replays; uncaptured runs where graphs are off), why they were off (None: they were not), and the
        first capture that failed (its shape ran eagerly; None: none did)."""
        done = self._graphs_before
        now = self.calls
        reason = None if now.enabled else "no CUDA" if self.model.device.type != "cuda" else "off"
        return {"captured": done["captured"] + sum(e.graph is not None for e in now.entries.values()),
                "replays": done["replays"] + now.replays, "disabled": reason,
                "capture_failure": now.failure or done["capture_failure"]}

    def _lap(self, phase: str, since: float) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                 aux_layers: tuple[int, ...], features: bool = True) -> list[Shard.Sequence]:
        model, B = self.model, len(prompts)
        start = time.perf_counter()
        L = -(-max(len(p) for p in prompts) // PROMPT_ROUND) * PROMPT_ROUND
        dev, total = model.device, L + max_new_tokens
        pad = torch.tensor([L - len(p) for p in prompts])
        ids = torch.zeros(B, L, dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding
            ids[b, L - len(p):] = torch.tensor(p)
        if self.shape != (B, total):  # batches come sorted by length: keep one shape's cache and graphs at a time
            self.cache = None
            self._graphs_before = self.graph_stats()
            self.calls = CapturedCalls(dev, self.calls.enabled)  # (a shape whose capture failed: eager alone)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            self.shape, self.cache = (B, total), KVCache.for_model(model.config, total, model.dtype, B, dev)
        cache = self.cache
        key_valid = (torch.arange(total)[None] >= pad[:, None]).to(dev)  # [B, total]: no row sees its padding
        out = model.forward_static(ids.to(dev), (torch.arange(L)[None] - pad[:, None]).clamp_min(0).to(dev),
                                   torch.arange(L, device=dev), torch.zeros((), dtype=torch.long, device=dev),
                                   torch.ones(L, L, dtype=torch.bool, device=dev).tril(), cache, L, aux_layers,
                                   key_valid, last_logits=True)
        feats = [_features(out, aux_layers)] if features else []  # per pass: [B, T, H] final, then aux
        nxt = out.logits[:, -1].argmax(-1)  # [B]
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
        start = self._lap("prompt", start)
        done = torch.isin(nxt, eos)
        tokens = [nxt]
        step = torch.zeros(3, B, dtype=torch.long, device=dev)  # the pass's input ids, positions, [slot, ...]
        for i in range(max_new_tokens - 1):
            if bool(done.all()):
                break
            keys = key_span(L + i + 1, total)
            step[0], step[1], step[2, 0] = nxt, (L - pad).to(dev) + i, L + i
            got = self.calls(
                ("step", B, total, keys, aux_layers), lambda: (torch.zeros_like(step), key_valid.clone()),
                lambda bufs: (bufs[0].copy_(step), bufs[1].copy_(key_valid)),
                lambda s, valid: _decode_step(model, cache, s, valid, keys, aux_layers))
            out, nxt = got if got is not None else _decode_step(model, cache, step, key_valid, keys, aux_layers)
            if features:
                feats.append(_features(out, aux_layers))
            nxt = torch.where(done, torch.zeros_like(nxt), nxt)
            tokens.append(nxt)
            done |= torch.isin(nxt, eos)
        start = self._lap("decode", start)
        seqs = assemble_sequences(prompts, tokens, feats, eos_ids, L, aux_layers)
        self._lap("assemble", start)
        return seqs


def _decode_step(model, cache, step, key_valid, keys: int, aux_layers):
    """One lock-step decode pass (captured): each row's next token at its own position, cache slot
    step[2, 0] (shared) -> (the pass's output, each row's argmax [B])."""
    block = torch.ones(1, 1, dtype=torch.bool, device=step.device)
    out = model.forward_static(step[0][:, None], step[1][:, None], step[2, :1], step[2, 0], block, cache, keys,
                               aux_layers, key_valid)
    return out, out.logits[:, -1].argmax(-1)


def _features(out, aux_layers) -> list[torch.Tensor]:
    """The pass's features as fp16 copies (a copy even of fp16 outputs: the graphs' shared pool may reuse their
    memory at the next replay)."""
    return [out.hidden.to(torch.float16, copy=True)] + [out.layer_hidden[l].to(torch.float16, copy=True)
                                                        for l in aux_layers]
