"""The serving engine: requests in, per-step outputs out; one step is schedule -> forward -> verify -> emit.

    llm = LLM("smollm2-135m", speculative_config={"method": "ngram"})
    engine = Engine(llm, EngineConfig(max_num_seqs=8))
    engine.add_request(EngineRequest("r1", llm.tokenizer.encode("Hello"), SamplingParams(max_tokens=32)))
    while engine.has_unfinished():
        for out in engine.step(): print(out.text, end="")

Greedy outputs equal single-request plain decoding (`LLM.generate`) token for token; sampled outputs
follow the target's distribution (the verification is specdec.spec.rejection's, per row). A row whose
verification raises (a request whose masks leave no token to sample) ends its request alone: one output
with `error` set, its blocks freed; the other rows of the step go on.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace

import torch

from specdec.cache.kv_cache import kv_dtype
from specdec.cache.paged_cache import PagedKVPool
from specdec.config import ConfigError
from specdec.engine.block_manager import BlockManager
from specdec.engine.config import EngineConfig
from specdec.engine.grammar import GrammarState
from specdec.engine.model_runner import ModelRunner, Row, pack_rows
from specdec.engine.request import EngineRequest, EngineStats, SeqOutput
from specdec.engine.scheduler import Scheduler, SchedulerConfig
from specdec.engine.sequence import Sequence, SpecChoice
from specdec.engine.speculation import Speculation, profile_sizes, verify_rows
from specdec.model.cuda_graph import GraphedModel
from specdec.model.llama import ForwardOutput
from specdec.penalties import apply_penalties, check_token_ids
from specdec.quant.bf16 import exact_prompt_passes
from specdec.sampler import argmax, make_generator, prompt_logprobs_of, sample, warp
from specdec.spec.adaptive import PRIOR_ACCEPTANCE, AdaptiveK
from specdec.spec.metrics import SpecMetrics
from specdec.spec.proposer import TargetOutput
from specdec.spec.rejection import Verdict, verify_greedy
from specdec.spec.tree import verify_tree

log = logging.getLogger("specdec.engine")


def _choice(proposer, k: int | None = None) -> SpecChoice:
    """k from the request, else the proposer's config (fixed num_speculative_tokens, or adaptive up to k_max);
    a ConfigError for a k the proposer's learned head cannot draft in a step (it was cut silently)."""
    cfg = proposer.ctx.config
    if k is not None:
        cfg.check_step_k(k)
    return SpecChoice(proposer, k or cfg.k_max, k is not None or cfg.fixed_k or not cfg.adaptive)


def _adaptive(spec: SpecChoice) -> AdaptiveK:
    """A row's acceptance estimate, starting from its proposer's prior (K itself is the batch's choice)."""
    if spec.proposer is None:
        return AdaptiveK(0, None, prior=PRIOR_ACCEPTANCE)
    return AdaptiveK(0, None, prior=spec.proposer.acceptance_prior,
                     position_weight=spec.proposer.acceptance_position_weight)


class Engine:
    def __init__(self, llm, config: EngineConfig = EngineConfig()):
        if isinstance(llm.model, GraphedModel):  # one owned cache, one request at a time: not a batch's
            raise ConfigError("the serving engine runs its batches eagerly: build its LLM with enforce_eager=True")
        self.llm, self.config = llm, config
        self.model, self.tokenizer = llm.model, llm.tokenizer
        # chunked prefill and the prefix cache cut prompts anywhere: a prompt's bits must not depend on it
        # (on an AMX CPU without the tiles, oneDNN's bf16 GEMM would make them; exact beats fast)
        exact_prompt_passes(self.model)
        self.max_model_len = self.model.max_len
        # held while a step runs the target: a step from another thread waits (two passes at once shared the
        # kernels' per-layer descriptions, their cache pointers, and thread pool: one could write into the
        # other's cache)
        self.passes = threading.Lock()
        self.spec = Speculation(llm, llm.speculative_config)
        self.default_spec = _choice(llm.proposer) if llm.proposer is not None else SpecChoice()
        self.request_proposers = {m: self._build_request_method(m) for m in config.request_methods}
        if llm.proposer is not None:
            self.request_proposers[llm.proposer.name] = llm.proposer
        num_blocks = self._num_blocks(config)
        if num_blocks * config.block_size < self.max_model_len + 1:
            raise ConfigError(f"{num_blocks} KV blocks of {config.block_size} cannot hold one sequence of "
                              f"max_model_len {self.max_model_len}; raise the KV memory or lower --max-model-len")
        # (prompt passes on the decode passes' kernels: a generated token's keys/values are a prompt pass's too)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                   cache_generated=getattr(self.model, "prefill_matmul_dtype", None) is None)
        self.pool = PagedKVPool.for_model(self.model.config, num_blocks, config.block_size, kv_dtype(self.model))
        self.runner = ModelRunner(self.model, self.pool)
        self.spec.pool = self.pool
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.blocks, self.spec)
        self.seqs: dict[str, list[Sequence]] = {}
        self.totals = SpecMetrics()
        self.last_k = 0  # the longest draft of the last decode batch
        self._ids = itertools.count()
        if config.profile_cost:  # also without a default proposer: requests may ask for one
            self.spec.cost.profile(self.model, profile_sizes(config.max_num_seqs))

    def _build_request_method(self, method: str):
        try:
            return self.spec.proposer(method)
        except ConfigError as e:
            raise ConfigError(f"request method {method!r} (--request-speculative-methods): {e}") from None

    def drafter_bytes_per_block(self, block_size: int) -> int:
        """What the drafters keep in each KV block (a draft model's keys/values), once per proposer."""
        return sum(p.kv_bytes_per_block(block_size) for p in set(self.request_proposers.values()))

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = PagedKVPool.bytes_per_block(self.model.config, config.block_size, kv_dtype(self.model))
        per_block += self.drafter_bytes_per_block(config.block_size)
        by_memory = int(config.kv_cache_memory_gb * 2**30 // per_block)
        by_use = config.max_num_seqs * -(-(self.max_model_len + 64) // config.block_size)
        return max(1, min(by_memory, by_use))

    # --- requests -------------------------------------------------------------------------------
    def resolve_spec(self, speculative: dict | None) -> SpecChoice:
        """A request's speculation: the server default (None, or no "method": at the dict's
        num_speculative_tokens), off ({"method": None}), or one of the methods built for requests
        (EngineConfig.request_methods); another method is a ConfigError, and nothing is built."""
        if speculative is None or not speculative.keys() & {"method", "num_speculative_tokens"}:
            return self.default_spec
        enabled = ", ".join(["off", *self.request_proposers])
        if "method" not in speculative:
            if self.llm.proposer is None:
                raise ConfigError(f"this server has no speculative method of its own: name one (enabled: {enabled})")
            return _choice(self.llm.proposer, speculative.get("num_speculative_tokens"))
        method = speculative["method"]
        if method is None:
            return SpecChoice()
        proposer = self.request_proposers.get(method)
        if proposer is None:
            raise ConfigError(f"speculative method {method!r} is not enabled on this server (enabled: {enabled}; "
                              "the server's --request-speculative-methods lists the ones requests may pick)")
        return _choice(proposer, speculative.get("num_speculative_tokens"))

    def add_request(self, req: EngineRequest) -> None:
        p = req.params
        if req.request_id in self.seqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_ids or len(req.prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt must have 1 to {self.max_model_len - 1} tokens")
        check_token_ids(p, self.model.config.vocab_size, self.tokenizer.eos_token_ids)
        spec = self.resolve_spec(req.speculative)
        arrival = req.arrival_time if req.arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(p.n):
            params = p if p.n == 1 or p.seed is None else replace(p, seed=p.seed + i, n=1)  # (sample i alone)
            gen = None if params.greedy else make_generator(params.seed)
            grammar = GrammarState(req.grammar, req.grammar.initial()) if req.grammar is not None else None
            seqs.append(Sequence.create(next(self._ids), req.request_id, i, req.prompt_ids, params, self.tokenizer,
                                        gen, self.max_model_len, spec=spec, cache_salt=req.cache_salt,
                                        grammar=grammar, adaptive=_adaptive(spec), arrival_time=arrival))
        self.seqs[req.request_id] = seqs
        for s in seqs:
            if p.prompt_logprobs is not None:
                s.prompt_logprobs = [None]
            self.scheduler.add(s)

    def abort(self, request_id: str) -> list[SeqOutput]:
        outs = []
        for seq in self.seqs.pop(request_id, []):
            if not seq.finished:
                seq.aborted = True
                self._finish(seq)
                outs.append(self._collect(seq))
        return outs

    def _fail(self, request_id: str, status: int, message: str) -> SeqOutput:
        """Abort a request whose row raised: one finished output carrying the error."""
        self.abort(request_id)
        return SeqOutput(request_id, 0, "", [], None, [], finished=True, finish_reason="error", error=message,
                         error_status=status)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        with self.passes:
            return self._step()

    def _step(self) -> list[SeqOutput]:
        t_step = time.perf_counter()
        self.spec.propose_seconds = 0.0
        batch = self.scheduler.schedule()
        touched: list[Sequence] = []
        # prompt chunks and recomputed outputs apart: a prompt's pass may run its matmuls in bf16
        prompts = [r for r in batch.prefill if r.in_prompt]
        recomputed = [r for r in batch.prefill if not r.in_prompt]
        forwards = [(rows, False) for rows in pack_rows(prompts) + pack_rows(recomputed)]
        if batch.decode:
            forwards.append((batch.decode, True))
        decode_forward = 0.0
        failed: dict[str, tuple[int, str]] = {}  # request id -> (status, what one of its rows raised): it alone ends
        for rows, decode in forwards:
            t0 = time.perf_counter()
            fwd = self.runner.run(rows, all_logits=decode, output_layers=self._feature_layers(rows, decode))
            if decode:
                decode_forward = time.perf_counter() - t0
                padded = len(rows) * max(len(r) for r in rows)
                self.spec.cost.observe(sum(map(len, rows)) if fwd.packed else padded, decode_forward)
                self.last_k = max(len(r.proposal) for r in rows)
            # every greedy row's argmax in one call (per row it was ~0.1 ms each, 1.7 ms of a 16-row step)
            best = argmax(fwd.logits).tolist() if any(r.seq.params.greedy for r in rows) else None  # [B, T']
            for b, r in enumerate(rows):
                if r.seq.request_id in failed:
                    continue
                try:
                    row_best = None if best is None else best[b]
                    emitted = self._process(r, self.runner.row_output(fwd, b, len(r)), row_best)
                except Exception as e:  # noqa: BLE001 - one request's failure must not end the batch's others
                    log.exception("request %s failed; aborting it", r.seq.request_id)
                    failed[r.seq.request_id] = (400 if isinstance(e, ValueError) else 500, f"{type(e).__name__}: {e}")
                    continue
                if emitted:
                    touched.append(r.seq)
        outs = [self._collect(s) for s in touched if s.request_id not in failed]
        outs += [self._fail(request_id, *failure) for request_id, failure in failed.items()]
        if batch.decode and not batch.prefill:  # a pure decode step: what drafting costs besides the pass
            self.spec.observe_overhead(len(batch.decode), self.last_k > 0,
                                       time.perf_counter() - t_step - decode_forward - self.spec.propose_seconds)
        for s in touched:
            if s.finished:
                reqs = self.seqs.get(s.request_id, [])
                if all(x.finished for x in reqs):
                    self.seqs.pop(s.request_id, None)
        return outs

    def _feature_layers(self, rows: list[Row], decode: bool) -> tuple[int, ...]:
        """The target layers whose hidden states the rows' proposers read from this pass: none for a
        decode pass while the adaptive rows' drafters rest, unless a row begins in it (a prompt whose last
        token chunked prefill left alone: its proposer starts from this pass) or drafts whatever the batch's K
        (a fixed num_speculative_tokens)."""
        resting = [r.seq.spec.proposer is None or (r.seq.begun and not (r.seq.spec.fixed_k
                                                                        and r.seq.spec.proposer.feature_layers))
                   for r in rows]
        if decode and self.spec.resting() and all(resting):
            return ()
        layers = set()
        for r in rows:
            if r.seq.spec.proposer is not None:
                layers.update(r.seq.spec.proposer.feature_layers)
        return tuple(sorted(layers))

    def _process(self, row: Row, out: ForwardOutput, best: list[int] | None = None) -> bool:
        """Apply one row's forward output; True when the sequence emitted tokens. best: the argmax of
        the forward's logits along this row ([T'], its last columns this row's; None: not computed)."""
        seq, n, proposal = row.seq, row.num_new, row.proposal
        if seq.prompt_logprobs is not None:
            self._prompt_logprobs(seq, n, out.hidden)
        if not row.samples:
            seq.num_computed += n
            if seq.spec.proposer is not None and not seq.begun:
                seq.prefill_parts.append(out)
            self.blocks.commit(seq)
            return False
        k = len(proposal)
        logits = out.logits[0, -(k + 1):]  # [k+1, V]: row i predicts the token after input i
        if seq.grammar is not None:
            logits = logits.masked_fill(~seq.grammar.row_masks(proposal.tokens), float("-inf"))
        reported = logits  # logprobs: before penalties (vLLM's raw logprobs)
        # each row penalized after the output plus the drafts before it (what plain decoding would see)
        logits = apply_penalties(logits, seq.params, seq.prompt_ids, seq.output_ids, proposal.tokens,
                                 proposal.parents, eos_ids=self.tokenizer.eos_token_ids)
        fast = best is not None and seq.params.greedy and seq.grammar is None and not seq.params.adjusts_logits
        rows = None  # the pass's rows now in the sequence (row 0: the newest token fed), where not the first ones
        if proposal.is_tree:
            verdict, rows = verify_tree(proposal, logits, seq.params, seq.state.generator,
                                        best[-(k + 1):] if fast else None)
            start = seq.num_computed + n - 1  # row 0's position: the accepted path, packed from there
            self.pool.keep(seq.block_table, [start + r for r in rows], start)
        elif fast:
            verdict = verify_greedy(proposal.tokens, best[-(k + 1):])
        elif k or proposal.cut_probs is not None:
            verdict = verify_rows(proposal, logits, seq.params, seq.state.generator)
        else:
            verdict = Verdict(0, [self._pick(logits[-1], seq)])
        rows = rows or list(range(1 + verdict.num_accepted))
        masked = seq.grammar is not None or seq.params.adjusts_logits
        if masked and logits[rows[-1], verdict.tokens[-1]] == float("-inf"):  # greedy: argmax of all -inf
            raise ValueError("no token can be sampled: the grammar, allowed_token_ids and min_tokens leave none")
        first = not seq.output_ids
        seq.num_computed += n + verdict.num_accepted
        seq.token_from_draft.extend(j < verdict.num_accepted for j in range(len(verdict.tokens)))
        seq.out.emit(seq.state, verdict.tokens, reported[rows] if seq.params.logprobs is not None else None)
        del seq.token_from_draft[len(seq.output_ids):]
        if seq.grammar is not None:
            seq.grammar.advance(verdict.tokens)
        if first:
            seq.first_token_time = time.monotonic()
        elif seq.begun:
            for metrics in (seq.metrics, self.totals):
                metrics.record(k, verdict.num_accepted, len(verdict.tokens), proposal.match_len, proposal.depth)
            seq.adaptive.update(k, verdict.num_accepted, proposal.match_len)  # a lookup's chains: by match length
        if seq.out.finish_reason is not None:
            self._finish(seq)
            return True
        self._proposer_hooks(seq, out, proposal, verdict, first, n, rows)
        self.blocks.trim(seq, seq.num_computed)
        self.blocks.commit(seq)
        return True

    @torch.inference_mode()
    def _prompt_logprobs(self, seq: Sequence, n: int, hidden: torch.Tensor) -> None:
        """The prompt tokens' logprobs from a pass over seq's positions num_computed.. (hidden [1, n, H]),
        in order and once (a preempted sequence recomputes positions it has covered)."""
        lps, start = seq.prompt_logprobs, seq.num_computed
        first, stop = len(lps) - 1, min(start + n, len(seq.prompt_ids) - 1)  # positions predicting prompt tokens
        if start <= first < stop:
            lps += prompt_logprobs_of(self.model, hidden[0, first - start:stop - start], seq.prompt_ids, first,
                                      seq.params.prompt_logprobs)

    def _pick(self, logits: torch.Tensor, seq: Sequence) -> int:
        """logits [V]: penalized already (_process)."""
        if seq.params.greedy:
            return int(argmax(logits))
        return sample(warp(logits[None], seq.params)[0], seq.state.generator)

    def _proposer_hooks(self, seq: Sequence, out: ForwardOutput, proposal, verdict: Verdict, first: bool,
                        n: int, rows: list[int]) -> None:
        proposer = seq.spec.proposer
        if proposer is None:
            return
        if not seq.begun:
            parts = seq.prefill_parts + [out]
            layers = None if out.layer_hidden is None else {
                l: torch.cat([p.layer_hidden[l] for p in parts], dim=1) for l in out.layer_hidden}
            prefill = ForwardOutput(out.logits, torch.cat([p.hidden for p in parts], dim=1), layers)
            seq.prefill_parts.clear()
            proposer.begin(seq.state, TargetOutput(prefill, list(range(prefill.hidden.shape[1]))))
            seq.begun = True
            return
        # row 0 of what the proposer sees is the newest token fed this step (as in a single-request pass)
        tail = ForwardOutput(out.logits, out.hidden[:, n - 1:],
                             None if out.layer_hidden is None else {l: h[:, n - 1:] for l, h in out.layer_hidden.items()})
        proposer.on_verified(seq.state, proposal, verdict.num_accepted, TargetOutput(tail, rows))

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.monotonic()
        if seq.begun and seq.spec.proposer is not None:
            seq.spec.proposer.end(seq.state)
        seq.prefill_parts.clear()
        self.scheduler.remove(seq)

    # --- outputs --------------------------------------------------------------------------------
    def _collect(self, seq: Sequence) -> SeqOutput:
        text = seq.out.text
        end = len(text)
        if not seq.finished and seq.params.stop:  # a stop string may still start in the tail
            end = max(seq.sent_text, end - (max(len(s) for s in seq.params.stop) - 1))
        start, seq.sent_text = seq.sent_text, end
        toks = seq.output_ids[seq.sent_tokens:]
        lps = seq.out.logprobs[seq.sent_tokens:] if seq.params.logprobs is not None else None
        first = seq.sent_tokens == 0 and bool(toks)  # the choice's first tokens: its prompt logprobs go with them
        seq.sent_tokens = len(seq.output_ids)
        out = SeqOutput(seq.request_id, seq.index, text[start:end], toks, lps, seq.text_pieces(start, end),
                        method=seq.spec.method, drafter_error=seq.spec.drafter_error,
                        prompt_logprobs=seq.prompt_logprobs if first else None)
        if seq.finished:
            out.finished, out.finish_reason, out.stop_reason = True, seq.finish_reason, seq.out.stop_reason
            out.num_prompt_tokens, out.num_output_tokens = len(seq.prompt_ids), len(seq.output_ids)
            out.num_cached_tokens, out.metrics = seq.num_cached_prompt, seq.metrics
            if seq.first_token_time is not None:
                out.ttft = seq.first_token_time - seq.arrival_time
            out.e2e = seq.finish_time - seq.arrival_time
        return out

    def stats(self) -> EngineStats:
        pc = self.blocks.prefix
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.usage,
                           self.blocks.num_used, self.scheduler.num_preemptions, pc.queries, pc.hits, self.totals,
                           self.last_k, self.spec.drafter_failures)
