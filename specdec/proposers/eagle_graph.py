"""The EAGLE head's passes as CUDA graphs, for one request at a time (the single-request decoder's).

Eager on a GPU, a head pass is ~40 kernel launches for microseconds of work, and a proposal makes one
pass per depth plus the digest of the accepted rows: launches, not math, would set the draft's cost.
GraphedHead replays EagleHead.forward_static instead, one graph per bucket of rows (TOKEN_BUCKETS)
and key span, over a draft KV cache it owns (graphs bake in its address) and hands to each request.
Rows are padded up to the bucket: padding rows see only themselves and write slots past the block.
Passes that fit no bucket, or on any other cache (the serving engine's rows), run forward_layer.
"""
from __future__ import annotations

import functools

import torch

from specdec.model.cuda_graph import TOKEN_BUCKETS, CapturedCalls, bucket_of, key_span
from specdec.proposers.heads import DraftKV


@functools.lru_cache(maxsize=64)
def _causal(n: int) -> torch.Tensor:
    """[n, n] lower-triangular bool (kept: a host tril costs ~0.1 ms on a slow VM, once a pass)."""
    return torch.ones(n, n, dtype=torch.bool).tril()


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
            full[:T, start:start + T] = _causal(T)
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

    @torch.inference_mode()
    def digest_and_chain(self, feats: torch.Tensor | None, tokens: list[int], offset: int, g: torch.Tensor,
                         num_steps: int, embed, draft_ids: torch.Tensor, lm_head) -> tuple[list[int], torch.Tensor]:
        """A greedy chain's whole proposal in one replay: digest the n accepted rows (feats [n, F], their next
        tokens) at cache rows [length, length + n), then draft num_steps tokens from the last row's output
        (g [1, 1, H] when n = 0). Returns the drafted target ids and the last committed row's output
        [1, 1, H]; cache.length ends at length + n (the chain's rows are speculative)."""
        n, start = len(tokens), self.cache.length
        nb = bucket_of(n) if n else 0
        keys = key_span(start + nb + num_steps, self.cache.k.shape[2])
        if nb is None or keys is None or start + n + num_steps > self.capacity:
            return None
        dev, H = g.device, g.shape[-1]
        F = feats.shape[-1] if n else 1
        # rows: tokens, positions, slots (nb each), then [last row, chain's first slot, its position]
        host = torch.zeros(4, max(nb, 3), dtype=torch.long)
        mask = torch.zeros(max(nb, 1), keys, dtype=torch.bool)
        if n:
            host[0, :n] = torch.tensor(tokens)
            host[1, :nb] = offset + start + torch.arange(nb).clamp(max=n - 1)
            host[2, :nb] = start + torch.arange(nb)
            mask[:n, :start] = True
            mask[:n, start:start + n] = _causal(n)
            pad = torch.arange(n, nb)
            mask[pad, start + pad] = True
        host[3, :3] = torch.tensor([max(n - 1, 0), start + n, offset + start + n])  # last row, chain's slot, position

        def alloc():
            return (torch.zeros(1, max(nb, 1), F, dtype=g.dtype, device=dev), torch.zeros_like(host, device=dev),
                    torch.zeros_like(mask, device=dev), torch.zeros(1, H, dtype=g.dtype, device=dev))

        def fill(bufs):
            f, h, m, g_in = bufs
            if n:
                f[0, :n].copy_(feats)
            h.copy_(host)
            m.copy_(mask)
            g_in.copy_(g.reshape(1, H))

        def run(f, h, m, g_in):
            return self._chain(f, h, m, g_in, nb, keys, num_steps, embed, draft_ids, lm_head)

        got = self.calls(("chain", nb, keys, num_steps), alloc, fill, run)
        if got is None:
            return None
        committed, drafted = got
        self.cache.length = start + n
        return drafted.tolist(), committed.clone()[None]

    def _chain(self, feats, host, mask, g_in, nb: int, keys: int, num_steps: int, embed, draft_ids, lm_head):
        """digest_and_chain's device work (captured): tensors only, shapes fixed by the bucket."""
        head = self.head
        if nb:
            emb = embed(host[0:1, :nb])  # [1, nb, H]
            out = head.forward_static(emb, head.fuse(feats.to(emb.dtype), emb), host[1:2, :nb], self.cache,
                                      host[2, :nb], mask)  # [1, nb, H]
            g = out[0].index_select(0, host[3, 0:1])  # [1, H]: the last real row's
        else:
            g = g_in
        committed, drafted = g, []
        slots = torch.arange(keys, device=g.device)
        for d in range(num_steps):
            tok = draft_ids[head.logits(g, lm_head).float().argmax(-1)]  # [1] target id
            drafted.append(tok)
            if d + 1 < num_steps:
                e = embed(tok)[None]  # [1, 1, H]
                slot = host[3, 1:2] + d  # [1]: the chain's row d
                g = head.forward_static(e, head.step_input(e, g[None]), (host[3, 2:3] + d)[None], self.cache, slot,
                                        (slots < slot + 1)[None])[0]  # [1, H]
        return committed, torch.cat(drafted)

    def stats(self) -> dict:
        return {"graphs": self.calls.num_graphs, "replays": self.calls.replays, "eager_passes": self.eager_passes,
                "disabled": self.calls.disabled}
