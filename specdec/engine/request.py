"""What goes into the serving engine and what comes out: a request, one step's output per choice, the engine's counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.sampling_params import SamplingParams
from specdec.spec.metrics import SpecMetrics


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: dict | None = None  # {"method": name | None, "num_speculative_tokens": k}; None: server default
    cache_salt: str | None = None
    grammar: object = None  # specdec.engine.grammar.Grammar
    arrival_time: float | None = None  # time.monotonic() when the server received it (None: when added here)


@dataclass
class SeqOutput:
    """What one step added to one choice (text held back while it could still end in a stop string)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None
    pieces: list[tuple[str, bool]]  # the text cut at token starts, with "came from the drafter" flags
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # with the choice's first output, if asked (None first)
    metrics: SpecMetrics | None = None
    method: str | None = None
    drafter_error: str | None = None  # the drafter raised and was dropped: the request decoded on without it
    ttft: float | None = None
    e2e: float | None = None
    error: str | None = None  # the request failed in this step (what its row raised); it is aborted
    error_status: int = 500  # 400 where its own parameters made it fail (a ValueError: nothing to sample)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    last_k: int = 0
    drafter_failures: int = 0
