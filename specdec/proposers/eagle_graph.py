"""The EAGLE head's passes as CUDA graphs, for one request at a time (the single-request decoder's).

Eager on a GPU, a head pass is ~40 kernel launches for microseconds of work, and a proposal makes one
pass per depth plus the digest of the accepted rows: launches, not math, would set the draft's cost.
GraphedHead replays EagleHead.forward_static instead, one graph per bucket of rows (TOKEN_BUCKETS)
and key span, over a draft KV cache it owns (graphs bake in its address) and hands to each request.
Rows are padded up to the bucket: padding rows see only themselves and write slots past the block.
Passes that fit no bucket, or on any other cache (the serving engine's rows), run forward_layer.
"""
from __future__ import annotations

import torch

from specdec.model.cuda_graph import TOKEN_BUCKETS, CapturedCalls, bucket_of, key_span
from specdec.proposers.heads import DraftKV


class GraphedHead:
    def __init__(self, head, capacity: int, dtype: torch.dtype, device: torch.device, graphs: bool = True):
        self.head = head
        self.cache = DraftKV(head.cfg, capacity + TOKEN_BUCKETS[-1], dtype, device)
        self.capacity = capacity
        self.calls = CapturedCalls(torch.device(device), graphs)
        self.eager_passes = 0

    def new_cache(self) -> DraftKV:
        """The owned cache, emptied: one request at a time."""
        self.cache.length = 0
        return self.cache

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: DraftKV,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """EagleHead.forward_layer's result [1, T, H] (its mask convention: [T, length + T] or None for
        causal), through a graph where the pass fits one; advances cache.length by T."""
        T, start = embeds.shape[1], cache.length
        bucket = bucket_of(T)
        keys = (None if bucket is None or cache is not self.cache or start + T > self.capacity
                else key_span(start + bucket, cache.k.shape[2]))
        out = None if keys is None else self._replay(embeds, hidden, positions, mask, bucket, keys)
        if out is None:
            self.eager_passes += 1
            mask = None if mask is None else mask.to(embeds.device)
            return self.head.forward_layer(embeds, hidden, positions, cache, mask)
        cache.length = start + T
        return out

    def _replay(self, embeds, hidden, positions, mask, bucket: int, keys: int) -> torch.Tensor | None:
        T, start, H = embeds.shape[1], self.cache.length, embeds.shape[-1]
        full = torch.zeros(bucket, keys, dtype=torch.bool)  # [Tb, S]: each row's visible slots
        if mask is None:
            full[:T, :start] = True
            full[:T, start:start + T] = torch.ones(T, T, dtype=torch.bool).tril()
        else:
            full[:T, :start + T] = mask.cpu()
        pad = torch.arange(T, bucket)
        full[pad, start + pad] = True
        slots = torch.arange(start, start + bucket)
        dev = embeds.device

        def alloc():
            return (torch.zeros(1, bucket, H, dtype=embeds.dtype, device=dev),
                    torch.zeros(1, bucket, hidden.shape[-1], dtype=hidden.dtype, device=dev),
                    torch.zeros(1, bucket, dtype=torch.long, device=dev),
                    torch.zeros(bucket, dtype=torch.long, device=dev),
                    torch.zeros(bucket, keys, dtype=torch.bool, device=dev))

        def fill(bufs):
            e, h, p, s, m = bufs
            e[:, :T].copy_(embeds)
            h[:, :T].copy_(hidden)
            p[:, :T].copy_(positions)
            p[:, T:].copy_(positions[:, -1:].expand(1, bucket - T))
            s.copy_(slots)
            m.copy_(full)

        def run(e, h, p, s, m):
            return self.head.forward_static(e, h, p, self.cache, s, m)

        out = self.calls((bucket, keys), alloc, fill, run)
        return None if out is None else out[:, :T].clone()

    def stats(self) -> dict:
        return {"graphs": self.calls.num_graphs, "replays": self.calls.replays, "eager_passes": self.eager_passes,
                "disabled": self.calls.disabled}
