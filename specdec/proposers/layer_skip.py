"""Self-speculation by layer skipping (Draft&Verify 2023; SWIFT 2024): the draft is the target itself
with a subset of its decoder layers, sharing the weights AND the request's KV cache (no extra memory).

Drafting into the target's cache: at propose() time the cache holds token_ids[:-1] (length L0; the
last token enters with the next target pass). Draft step j feeds one token at position L0 + j through
the kept layers only, writing their k/v at slot L0 + j (skipped layers' slots stay stale and are
never read by the draft). Before returning the proposal the cache is rolled back to L0, so the verify
pass over [last, x_1..x_k] overwrites every layer at those slots. The decoder lends the cache as
state.draft["target_cache"].

Which layers to skip: `skip_layers` from the config, else a search on a few calibration prompts
(SWIFT-style: pick the set that maximises expected speedup = f(acceptance, draft cost)), cached per
model in memory and on disk. The objective is measured exactly and cheaply by a teacher-forced
probe: after one full pass over a calibration sequence, ONE pass of the kept layers over the same
tokens, where token i sees the full model's k/v of tokens < i and its own (probe mask), gives the
draft's first-token prediction at every position; agreement with the full model's argmax is the
greedy acceptance of draft position 1. Search (about 3 + 4 * swaps probe passes per prompt, not SWIFT's
Bayesian optimisation): rank layers by block influence (ShortGPT: 1 - cos(input, output), free from the
full pass), try skipping the m least influential for m = L/4, 3L/8, L/2, keep the best expected
speedup, then hill-climb by swapping a skipped and a kept layer while agreement improves. Unlike SWIFT
the set is fixed per model, not re-optimised on the fly per request.
"""
from __future__ import annotations

import hashlib
import json
import time

import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import ConfigError
from specdec.proposers.chain import draft_chain, feed_tokens, time_one_step
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, register_proposer

SEARCH_VERSION = "1"
CALIBRATION_PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
)
SKIP_FRACTIONS = (0.25, 0.375, 0.5)  # of the layers; SWIFT skips about half
VERIFY_SLOPE = 0.13  # c_verify(T) / c_1 ~ 1 + slope * (T - 1) (docs/algorithms.md: fp32 CPU, c(8)/c(1) = 1.9)
_MEMO: dict[str, tuple[int, ...]] = {}


class _ProbeCache(KVCache):
    """A cache of n tokens whose next block re-feeds the last T of them with the probe mask: new row i
    (position n - T + i) sees the cached positions before it and itself, e.g. n = 4, T = 2:
        cached 0 1 2 3 | new 2 3
        row 0: x x . . | x .
        row 1: x x x . | . x
    """

    probe = False

    def attention_mask(self, block_mask, num_new):
        if not self.probe:
            return super().attention_mask(block_mask, num_new)
        n, dev = self.length, self.k.device
        prefix = torch.ones(num_new, n, dtype=torch.bool, device=dev).tril(n - num_new - 1)
        return torch.cat((prefix, torch.eye(num_new, dtype=torch.bool, device=dev)), dim=1)


class LayerProbe:
    """One calibration sequence: its full-model KV cache, the full model's argmax at the last `scored`
    positions (<= 32 rows: a probe pass streams the weights once, like a decode step), and each
    layer's block influence there (ShortGPT: 1 - cos(layer input, layer output))."""

    @torch.inference_mode()
    def __init__(self, target, ids: list[int], scored: int = 16):
        n, cfg = len(ids), target.config
        L, self.scored = cfg.num_hidden_layers, min(scored, n)
        dev = target.device
        self.cache = _ProbeCache(L, 1, cfg.num_key_value_heads, cfg.head_dim, n + self.scored, target.dtype, dev)
        ids_t = torch.tensor([ids], device=dev)
        out = target(ids_t, torch.arange(n, device=dev)[None], self.cache, output_layers=tuple(range(L)))
        tail = slice(n - self.scored, n)
        self.ref = out.logits[0, tail].argmax(-1)  # [scored]
        h = [target.embed_tokens(ids_t)[0, tail]] + [out.layer_hidden[i][0, tail] for i in range(L)]
        self.influence = [float((1 - torch.cosine_similarity(h[i], h[i + 1], dim=-1)).mean()) for i in range(L)]
        self.ids, self.positions = ids_t[:, tail], torch.arange(n, device=dev)[None, tail]
        self.target, self.n = target, n
        self.cache.probe = True

    def agreement(self, layers: list[int]) -> float:
        """Fraction of scored positions where the kept layers' first draft token equals the full model's."""
        out = self.target(self.ids, self.positions, self.cache, layers=layers)
        self.cache.rollback(self.n)
        return float((out.logits[0].argmax(-1) == self.ref).float().mean())


def draft_cost(cfg, kept: int) -> float:
    """A drafted token's cost relative to a full one-token target pass (weights streamed)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    head = cfg.vocab_size * h
    return (kept * layer + head) / (cfg.num_hidden_layers * layer + head)


def expected_speedup(acceptance: float, cost: float, k_max: int = 8) -> float:
    a = min(max(acceptance, 0.0), 0.99)
    return max((1 - a ** (k + 1)) / (1 - a) / (1 + VERIFY_SLOPE * k + k * cost) for k in range(1, k_max + 1))


@torch.inference_mode()
def calibration_sequences(target, tokenizer, gen_tokens: int = 24) -> list[list[int]]:
    """Each calibration prompt followed by the target's greedy continuation."""
    seqs = []
    for text in CALIBRATION_PROMPTS:
        chat = bool(tokenizer.chat_template)
        ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)
        cache = target.new_cache(len(ids) + gen_tokens)
        dev = target.device
        logits = target(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache,
                        num_logits=1).logits[0, -1]
        for _ in range(gen_tokens):
            ids.append(int(logits.argmax()))
            if len(ids) < cache.max_len:
                logits = target(torch.tensor([[ids[-1]]], device=dev), torch.tensor([[len(ids) - 1]], device=dev),
                                cache).logits[0, -1]
        seqs.append(ids)
    return seqs


@torch.inference_mode()
def search_skip_layers(target, tokenizer, swaps: int = 3) -> tuple[int, ...]:
    """The skipped set maximising expected speedup on the calibration prompts (see module doc)."""
    cfg = target.config
    L = cfg.num_hidden_layers
    if L < 2:
        raise ConfigError("layerskip needs a target of at least 2 layers (one to skip, one to keep)")
    probes = [LayerProbe(target, ids) for ids in calibration_sequences(target, tokenizer)]
    influence = [sum(p.influence[i] for p in probes) for i in range(L)]
    order = sorted(range(L), key=lambda i: (influence[i], i))  # least influential first

    def agreement(skip: set[int]) -> float:
        layers = [i for i in range(L) if i not in skip]
        return sum(p.agreement(layers) for p in probes) / len(probes)

    best, best_a, best_score = set(order[:1]), 0.0, -1.0
    for m in sorted({min(max(round(f * L), 1), L - 1) for f in SKIP_FRACTIONS}):
        a = agreement(set(order[:m]))
        score = expected_speedup(a, draft_cost(cfg, L - m))
        if score > best_score:
            best, best_a, best_score = set(order[:m]), a, score
    # hill climbing at the chosen size: swap a skipped layer for a kept one while agreement improves
    for _ in range(swaps):
        skipped = sorted(best, key=lambda i: -influence[i])[:2]
        kept = [i for i in order if i not in best][:2]
        trials = [(agreement(best - {i} | {j}), i, j) for i in skipped for j in kept]
        a, i, j = max(trials)
        if a <= best_a:
            break
        best, best_a = best - {i} | {j}, a
    return tuple(sorted(best))


def _model_key(ctx) -> str | None:
    if ctx.target_dir is None:
        return None
    d = ctx.target_dir.resolve()
    parts = [str(d), (d / "config.json").read_text(), str(ctx.dtype), SEARCH_VERSION]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(d.glob("*.safetensors"))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def skip_layers_for(ctx) -> tuple[int, ...]:
    """The configured set, else the searched one (memoised per model, in memory and on disk)."""
    from specdec.model.loader import cache_root

    L = ctx.target.config.num_hidden_layers
    if ctx.config.skip_layers is not None:
        skip = tuple(sorted(set(ctx.config.skip_layers)))
        if not skip or skip[0] < 0 or skip[-1] >= L or len(skip) >= L:
            raise ConfigError(f"skip_layers must be a non-empty proper subset of 0..{L - 1}, got {list(skip)}")
        return skip
    key = _model_key(ctx) or f"id{id(ctx.target)}"
    if key in _MEMO:
        return _MEMO[key]
    path = cache_root() / "layerskip" / f"{key}.json"
    if path.exists():
        skip = tuple(json.loads(path.read_text())["skip_layers"])
    else:
        skip = search_skip_layers(ctx.target, ctx.tokenizer)
        if not key.startswith("id"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"skip_layers": list(skip), "model": str(ctx.target_dir)}))
    _MEMO[key] = skip
    return skip


@register_proposer("layerskip")
class LayerSkipProposer(Proposer):

    def __init__(self, ctx):
        super().__init__(ctx)
        self.skip = skip_layers_for(ctx)
        L = ctx.target.config.num_hidden_layers
        self.layers = [i for i in range(L) if i not in self.skip]
        self.threshold = ctx.config.draft_confidence_threshold
        self.draft_cost_per_token = time_one_step(ctx.target, self.layers)

    def _forward(self, cache, tok: int) -> torch.Tensor:
        return feed_tokens(self.ctx.target, cache, [tok], self.layers)  # [V]

    @torch.inference_mode()
    def propose(self, state: RequestState, k: int) -> Proposal:
        cache = state.draft.get("target_cache")
        if cache is None:
            raise RuntimeError("layerskip needs the decoder to lend the target cache (state.draft['target_cache'])")
        start = cache.length  # == len(token_ids) - 1: the last token is not in the cache yet
        if start + k > cache.max_len:
            return EMPTY
        t0 = time.perf_counter()
        try:
            logits = self._forward(cache, state.token_ids[-1])
            proposal = draft_chain(logits, lambda tok: self._forward(cache, tok), state, k, self.threshold)
        finally:
            cache.rollback(start)  # the verify pass rewrites every layer at these slots
        per_token = (time.perf_counter() - t0) / max(len(proposal.tokens), 1)
        self.observe_draft_cost(per_token)
        return proposal
