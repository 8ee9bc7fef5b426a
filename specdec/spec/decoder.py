"""Generation of one request on the target model, plain or speculative.

One step, in the notation of docs/algorithms.md:
    x_1..x_k  = proposer.propose(state, k)                      (k = 0: plain decoding)
    p_1..p_k+1 = target([last, x_1..x_k])                        (ONE forward pass)
    verdict   = verify(x, p, q)                                  (accepted drafts + recovered/bonus)
    KV cache rolled back to last + accepted drafts; emitted tokens checked for EOS/stop/max_tokens.
Plain decoding is the same loop with k = 0, so both share every line of stopping logic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.cache.kept_prefix import KeptPrefix
from specdec.model.cuda_graph import synchronize
from specdec.model.llama import prompt_pass
from specdec.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.penalties import apply_penalties, check_token_ids
from specdec.sampler import argmax, logprobs_of, make_generator, prompt_logprobs_of, sample, warp
from specdec.sampling_params import SamplingParams
from specdec.spec.adaptive import AdaptiveK, CostModel
from specdec.spec.metrics import SpecMetrics
from specdec.spec.proposer import EMPTY, Proposal, Proposer, RequestState, TargetOutput
from specdec.spec.rejection import Verdict, verify_greedy, verify_sampling


def _cut(proposal: Proposal, k: int) -> Proposal:
    """A proposal cut to k nodes: a chain's first tokens, a tree's first nodes (a parent before its children).
    Tree proposers build within k already; the cut keeps one that did not inside the context's room."""
    return proposal.first(k)


class RequestError(ValueError):
    """The request cannot be served as given (empty prompt, too long, ...)."""


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    metrics: SpecMetrics
    prefill_time: float
    decode_time: float
    logprobs: list[dict] | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0  # prompt tokens whose keys/values came from the kept prefix (not prefilled)
    prompt_logprobs: list[dict | None] | None = None  # per prompt token (None for the first), if asked

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.token_ids) - 1, 0)  # the first token comes from the prefill
        return n / self.decode_time if self.decode_time > 0 else 0.0

    def metrics_dict(self) -> dict:
        return {"prefill_time_s": round(self.prefill_time, 4), "cached_prompt_tokens": self.num_cached_tokens,
                "decode_time_s": round(self.decode_time, 4),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "target_forward_passes": self.metrics.target_passes + 1,
                "speculative": self.metrics.to_dict()}


@dataclass
class _Output:
    """Emission state of a request: tokens, text, stop checks."""

    params: SamplingParams
    eos_ids: frozenset[int]
    detok: IncrementalDetokenizer
    on_delta: Callable[[str, list[int]], None] | None
    max_total_tokens: int  # the context length: prompt + output never exceed it
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict] = field(default_factory=list)

    def emit(self, state: RequestState, tokens: list[int], logits: torch.Tensor | None) -> None:
        """Append tokens one at a time, stopping at the first finish condition inside the block."""
        p = self.params
        for j, tok in enumerate(tokens):
            state.output_ids.append(tok)
            if p.logprobs is not None and logits is not None:
                self.logprobs.extend(logprobs_of(logits[j:j + 1], [tok], p.logprobs))
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", (None if tok in self.eos_ids else tok)
                if self.on_delta:  # streams see the stop token, with no text
                    self.on_delta("", [tok])
                return
            delta = self.detok.add([tok])
            if p.stop and len(state.output_ids) > p.min_tokens and self._check_stop_strings(delta, [tok]):
                return
            if delta and self.on_delta:
                self.on_delta(delta, [tok])
            self.text += delta
            if len(state.output_ids) >= p.max_tokens or state.num_tokens >= self.max_total_tokens:
                self.finish_reason = "length"
                return

    def _check_stop_strings(self, delta: str, toks: list[int]) -> bool:
        """Whether a stop string ends inside delta (one wholly in the text before was there while min_tokens
        held the checks off: it does not count, nor cut text already streamed)."""
        text = self.text + delta
        for s in self.params.stop:
            idx = text.find(s, max(0, len(self.text) - len(s) + 1))
            if idx != -1:
                cut = text[:idx]
                if self.on_delta and len(cut) > len(self.text):
                    self.on_delta(cut[len(self.text):], toks)
                self.text, self.finish_reason, self.stop_reason = cut, "stop", s
                return True
        return False


class SpeculativeDecoder:
    def __init__(self, target, tokenizer: Tokenizer, proposer: Proposer | None = None,
                 spec_config=None, cost_model: CostModel | None = None, max_len: int | None = None,
                 prefix_caching: bool = False):
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.config = spec_config
        self.max_len = max_len or target.max_len
        self.k_max = spec_config.k_max if spec_config else 0
        self.cost = cost_model or CostModel(self.k_max + 1)
        self.last_adaptive: AdaptiveK | None = None  # the previous request's, the next one's priors
        # the previous request's KV cache, for a next prompt that shares its prefix (cache/kept_prefix.py);
        # off by default here (the bench times cold prompts), on in LLM
        self.prefix = KeptPrefix(target) if prefix_caching else None

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A RequestError for a prompt or token ids this decoder cannot take, before any work."""
        self._check_prompt(prompt_ids)
        try:
            check_token_ids(params, self.target.config.vocab_size, self.tokenizer.eos_token_ids)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_len}")
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")

    def _pick(self, logits: torch.Tensor, state: RequestState) -> int:
        """The next token from one row of logits [V] after the output so far (penalized if asked)."""
        params = state.params
        logits = apply_penalties(logits[None], params, state.prompt_ids, state.output_ids,
                                 eos_ids=self.tokenizer.eos_token_ids)[0]
        if params.greedy:
            return int(argmax(logits))
        return sample(warp(logits[None], params)[0], state.generator)

    def _cap(self, state: RequestState, cache_len: int) -> int:
        """The most tokens this step may draft: k_max, tokens left, context room."""
        remaining = state.params.max_tokens - len(state.output_ids)
        room = self.max_len - (cache_len + 1) - 1  # a step emits up to k + 1 tokens
        if self.proposer is None or remaining <= 1 or room <= 0:
            return 0
        return max(0, min(self.k_max, remaining - 1, room))

    def _propose(self, state: RequestState, adaptive: AdaptiveK | None, cap: int) -> Proposal:
        """This step's draft: the lookup's chain (free) or the model drafter's, whichever adaptive k
        expects to pay more, cut to its k; EMPTY for a plain step."""
        if cap <= 0:
            return EMPTY
        if adaptive is None:
            return _cut(self.proposer.propose(state, cap), cap)
        found = self.proposer.propose_lookup(state, cap)
        has_model = self.proposer.has_model_drafter
        rel = self.proposer.draft_cost_per_token / self.cost.seconds[1] if self.cost.seconds[1] else 0.0
        choice = adaptive.choose(rel, found.match_len, len(found), has_model)
        k = min(choice.k, cap)
        if k == 0:
            return EMPTY
        if choice.lookup:
            return _cut(found, k)
        return _cut(self.proposer.propose_model(state, k), k)

    def _verify(self, proposal: Proposal, logits: torch.Tensor, params: SamplingParams, gen,
                row_argmax: list[int] | None = None) -> Verdict:
        if params.greedy:
            return verify_greedy(proposal.tokens, row_argmax if row_argmax is not None else argmax(logits).tolist())
        p = warp(logits, params)  # [k+1, V]
        q = None if proposal.probs is None else proposal.probs
        return verify_sampling(proposal.tokens, p, q, gen)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_delta: Callable[[str, list[int]], None] | None = None) -> GenerationResult:
        self.check_request(prompt_ids, params)
        gen = None if params.greedy else make_generator(params.seed)
        state = RequestState(list(prompt_ids), params, gen)
        out = _Output(params, self.tokenizer.eos_token_ids, IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens), on_delta, self.max_len)
        metrics = SpecMetrics()
        adaptive = None
        if self.proposer is not None and not self.config.fixed_k and self.config.adaptive:
            if not self.cost.profiled:  # before this request's cache: a CUDA-graphed target has only one
                self.cost.profile(self.target)
            # a draft model starts from the previous request's estimates; a lookup drafter (no per-token
            # cost: a miss costs one verify column) and a learned head start fresh, as their acceptance
            # swings between requests (a translation copies its source, an answer on a document may not)
            carry = self.proposer.draft_cost_per_token > 0 and self.proposer.carries_estimates
            previous = self.last_adaptive if carry else None
            adaptive = AdaptiveK(self.k_max, self.cost, previous=previous, prior=self.proposer.acceptance_prior,
                                 tree_shares=self.proposer.tree_shares(), prompt_len=len(prompt_ids),
                                 position_weight=self.proposer.acceptance_position_weight,
                                 dynamic_tree_depth=self.proposer.dynamic_tree_depth)
            self.last_adaptive = adaptive

        capacity = min(self.max_len, len(prompt_ids) + params.max_tokens + self.k_max + 1)
        t0 = time.perf_counter()
        # prompt logprobs need every prompt position's hidden state: no kept prefix then
        reuse = self.prefix is not None and params.prompt_logprobs is None
        cache, cached = self.prefix.take(prompt_ids, capacity) if reuse else (None, 0)
        if cache is None:  # a fresh cache's allocation is not the prompt's time (a kept one's copy is)
            cache, t0 = self.target.new_cache(capacity), time.perf_counter()
        state.draft["target_cache"] = cache  # self-speculation (layerskip) drafts into the target's own cache
        n = len(prompt_ids)
        dev = self.target.device
        # the prompt after its cached prefix: rows cached..n-1 (the proposers read features of these rows
        # alone, as behind the serving engine's prefix cache)
        rows_per_pass = getattr(self.target, "prompt_rows_per_pass", None)
        res = prompt_pass(self.target, torch.tensor([prompt_ids[cached:]], device=dev), cached, cache,
                          self._feature_layers(), rows_per_pass() if rows_per_pass else None)
        logits = res.logits[0]  # [1, V]
        out.emit(state, [self._pick(logits[-1], state)], logits)
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + prompt_logprobs_of(self.target, res.hidden[0], prompt_ids, 0, params.prompt_logprobs)
        prefill_time = time.perf_counter() - t0
        if self.proposer is not None:
            self.proposer.begin(state, TargetOutput(res, list(range(n - cached))))
            self.proposer.take_catchup()  # not this request's (the serving engine's proposals never take it)
        try:
            while out.finish_reason is None:
                self._step(state, cache, out, metrics, adaptive)
        finally:
            if self.proposer is not None:
                self.proposer.end(state)
        decode_time = time.perf_counter() - t0 - prefill_time
        if self.prefix is not None:  # (not after an error: the cache may hold a half-written pass)
            self.prefix.keep(cache, state.token_ids, n)
        return GenerationResult(list(prompt_ids), state.output_ids, out.text, out.finish_reason, metrics,
                                prefill_time, decode_time, out.logprobs if params.logprobs is not None else None,
                                out.stop_reason, cached, prompt_lps)

    def _step_costs(self, propose_seconds: float, other_seconds: float) -> tuple[float, float]:
        """A step's (drafting, overhead) seconds as adaptive k prices them. A head's catch-up on the rows
        accepted since it last drafted is no drafted token's cost: the previous step's few rows are this
        step's overhead; a prompt's or a stretch of plain steps' (up to 128 rows) prices nothing, being the
        same whatever k is chosen now. (In a draft's time, the prompt's digest made an EAGLE-3 head's
        first step cost 12 ms a token against 1.5 ms after, and switched it off for 15 steps.)"""
        seconds, rows = self.proposer.take_catchup() if self.proposer is not None else (0.0, 0)
        if rows == 0:
            return propose_seconds, other_seconds
        steady = rows <= self.k_max + 1  # what one drafting step accepts at most
        return max(propose_seconds - seconds, 0.0), other_seconds + (seconds if steady else 0.0)

    def _feature_layers(self) -> tuple[int, ...]:
        return self.proposer.feature_layers if self.proposer is not None else ()

    def _step(self, state: RequestState, cache, out: _Output, metrics: SpecMetrics, adaptive) -> None:
        t0 = time.perf_counter()
        proposal = self._propose(state, adaptive, self._cap(state, cache.length))
        t1 = time.perf_counter()
        start = cache.length
        tokens = [state.token_ids[-1]] + proposal.tokens
        T = len(tokens)
        if proposal.is_tree:
            from specdec.spec.tree import tree_positions, tree_mask
            positions, block_mask = start + tree_positions(proposal.parents), tree_mask(proposal.parents)
        else:
            positions, block_mask = torch.arange(start, start + T), None
        dev = self.target.device
        ids = torch.tensor([tokens])  # [1, T]; on the host where the target takes them so (one copy a pass)
        if not getattr(self.target, "takes_host_inputs", False):
            ids, positions = ids.to(dev), positions.to(dev)
        fwd = self.target(ids, positions[None], cache, block_mask=block_mask, output_layers=self._feature_layers())
        raw = fwd.logits[0]  # [T, V]: row 0 predicts after the last token, row i after node i-1
        synchronize(dev)  # the verify time is the device's (verification reads the logits next anyway)
        t2 = time.perf_counter()
        # each row penalized after the output plus the drafts before it (what plain decoding would see)
        logits = apply_penalties(raw, state.params, state.prompt_ids, state.output_ids, proposal.tokens,
                                 proposal.parents, self.tokenizer.eos_token_ids)
        row_argmax = fwd.row_argmax if logits is raw else None
        if proposal.is_tree:
            from specdec.spec.tree import verify_tree
            verdict, rows = verify_tree(proposal, logits, state.params, state.generator, row_argmax)
            cache.keep([start + r for r in rows], start)  # the accepted path, packed after the prefix
        else:
            verdict = self._verify(proposal, logits, state.params, state.generator, row_argmax)
            rows = list(range(1 + verdict.num_accepted))
            cache.rollback(start + 1 + verdict.num_accepted)
        out.emit(state, verdict.tokens, raw[rows] if state.params.logprobs is not None else None)
        # a request that ended inside the block (EOS, a stop) holds fewer than 1 + num_accepted new tokens:
        # its drafter is not told of a step it will not take (as the engine, which finishes it first)
        if self.proposer is not None and out.finish_reason is None:
            self.proposer.on_verified(state, proposal, verdict.num_accepted, TargetOutput(fwd, rows))
        t3 = time.perf_counter()
        self.cost.observe(T, t2 - t1)
        if adaptive is not None:
            adaptive.update(len(proposal), verdict.num_accepted, proposal.match_len,
                            accepted_nodes=[r - 1 for r in rows[1:]] if proposal.is_tree else None)
            draft, other = self._step_costs(t1 - t0, t3 - t2)
            adaptive.observe_step(len(proposal), draft, other, model=not proposal.lookup)
        metrics.record(len(proposal), verdict.num_accepted, len(verdict.tokens), proposal.match_len, proposal.depth)
        metrics.draft_time += t1 - t0
        metrics.verify_time += t3 - t1
