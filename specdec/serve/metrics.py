"""Prometheus metrics of the server, named as vLLM's with the `specdec:` prefix.

Latency histograms (TTFT, TPOT, end-to-end) are observed when a request finishes; gauges and the
counters mirrored from the engine's cumulative totals are updated after every engine step (from the
engine thread; prometheus_client is thread-safe). Each server has its own registry.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.engine.request import EngineStats, SeqOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        m = {"model_name": model_name}
        L = ["model_name"]

        self.ttft = Histogram("specdec:time_to_first_token_seconds", "Time to first token.", L,
                              buckets=LATENCY_BUCKETS, registry=r).labels(**m)
        self.tpot = Histogram("specdec:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", L, buckets=TOKEN_BUCKETS, registry=r).labels(**m)
        self.e2e = Histogram("specdec:e2e_request_latency_seconds", "End-to-end request latency.", L,
                             buckets=LATENCY_BUCKETS, registry=r).labels(**m)
        self.running = Gauge("specdec:num_requests_running", "Sequences in the running batch.", L, registry=r).labels(**m)
        self.waiting = Gauge("specdec:num_requests_waiting", "Sequences waiting to be scheduled.", L,
                             registry=r).labels(**m)
        self.kv_usage = Gauge("specdec:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", L,
                              registry=r).labels(**m)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens of finished requests.", L,
                                     registry=r).labels(**m)
        self.generation_tokens = Counter("specdec:generation_tokens", "Generated tokens.", L, registry=r).labels(**m)
        self.success = Counter("specdec:request_success", "Finished sequences by finish reason.",
                               L + ["finished_reason"], registry=r)
        self.rejected = Counter("specdec:request_rejected", "Requests refused (429 queue full, 503 draining).",
                                L + ["reason"], registry=r)
        self.preemptions = Counter("specdec:num_preemptions", "Preemptions (recompute).", L, registry=r).labels(**m)
        self.prefix_queries = Counter("specdec:prefix_cache_queries", "Blocks looked up in the prefix cache.", L,
                                      registry=r).labels(**m)
        self.prefix_hits = Counter("specdec:prefix_cache_hits", "Prefix-cache block hits.", L, registry=r).labels(**m)
        self.drafts = Counter("specdec:spec_decode_num_drafts", "Verify passes with >= 1 drafted token.", L,
                              registry=r).labels(**m)
        self.draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "Drafted tokens.", L, registry=r).labels(**m)
        self.accepted_tokens = Counter("specdec:spec_decode_num_accepted_tokens", "Accepted drafted tokens.", L,
                                       registry=r).labels(**m)
        self.accepted_per_pos = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafted tokens by draft position.", L + ["position"], registry=r)
        self.acceptance_rate = Gauge("specdec:spec_decode_acceptance_rate", "Accepted / drafted tokens since start.",
                                     L, registry=r).labels(**m)
        self.mean_acceptance_length = Gauge("specdec:spec_decode_mean_acceptance_length",
                                            "1 + accepted tokens per draft since start.", L, registry=r).labels(**m)
        self.acceptance_by_pos = Gauge("specdec:spec_decode_acceptance_rate_per_pos",
                                       "Acceptance rate by draft position since start.", L + ["position"], registry=r)
        self.drafter_failures = Counter("specdec:spec_decode_drafter_failures",
                                        "Sequences whose drafter raised (each decoded on without drafts).", L,
                                        registry=r).labels(**m)
        self.spec_k = Gauge("specdec:spec_decode_batch_k", "Longest draft in the last decode batch.", L,
                            registry=r).labels(**m)
        self._m = m
        self._seen: dict[int, int] = {}  # id(counter) -> engine total already counted
        self._lock = threading.Lock()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_stats(self, st: EngineStats) -> None:
        with self._lock:
            self.running.set(st.num_running)
            self.waiting.set(st.num_waiting)
            self.kv_usage.set(st.kv_usage)
            self.spec_k.set(st.last_k)
            mirrored = ((self.preemptions, st.num_preemptions), (self.prefix_queries, st.prefix_queries),
                        (self.prefix_hits, st.prefix_hits), (self.drafts, st.spec.num_drafts),
                        (self.draft_tokens, st.spec.num_draft_tokens),
                        (self.accepted_tokens, st.spec.num_accepted_tokens),
                        (self.drafter_failures, st.drafter_failures))
            mirrored += tuple((self.accepted_per_pos.labels(**self._m, position=str(pos)), acc)
                              for pos, acc in enumerate(st.spec.accepted_per_pos))
            for counter, total in mirrored:  # the engine keeps running totals: add what is new
                seen = self._seen.get(id(counter), 0)
                if total > seen:
                    counter.inc(total - seen)
                    self._seen[id(counter)] = total
            for pos, rate in enumerate(st.spec.acceptance_by_position):
                self.acceptance_by_pos.labels(**self._m, position=str(pos)).set(rate)
            if st.spec.num_draft_tokens:
                self.acceptance_rate.set(st.spec.acceptance_rate)
                self.mean_acceptance_length.set(st.spec.mean_acceptance_length)

    def on_finished(self, out: SeqOutput) -> None:
        self.success.labels(**self._m, finished_reason=out.finish_reason or "unknown").inc()
        if out.index == 0:  # once a request, not once each of its n sequences
            self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
            if out.num_output_tokens > 1:
                self.tpot.observe((out.e2e - out.ttft) / (out.num_output_tokens - 1))
        if out.e2e is not None:
            self.e2e.observe(out.e2e)
