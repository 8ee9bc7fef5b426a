"""CUDA graphs for the target's decode and verify passes, one request at a time.

At batch 1 a GPU forward is bound by kernel launches, not by math: the 135M model takes ~11 ms eager
for ~1.6 ms of kernels replayed as a graph (docs/benchmarks/gpu-s24.md). GraphedModel wraps a
LlamaModel: the first pass of each shape bucket (T new tokens rounded up to one of TOKEN_BUCKETS, the
keys attended rounded up to a power of two, the hidden layers kept) captures LlamaModel.forward_static
into a graph; every later pass of that bucket copies its inputs into the graph's static buffers and
replays it. Padding rows write cache slots past the block, which no query sees and the next block
overwrites. Outputs are cloned out of the static buffers, so nothing a caller keeps (EAGLE's queued
features) is overwritten by the next replay.

Graphs bake in addresses, so the wrapper owns one KV cache, handed (reset) to each request by
new_cache. Everything else runs the model eagerly on the same cache: prompt passes, layer subsets
(self-speculation), blocks over the largest bucket, any other cache. Without CUDA (or graphs=False)
the same static pass runs uncaptured, which is how CPU tests check the wrapper's bookkeeping.
CapturedCalls is the capture-and-replay bookkeeping itself, shared with the EAGLE head's graphs
(proposers/eagle_graph.py) and the training-data generator (train/generate.py); pass_width pads every
pass to one width, so plain and speculative passes run the same GEMM kernels.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdec.cache.kv_cache import KVCache, kv_dtype
from specdec.config import ConfigError

TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
MIN_KEYS = 256  # the narrowest key span a graph attends over


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): host timers around GPU work need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=64)
def _eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool)  # kept: small host ops cost ~0.1 ms each on a slow VM


@functools.lru_cache(maxsize=64)
def causal(n: int) -> torch.Tensor:
    """[n, n] lower-triangular bool on the host, kept (callers copy from it, never into it)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def check_pass_width(width: int) -> None:
    if not 1 <= width <= TOKEN_BUCKETS[-1]:
        raise ConfigError(f"pass_width must be in [1, {TOKEN_BUCKETS[-1]}], got {width}")


def key_span(end: int, capacity: int) -> int | None:
    """The keys a static pass attends over: a power of two >= end (MIN_KEYS at least) within the cache's
    capacity; None when end does not fit."""
    span = min(max(MIN_KEYS, 1 << max(end - 1, 0).bit_length()), capacity)
    return span if end <= span else None


def bucket_of(num_tokens: int) -> int | None:
    """The smallest TOKEN_BUCKETS entry >= num_tokens (None: wider than every bucket)."""
    return next((b for b in TOKEN_BUCKETS if b >= num_tokens), None)


@dataclass
class _Entry:
    bufs: tuple  # the static inputs (device tensors)
    graph: "torch.cuda.CUDAGraph | None" = None
    out: object = None  # what a replay overwrites


class CapturedCalls:
    """Graphs of functions of device buffers, keyed by shape: the first call of a key allocates its input
    buffers (alloc), fills them with this call's inputs (fill), captures fn(*buffers) after a warm-up run
    and replays it; later calls fill and replay. The warm-up runs on this call's real inputs, so side
    effects it has (a KV cache write) are the call's own. Without CUDA (or enabled=False) fn runs on the
    buffers uncaptured: the same bookkeeping, testable on a CPU. A key whose capture fails (out of memory
    for a wide key span, say) runs eagerly from then on (call returns None: the caller's eager path), with
    one warning; the other keys keep their graphs.
    Capture and replay run on `device` (its side stream, it made current), whichever device is current.
    Every graph shares one memory pool, so a replay may overwrite what an earlier replay returned: a caller
    takes (clones, copies to the host) a result before the next call of any key."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.entries: dict[tuple, _Entry] = {}
        self.pool = None  # one memory pool for all graphs (they never run at once)
        self.failed: dict[tuple, str] = {}  # keys whose capture failed -> why: they run eagerly
        self.replays = 0

    @property
    def failure(self) -> str | None:
        """Why a capture failed (the first failure; its shape, and any other that failed, run eagerly, the
        rest replay); None while every capture succeeded."""
        return next(iter(self.failed.values()), None)

    def __call__(self, key: tuple, alloc: Callable[[], tuple], fill: Callable[[tuple], None],
                 fn: Callable[..., object]):
        if key in self.failed:
            return None
        entry = self.entries.get(key)
        new = entry is None
        if new:
            entry = _Entry(alloc())
        fill(entry.bufs)
        if new:
            failure = self._capture(entry, fn) if self.enabled else None
            if failure is not None:
                self.failed[key] = failure
                warnings.warn(f"CUDA graph capture failed, running this shape eagerly: {failure}", stacklevel=3)
                return None
            self.entries[key] = entry
        self.replays += 1
        if entry.graph is None:
            return fn(*entry.bufs)
        with torch.cuda.device(self.device):
            entry.graph.replay()
        return entry.out

    def _capture(self, entry: _Entry, fn) -> str | None:
        """Warm fn up on a side stream of `device` and capture it there into entry; why it failed, or None.
        (Without stream=, torch captures on a stream of the current device: a model on another GPU then
        ran outside the capture, and every replay of the empty graph returned the warm-up's outputs.)"""
        try:
            with torch.cuda.device(self.device):
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    fn(*entry.bufs)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=side):
                    entry.out = fn(*entry.bufs)
        except RuntimeError as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        self.pool = graph.pool()
        entry.graph = graph
        return None

    @property
    def num_graphs(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def stats(self) -> dict:
        return {"graphs": self.num_graphs, "replays": self.replays, "capture_failure": self.failure,
                "failed_shapes": len(self.failed)}


class GraphedModel:
    """A LlamaModel whose single-request decode/verify passes replay CUDA graphs (see module doc)."""

    def __init__(self, model, graphs: bool = True, pass_width: int = 1):
        if not hasattr(model, "forward_static"):
            raise TypeError(f"{type(model).__name__} has no static forward to capture")
        check_pass_width(pass_width)
        self.model = model
        # every decode/verify pass at least this many rows wide: passes of one width run the same GEMM
        # kernels, whose rows do not depend on each other, where one-row and 16-row passes did not agree
        # (a 16-node tree's verify left 9 of 16 bf16 answers at near-ties, session 25). A chain's keys lie
        # where plain decoding's do; a tree's ancestors may fall in other attention blocks, so its sums
        # can still differ in the last bits (not yet measured on a GPU)
        self.pass_width = pass_width
        self.calls = CapturedCalls(model.device, graphs)
        self.cache: KVCache | None = None  # allocated on the first new_cache
        self.hosts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> host input block, argmax
        self.eager_passes = 0

    # the decoder may hand this pass's ids and positions on the host: they go over in the one copy
    takes_host_inputs = True

    def __getattr__(self, name: str):  # config, device, dtype, max_len, embed, lm_head, ... are the model's
        return getattr(self.__dict__["model"], name)

    def new_cache(self, max_len: int | None = None, batch_size: int = 1) -> KVCache:
        """The wrapper's own cache, emptied (one request at a time); a batch gets a fresh eager cache."""
        if batch_size != 1:
            return self.model.new_cache(max_len, batch_size)
        if self.cache is None:  # room for the widest bucket's padding past the context's last slot
            self.cache = KVCache.for_model(self.model.config, self.model.max_len + TOKEN_BUCKETS[-1],
                                           kv_dtype(self.model), 1, self.model.device)
        self.cache.reset()
        return self.cache

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 block_mask: torch.Tensor | None = None, num_logits: int | None = None,
                 layers: Sequence[int] | None = None, output_layers: Sequence[int] = (),
                 input_embeds: torch.Tensor | None = None, prefill: bool = False):
        B, T = input_ids.shape
        bucket = bucket_of(max(T, self.pass_width))
        keys = None if bucket is None or cache is not self.cache else key_span(cache.length + bucket, cache.max_len)
        if not (B != 1 or keys is None or prefill or layers is not None or num_logits is not None
                or input_embeds is not None):
            with torch.inference_mode():
                out = self._replay(input_ids, positions, block_mask, bucket, keys, tuple(output_layers))
            if out is not None:
                return out
        self.eager_passes += 1
        dev = self.model.device
        return self.model(input_ids.to(dev), positions.to(dev), cache, block_mask=block_mask, num_logits=num_logits,
                          layers=layers, output_layers=output_layers, input_embeds=input_embeds, prefill=prefill)

    def _replay(self, input_ids, positions, block_mask, bucket: int, keys: int, output_layers: tuple):
        """One pass through the bucket's graph (None: capture failed, run eagerly)."""
        T = input_ids.shape[1]
        if bucket not in self.hosts:
            pin = self.model.device.type == "cuda"
            self.hosts[bucket] = (torch.zeros(4 + bucket, bucket, dtype=torch.long, pin_memory=pin),
                                  torch.zeros(bucket, dtype=torch.long, pin_memory=pin))
        host, argmax_host = self.hosts[bucket]
        self._fill(host, input_ids, positions, block_mask, self.cache.length)

        def run(d):  # d: the device copy of the input block
            out = self.model.forward_static(d[0:1], d[1:2], d[2], d[3, 0], d[4:] != 0, self.cache, keys, output_layers)
            return out, out.logits[0].argmax(-1)  # [T]

        dev = self.model.device
        got = self.calls((bucket, keys, output_layers),
                         lambda: (torch.zeros(4 + bucket, bucket, dtype=torch.long, device=dev),),
                         lambda bufs: bufs[0].copy_(host, non_blocking=True), run)
        if got is None:
            return None
        out, argmax = got
        argmax_host.copy_(argmax, non_blocking=True)
        synchronize(dev)  # the one wait of a pass: its argmax is on the host after it
        self.cache.advance(T)
        layer_hidden = None if out.layer_hidden is None else {i: h[:, :T].clone() for i, h in out.layer_hidden.items()}
        return type(out)(out.logits[:, :T].clone(), out.hidden[:, :T].clone(), layer_hidden,
                         row_argmax=argmax_host[:T].tolist())

    @staticmethod
    def _fill(host: torch.Tensor, input_ids, positions, block_mask, start: int) -> None:
        """Write one pass's inputs into the bucket's host block (one copy to the device): row 0 input ids,
        1 positions, 2 cache slots, [3, 0] the first slot, rows 4.. the block mask as 0/1. Padding rows
        see only themselves and write slots past the block."""
        T, bucket = input_ids.shape[1], host.shape[1]
        host[0, :T], host[0, T:] = input_ids[0], 0
        host[1, :T], host[1, T:] = positions[0], positions[0, -1]
        host[2] = torch.arange(start, start + bucket)
        host[3, 0] = start
        block = host[4:]
        block.copy_(_eye(bucket))
        block[:T, :T] = causal(T) if block_mask is None else block_mask

    def stats(self) -> dict:
        return {**self.calls.stats(), "eager_passes": self.eager_passes}
