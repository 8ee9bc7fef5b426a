"""The EAGLE head's passes as CUDA graphs, for one request at a time (the single-request decoder's).

Eager on a GPU, a head pass is ~40 kernel launches for microseconds of work, and a proposal makes one
pass per depth plus the digest of the accepted rows: launches, not math, would set the draft's cost.
GraphedHead replays EagleHead.forward_static instead, one graph per bucket of rows (TOKEN_BUCKETS)
and key span, over a draft KV cache it owns (graphs bake in its address) and hands to each request.
Rows are padded up to the bucket: padding rows see only themselves and write slots past the block.
Passes that fit no bucket, or on any other cache (the serving engine's rows), run forward_layer.
digest_and_draft goes further: a whole proposal (the digest of the accepted rows, then a greedy
chain's drafts or an EAGLE-2 tree's depths) is one replay, with one copy back (H200, session 25: a
5-token chain's drafting 4.4 -> 0.85 ms a proposal).
"""
from __future__ import annotations

import torch

from specdec.cache.draft_kv import DraftKV
from specdec.model.cuda_graph import TOKEN_BUCKETS, CapturedCalls, bucket_of, causal, key_span


def _block_mask(rows: int, n: int, start: int, keys: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, keys] bool on the host: each of n new rows at slots start.. sees the slots before start and,
    among the new ones, what `mask` [n, start + n] allows (None: causal); padding rows (n..rows) see only
    their own slot."""
    full = torch.zeros(rows, keys, dtype=torch.bool)
    if mask is None:
        full[:n, :start] = True
        full[:n, start:start + n] = causal(n)
    else:
        full[:n, :start + n] = mask.cpu()
    pad = torch.arange(n, rows)
    full[pad, start + pad] = True
    return full


class GraphedHead:
    """An EagleHead's passes, and whole proposals, as CUDA graphs over one owned draft KV cache."""

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
        full = _block_mask(bucket, T, start, keys, mask)  # [Tb, S]: each row's visible slots
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
    def digest_and_draft(self, kind: str, feats: torch.Tensor | None, tokens: list[int], offset: int,
                         g: torch.Tensor, num_steps: int, topk: int, embed, draft_ids: torch.Tensor, lm_head):
        """A whole proposal in one replay: digest the n accepted rows (feats [n, F], their next tokens) at
        cache rows [length, length + n), then draft from the last row's output (g [1, 1, H] when n = 0):
        kind "chain", num_steps greedy tokens (-> their target ids); kind "tree", EAGLE-2's dynamic tree
        of num_steps depths, topk expanded a depth (-> every node's target id, parent node (-1: the root)
        and cumulative log-probability, for the host's rerank). Also returns the last committed row's
        output [1, 1, H]; cache.length ends at length + n (the draft's rows are speculative). None where
        no graph applies (too many rows, no room)."""
        n, start = len(tokens), self.cache.length
        nb = bucket_of(n) if n else 0
        spec_rows = num_steps if kind == "chain" else (num_steps - 1) * topk
        keys = None if nb is None else key_span(start + nb + spec_rows, self.cache.k.shape[2])
        # the whole num_steps are drafted (then cut to k): their positions must be in the head's rotary table,
        # as the eager paths' (which stop at k) and the C tree's are
        last_position = offset + start + n + num_steps - 1
        if keys is None or start + n + spec_rows > self.capacity or last_position >= self.head.rotary.cos.shape[0]:
            return None
        dev, H = g.device, g.shape[-1]
        F = feats.shape[-1] if n else 1
        # rows: tokens, positions, slots (nb each), then [last row, first speculative slot, its position]
        host = torch.zeros(4, max(nb, 3), dtype=torch.long)
        mask = _block_mask(nb, n, start, keys) if n else torch.zeros(1, keys, dtype=torch.bool)
        if n:
            host[0, :n] = torch.tensor(tokens)
            host[1, :nb] = offset + start + torch.arange(nb).clamp(max=n - 1)
            host[2, :nb] = start + torch.arange(nb)
        host[3, :3] = torch.tensor([max(n - 1, 0), start + n, offset + start + n])

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
            committed = self._digest(f, h, m, nb, embed) if nb else g_in
            draft = self._chain if kind == "chain" else self._tree
            return committed, draft(committed, h, keys, num_steps, topk, embed, draft_ids, lm_head)

        got = self.calls((kind, nb, keys, num_steps, topk), alloc, fill, run)
        if got is None:
            return None
        committed, drafted = got
        self.cache.length = start + n
        return drafted.tolist(), committed.clone()[None]

    def _digest(self, feats, host, mask, nb: int, embed) -> torch.Tensor:
        """The accepted rows through the head (captured); the last real row's output [1, H]."""
        emb = embed(host[0:1, :nb])  # [1, nb, H]
        out = self.head.forward_static(emb, self.head.fuse(feats.to(emb.dtype), emb), host[1:2, :nb], self.cache,
                                       host[2, :nb], mask)  # [1, nb, H]
        return out[0].index_select(0, host[3, 0:1])

    def _chain(self, g, host, keys: int, num_steps: int, topk: int, embed, draft_ids, lm_head) -> torch.Tensor:
        """num_steps greedy drafts from g [1, H] (captured) -> [num_steps] target ids."""
        head, drafted = self.head, []
        slots = torch.arange(keys, device=g.device)
        for d in range(num_steps):
            tok = draft_ids[head.logits(g, lm_head).float().argmax(-1)]  # [1] target id
            drafted.append(tok)
            if d + 1 < num_steps:
                e = embed(tok)[None]  # [1, 1, H]
                slot = host[3, 1:2] + d  # [1]: the chain's row d
                g = head.forward_static(e, head.step_input(e, g[None]), (host[3, 2:3] + d)[None], self.cache, slot,
                                        (slots < slot + 1)[None])[0]  # [1, H]
        return torch.cat(drafted)

    def _tree(self, g, host, keys: int, num_steps: int, K: int, embed, draft_ids, lm_head) -> torch.Tensor:
        """EAGLE-2's dynamic tree from g [1, H] (captured; eagle_tree.dynamic_tree step for step): depth 1
        is the top K; each further depth forwards the K best frontier nodes (each row seeing the committed
        rows, its forwarded ancestors and itself) and scores their top-K children by cumulative
        log-probability. -> [3, N] (target id, parent node, log-probability) as float64, N = K + (num_steps
        - 1) K^2, nodes in the eager order."""
        head, dev = self.head, g.device
        F = (num_steps - 1) * K  # forwarded rows, at slots c .. c + F - 1
        c, pos0 = host[3, 1], host[3, 2]
        spec = c + torch.arange(F, device=dev)
        committed = torch.arange(keys, device=dev) < c  # [S]
        top = torch.log_softmax(head.logits(g, lm_head).float(), dim=-1)[0].topk(K)
        toks, pars, vals = [draft_ids[top.indices]], [torch.full((K,), -1, device=dev)], [top.values]
        f_ids, f_val, f_tok = torch.arange(K, device=dev), top.values, toks[0]
        f_out, f_row = g.expand(K, -1), torch.full((K,), F, device=dev)  # row F of anc: the root's (none)
        anc = torch.zeros(F + 1, F, dtype=torch.bool, device=dev)  # forwarded row -> its ancestors' rows
        eye, count = torch.eye(K, dtype=torch.bool, device=dev), K
        for depth in range(2, num_steps + 1):
            r0 = (depth - 2) * K
            rows = anc[f_row]  # [K, F]
            rows[:, r0:r0 + K] |= eye
            anc[r0:r0 + K] = rows
            mask = committed[None].expand(K, keys).clone().scatter_(1, spec[None].expand(K, F), rows)  # [K, S]
            e = embed(f_tok)[None]  # [1, K, H]
            out = head.forward_static(e, head.step_input(e, f_out[None]), (pos0 + depth - 2).expand(1, K),
                                      self.cache, spec[r0:r0 + K], mask)[0]  # [K, H]
            cand = (f_val[:, None] + torch.log_softmax(head.logits(out, lm_head).float(), dim=-1)).topk(K, dim=-1)
            n_val, n_tok = cand.values.reshape(-1), draft_ids[cand.indices].reshape(-1)  # [K * K]
            src = torch.arange(K, device=dev).repeat_interleave(K)  # each child's parent: a row of `out`
            toks.append(n_tok)
            pars.append(f_ids.repeat_interleave(K))
            vals.append(n_val)
            best = torch.sort(n_val, descending=True, stable=True).indices[:K]  # the next frontier
            f_ids, f_val, f_tok = count + best, n_val[best], n_tok[best]
            f_out, f_row = out[src[best]], r0 + src[best]
            count += K * K
        return torch.stack([torch.cat(toks).double(), torch.cat(pars).double(), torch.cat(vals).double()])

    def stats(self) -> dict:
        return {**self.calls.stats(), "eager_passes": self.eager_passes}
