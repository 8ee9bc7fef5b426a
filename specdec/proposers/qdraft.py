"""Quantized self-draft ("qdraft"): an int4 (or int8) copy of the target drafts for the full-precision
target. Same tokenizer, same architecture, nearly the same distribution, so acceptance is very high,
and the copy reads ~6x fewer weight bytes per token than fp32 (no training, no second model).

    LLM("smollm2-135m", speculative_config={"method": "qdraft"})
    LLM(..., speculative_config={"method": "qdraft", "extra": {"scheme": "int8", "group_size": 64}})
    LLM(..., speculative_config={"method": "qdraft", "model": "./smollm2-int4-awq"})  # from `specdec quantize`

Without `model`, the copy is made at start-up with RTN (extra: scheme int4|int8|fp8, group_size,
lm_head int8|int4|fp8|none); it shares the target's norms, rotary tables and embedding table. fp8
(e4m3 through torch._scaled_mm, specdec/quant/fp8.py) is for GPUs: on a CPU it is exact but slow.

Per request (state.draft):
    cache     the drafter's KV cache; invariant: it holds exactly token_ids[:cache.length]
    pending   (pre_len, fed): the cache held pre_len context tokens plus `fed` drafted ones
    seeded    positions [0, seeded) of the cache hold the TARGET's keys/values
Seeding: the target's cache is at hand as state.draft["target_cache"] (the single-request decoder's
static KVCache, or the sequence's blocks in the serving engine's paged pool) with the same layout
(the drafter is a copy of the target), so propose() copies the target's keys/values for every
context position the target has computed instead of recomputing them in int4: no draft prefill of
the prompt, no catch-up forward on accepted tokens. The drafter then conditions on the target's
cache, which only changes what it proposes; verification keeps the output exact.
In the serving engine (`propose_batch`, every target cache a sequence's blocks in one paged pool, one
row or many) the drafter needs no cache of its own at all: it reads the target's keys/values in place and writes its
drafted tokens' keys/values into the sequence's blocks at the positions the verify pass writes next
(the blocks are allocated for the draft, and the verify pass rewrites every layer there before its
attention reads them), and the rows of the decode batch draft together: one int4 forward over B rows
per draft step, instead of B one-row forwards (at 2 threads a 4-row step costs ~2x a 1-row one: 25 vs 13 ms).
Lazy catch-up (without a target cache, or another layout): propose() first feeds every context
token the drafter has not seen (the prompt on the first call, then the bonus/recovered token) in ONE
forward, then drafts k tokens one by one with
draft_model's `draft_chain` (argmax for greedy requests; sampling requests draw from q = warp(logits)
with the request's generator and return q, so verification is exact). After verification the cache
is rolled back to the accepted drafts, e.g. context [a b c], drafts [x y z] (x, y fed), 1 accepted
-> keep [a b c x].
"""
from __future__ import annotations

import time

import torch

from specdec.config import ConfigError
from specdec.proposers.chain import draft_chain, draft_chains, feed_tokens, time_one_step, within_context
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput, register_proposer

DEFAULTS = {"scheme": "int4", "group_size": 32, "lm_head": "int8"}


def build_drafter(ctx):
    """The quantized copy of ctx.target (or the quantized model ctx.config.model)."""
    from specdec.quant.qmodel import quantized_copy, scheme_named

    cfg = ctx.config
    unknown = sorted(set(cfg.extra) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"qdraft: unknown extra key(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    if cfg.model:
        if ctx.load_model is None:
            raise ConfigError("qdraft with 'model' needs a model loader (use LLM(...) or the CLI)")
        model, tok = ctx.load_model(cfg.model)[:2]
        if tok.get_vocab() != ctx.tokenizer.get_vocab() or model.config.vocab_size != ctx.target.config.vocab_size:
            raise ConfigError(f"qdraft model {cfg.model!r} has a different vocabulary than the target")
        # its layers read and write the target's keys/values (the engine's blocks, the seeded cache): the
        # same model quantized, not another one (that is draft_model)
        shape = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rope_theta", "rope_scaling", "max_position_embeddings", "layer_types", "sliding_window")
        differ = [k for k in shape if getattr(model.config, k) != getattr(ctx.target.config, k)]
        if differ:
            raise ConfigError(f"qdraft model {cfg.model!r} is not the target quantized: its {', '.join(differ)} "
                              "differ (a smaller or other model drafts as method draft_model)")
        return model
    from specdec.quant.qmodel import stored_as

    stored = stored_as(ctx.target.layers[0].qkv.weight)
    if stored not in (None, "bf16"):  # its quantized copy would be the target itself: no cheaper to run
        raise ConfigError(f"qdraft drafts with a quantized copy of the target, which is {stored} already; "
                          "serve the full-precision model, or name a quantized drafter with 'model'")
    opts = {**DEFAULTS, **cfg.extra}
    scheme = scheme_named(str(opts["scheme"]), int(opts["group_size"]))
    head = None if opts["lm_head"] == "none" else scheme_named(str(opts["lm_head"]), 32)
    return quantized_copy(ctx.target, scheme, head)


@register_proposer("qdraft")
class QDraftProposer(Proposer):
    # a copy of the target itself: acceptance 0.89-0.96 per category at int4-g32 (run S8); from the generic
    # prior (0.6) a single request spent its first ~10 steps at k = 1-2 before the estimate caught up
    acceptance_prior = 0.9

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = build_drafter(ctx)
        self.threshold = ctx.config.draft_confidence_threshold
        self.draft_cost_per_token = time_one_step(self.model)

    def _own_cache(self, state: RequestState):
        """The request's draft cache, made on first use (the batched engine path never needs one)."""
        if "cache" not in state.draft:
            cap = len(state.prompt_ids) + state.params.max_tokens + self.ctx.config.k_max + 1
            state.draft["cache"] = self.model.new_cache(min(cap, self.model.max_len))
        return state.draft["cache"]

    def _forward(self, cache, tokens: list[int]) -> torch.Tensor:
        """Feed tokens at the next positions of the draft cache; logits [V] after the last one."""
        return feed_tokens(self.model, cache, tokens)

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> Proposal:
        cache = self._own_cache(state)
        ids = state.token_ids
        k = within_context(k, cache.max_len, len(ids))
        if k <= 0:
            return EMPTY  # the drafter's context is full: the target goes on alone
        t0 = time.perf_counter()
        if cache.length >= len(ids):  # never expected; keep the invariant (the last token is fed)
            cache.rollback(len(ids) - 1)
        self._seed(state, cache)
        pre_len, behind = len(ids), len(ids) - cache.length
        logits = self._forward(cache, ids[cache.length:])  # lazy catch-up, one forward
        if behind > 2:  # a prompt's prefill is not a per-token drafting cost
            t0 = time.perf_counter()
        proposal = draft_chain(logits, lambda tok: self._forward(cache, [tok]), state, k, self.threshold)
        state.draft["pending"] = (pre_len, cache.length - pre_len)
        per_token = (time.perf_counter() - t0) / len(proposal.tokens)
        self.observe_draft_cost(per_token)
        return proposal

    @torch.inference_mode()
    def propose_batch(self, states: list[RequestState], ks: list[int], trees: bool = False) -> list[Proposal]:
        """All rows at once when every target cache is a sequence's blocks in one paged pool (see above)."""
        from specdec.cache.paged_cache import BatchKV, SeqKV
        kvs = [s.draft.get("target_cache") for s in states]
        if not states or any(type(kv) is not SeqKV or kv.pool is not kvs[0].pool for kv in kvs):
            return super().propose_batch(states, ks)
        t0 = time.perf_counter()
        pool = kvs[0].pool
        # row b's next position; the target has computed [0, len(ids) - 1), the last token is fed here
        next_pos = [len(s.token_ids) - 1 for s in states]

        def step(rows: list[int], tokens: list[int]) -> torch.Tensor:
            past = [next_pos[b] for b in rows]
            kv = BatchKV(pool, [kvs[b].block_table for b in rows], past, [1] * len(rows))
            out = self.model(torch.tensor(tokens)[:, None], torch.tensor(past)[:, None], kv, num_logits=1)
            for b in rows:
                next_pos[b] += 1
            return out.logits[:, -1]  # [len(rows), V]

        live = [b for b, k in enumerate(ks) if k > 0]
        if not live:
            return [EMPTY] * len(states)
        logits = step(live, [states[b].token_ids[-1] for b in live])
        drafted = draft_chains(logits, lambda rows, toks: step([live[i] for i in rows], toks),
                               [states[b] for b in live], [ks[b] for b in live], self.threshold)
        proposals = [EMPTY] * len(states)
        for b, p in zip(live, drafted):
            proposals[b] = p
        n = sum(len(p.tokens) for p in drafted)
        if n:
            self.observe_draft_cost((time.perf_counter() - t0) / n)
        return proposals

    @staticmethod
    def _seed(state: RequestState, cache) -> None:
        """Copy the target's keys/values for context positions the target has computed (see above)."""
        from specdec.cache.kv_cache import KVCache
        target = state.draft.get("target_cache")
        if type(cache) is not KVCache or target is None:
            return
        n = min(target.length, len(state.token_ids) - 1, cache.max_len)  # the last token is fed, not copied
        start = min(state.draft.get("seeded", 0), cache.length, n)
        if n > start:
            kv = _target_kv(target, start, n)  # [L, Hkv, n - start, D] each, or None
            if kv is None or kv[0].shape != cache.k[:, 0, :, start:n].shape or kv[0].dtype != cache.k.dtype:
                return
            cache.k[:, 0, :, start:n] = kv[0]
            cache.v[:, 0, :, start:n] = kv[1]
        cache.length = n  # then propose() feeds ids[n:] (the last token) itself
        state.draft["seeded"] = n

    def on_verified(self, state: RequestState, proposal: Proposal, num_accepted: int,
                    target: TargetOutput | None = None) -> None:
        pending = state.draft.pop("pending", None)
        if pending is not None:  # a proposal of the own-cache path
            pre_len, fed = pending
            state.draft["cache"].rollback(pre_len + min(num_accepted, fed))


def _target_kv(target, start: int, end: int):
    """The target's keys and values of positions [start, end), [L, Hkv, end - start, D] each, from the
    single-request static cache or from a sequence's blocks in the serving engine's paged pool
    (then the drafter needs no catch-up forward over the prompt there either); None for others."""
    from specdec.cache.kv_cache import KVCache
    from specdec.cache.paged_cache import SeqKV
    if type(target) is KVCache and target.k.shape[1] == 1:
        return target.k[:, 0, :, start:end], target.v[:, 0, :, start:end]
    if type(target) is SeqKV:
        slots = target.pool.slots(target.block_table, start, end)
        return target.pool.k[:, slots].transpose(1, 2), target.pool.v[:, slots].transpose(1, 2)
    return None
