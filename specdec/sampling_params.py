"""SamplingParams: how to pick tokens and when to stop (names and ranges as vLLM's)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from specdec.config import check_type

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # a stop string's length (streaming holds back that many characters less one)
MAX_STOP_TOKEN_IDS = 1024
MIN_REPETITION_PENALTY = 0.01  # below it, a logit divided by the penalty could overflow fp32
# a temperature below this samples greedily (vLLM's _SAMPLING_EPS): logits divided by 1e-40 overflow
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # tokens a request may bias


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (below GREEDY_TEMPERATURE) is greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable
    those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings unchecked, before this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (and top n), as vLLM's
    n: int = 1
    skip_special_tokens: bool = True
    # penalties and bias (specdec/penalties.py): presence/frequency over the output, repetition over
    # prompt + output; logit_bias: {token id: bias in [-100, 100]} (kept as sorted (id, bias) pairs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM's; sorted, unique)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for f in fields(self):  # types first: SamplingParams(max_tokens="5") is a ValueError naming the field
            value = getattr(self, f.name)
            if not (f.name in ("stop", "stop_token_ids") and value is None):
                check_type("SamplingParams", f.name, f.type, value)
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed <= 2**63 - self.n):  # sample i draws with seed + i
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - n], got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
                             "characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} non-negative token ids")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], "
                             f"got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(sorted(set(self.allowed_token_ids)))
            if not allowed or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in allowed):
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative token ids")
            object.__setattr__(self, "allowed_token_ids", allowed)

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, a logit bias, min_tokens or allowed_token_ids change the target's logits
        (specdec/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias ({token id: bias} or (id, bias) pairs) as sorted pairs, each checked."""
    if bias is not None and not isinstance(bias, (dict, list, tuple)):  # (a number raised a TypeError)
        raise ValueError("logit_bias must be {token id: bias} or (token id, bias) pairs")
    items = bias.items() if isinstance(bias, dict) else (bias or ())
    if not isinstance(bias, dict) and not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
        raise ValueError("logit_bias must be {token id: bias} or (token id, bias) pairs")
    pairs = {}
    for tok, value in items:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias: token ids must be non-negative integers, got {tok!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias: biases must be numbers, got {value!r} for token {tok}")
        value = float(value)
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise ValueError(f"logit_bias: biases must be in [-100, 100], got {value} for token {tok}")
        pairs[tok] = value
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    return tuple(sorted(pairs.items()))
