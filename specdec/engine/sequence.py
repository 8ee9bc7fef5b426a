"""A sequence: one completion choice of a request, as the scheduler, block manager and runner see it.

Invariant between steps: token_ids = prompt + output; the KV of token_ids[:num_computed] is in the
sequence's blocks. A step feeds token_ids[num_computed:num_computed + n] (a prefill chunk, or the
last token) and, when that reaches the end of token_ids, the row also samples (plus drafts to
verify). After a decode step num_computed = num_tokens - 1: the newest token is emitted, not cached.
Preemption frees the blocks and sets num_computed = 0; the sequence is recomputed (prefix-cache hits
make that cheap) with its proposer state and generator kept, so the output is unchanged.
"""
from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch

from specdec.model.tokenizer import IncrementalDetokenizer
from specdec.sampling_params import SamplingParams
from specdec.spec.adaptive import AdaptiveK
from specdec.spec.decoder import _Output
from specdec.spec.metrics import SpecMetrics
from specdec.spec.proposer import Proposer, RequestState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SpecChoice:
    """The speculation a sequence uses: a proposer (None: plain decoding), a cap on k; a drafter that failed
    is dropped (proposer None) with its method's name and what it raised kept for the request's metrics."""

    proposer: Proposer | None = None
    k_max: int = 0
    fixed_k: bool = False
    failed_method: str | None = None
    drafter_error: str | None = None

    @property
    def method(self) -> str | None:
        return self.proposer.name if self.proposer is not None else self.failed_method


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # choice index within its request
    state: RequestState  # prompt_ids, params, generator, output_ids, proposer's draft dict
    out: _Output  # emission: text, stop checks, logprobs
    spec: SpecChoice = SpecChoice()
    cache_salt: str | None = None
    grammar: Any = None  # specdec.engine.grammar.GrammarState
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the committed full blocks
    num_computed: int = 0  # tokens whose KV is cached
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    begun: bool = False  # proposer.begin() called
    prefill_parts: list = field(default_factory=list)  # ForwardOutput chunks until begin()
    # EMA of this row's per-position acceptance (AdaptiveK.update); the batch's K is chosen from it by
    # specdec.engine.speculation, not by AdaptiveK.choose
    adaptive: AdaptiveK = field(default_factory=lambda: AdaptiveK(0, None))
    draft_yield: float = 1.0  # EMA of "the proposer had a draft when asked"
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    # per output token: True when it was a drafted token the target accepted
    token_from_draft: list[bool] = field(default_factory=list)
    # (end offset in out.text, from_draft) for every token that produced text
    text_marks: list[tuple[int, bool]] = field(default_factory=list)
    sent_text: int = 0  # characters already delivered
    # SamplingParams.prompt_logprobs: per prompt token, None first, filled chunk by chunk; delivered once
    # (with the first tokens sent)
    prompt_logprobs: list | None = None
    sent_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False

    @classmethod
    def create(cls, seq_id: int, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
               tokenizer, generator: torch.Generator | None, max_model_len: int, **kw) -> "Sequence":
        state = RequestState(list(prompt_ids), params, generator, request_id=f"{request_id}-{index}")
        detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        seq = cls(seq_id, request_id, index, state, _Output(params, tokenizer.eos_token_ids, detok, None,
                                                            max_model_len), **kw)
        seq.out.on_delta = seq._on_delta
        return seq

    def _on_delta(self, delta: str, toks: list[int]) -> None:
        if delta:
            self.text_marks.append((len(self.out.text) + len(delta), self.token_from_draft[len(self.output_ids) - 1]))

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether cached blocks may serve its prompt (not when its prompt logprobs are asked: every
        prompt position is computed then; its blocks are still cached for others)."""
        return self.params.prompt_logprobs is None

    @property
    def prompt_ids(self) -> list[int]:
        return self.state.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.state.output_ids

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids

    @property
    def num_tokens(self) -> int:
        return self.state.num_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def finish_reason(self) -> str | None:
        return "abort" if self.aborted else self.out.finish_reason

    def text_pieces(self, start: int, end: int) -> list[tuple[str, bool]]:
        """The text [start, end) cut where tokens begin, each piece with its token's from_draft flag."""
        marks = self.text_marks
        first = bisect.bisect_right(marks, start, key=itemgetter(0))  # the first token ending after start
        pieces, prev = [], marks[first - 1][0] if first else 0
        for j in range(first, len(marks)):  # from there, not from the text's start: a step costs O(its tokens)
            mark, from_draft = marks[j]
            lo, hi = max(prev, start), min(mark, end)
            if lo < hi:
                pieces.append((self.out.text[lo:hi], from_draft))
            prev = mark
            if prev >= end:
                break
        return pieces
