"""OpenAI-compatible request bodies, their validation, and the error shape.

Ranges follow vLLM/OpenAI: temperature in [0, 2], top_p in (0, 1], n in [1, MAX_N], logprobs <= 20,
at most 16 stop strings. Fields specdec adds (all optional): `speculative` ("off", a method name, or
{"method", "num_speculative_tokens"}), `cache_salt`, `return_token_sources`, `response_format`
{"type": "regex", "regex"} besides OpenAI's json_object / json_schema. Beside OpenAI's presence_penalty,
frequency_penalty, logit_bias and echo, vLLM's `repetition_penalty`, `min_tokens`, `prompt_logprobs` and
`allowed_token_ids` (exact under speculation: specdec/penalties.py). A request-supplied chat template is
refused: templates come only from the model's files (rendered in a Jinja2 sandbox); so are `suffix` and
`tools`, which an answer would otherwise silently ignore, and any string that is not valid Unicode.
"""
from __future__ import annotations

import re

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from specdec.model.tokenizer import valid_unicode
from specdec.penalties import check_token_ids
from specdec.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                     MIN_REPETITION_PENALTY, SamplingParams)

MAX_N = 16
MAX_ALLOWED_TOKENS = 65536


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             405: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
        self.code = code or {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                             413: "request_too_large", 431: "headers_too_large", 429: "rate_limit_exceeded",
                             503: "unavailable"}.get(status, "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


def lone_surrogate(value, path: str = "") -> str | None:
    """The path (e.g. "messages.0.content") of the first string in a parsed JSON body that is not
    valid Unicode, or None. JSON may spell a lone UTF-16 surrogate ("\\ud800"), which no tokenizer can
    encode (it made a 500 from deep in the tokenizer). Iterative: a body nested ~960 deep, which the JSON
    parser still reads, made a RecursionError (a 500) of the recursive walk."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not valid_unicode(value):
                return path or "body"
        elif isinstance(value, dict):
            children = []
            for k, v in value.items():
                children += [(k, path), (v, f"{path}.{k}" if path else str(k))]
            stack.extend(reversed(children))  # (document order: the first bad string is the one named)
        elif isinstance(value, list):
            stack.extend(reversed([(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]))
    return None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = lone_surrogate(data)
        if bad:
            raise APIError(400, f"{bad}: not valid Unicode (a lone UTF-16 surrogate)", bad)
        return data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKENS)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    response_format: dict[str, Any] | None = None
    speculative: bool | str | dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_sources: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty stop strings of at most {MAX_STOP_CHARS} "
                             "characters")
        return stops

    def check_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in ("chat_template", "chat_template_kwargs"):
            if extra.get(name) is not None:
                raise APIError(400, f"{name} is not accepted: chat templates come from the model's files", name,
                               "unsupported_parameter")
        if extra.get("echo"):  # (a field of completions; chat's echo is not supported)
            raise APIError(400, "echo is not supported for chat completions", "echo", "unsupported_parameter")
        if extra.get("best_of") not in (None, self.n):
            raise APIError(400, "best_of must equal n", "best_of", "unsupported_parameter")
        # OpenAI fields whose meaning would be lost if ignored: refused by name, as vLLM refuses suffix
        if extra.get("suffix"):
            raise APIError(400, "suffix (insertion) is not supported", "suffix", "unsupported_parameter")
        if extra.get("tools") or extra.get("tool_choice") not in (None, "none"):
            raise APIError(400, "tool calling is not supported", "tools", "unsupported_parameter")

    def speculative_choice(self) -> dict | None:
        """None: the server's default; {"method": None}: off; {"method": m, ...}: that method; without a "method"
        key ({"num_speculative_tokens": k}): the server's default method at that k."""
        v = self.speculative
        if v is None or v is True:
            return None
        if v is False or v in ("off", "none"):
            return {"method": None}
        if isinstance(v, str):
            return {"method": v}
        unknown = set(v) - {"method", "num_speculative_tokens"}
        if unknown:
            raise APIError(400, f"unknown speculative field(s): {', '.join(sorted(unknown))}", "speculative")
        k = v.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16):
            raise APIError(400, "speculative.num_speculative_tokens must be an integer in [1, 16]", "speculative")
        method = v.get("method")
        if method is not None and not isinstance(method, str):
            raise APIError(400, "speculative.method must be a string", "speculative")
        if "method" not in v:  # (it was read as off)
            return None if k is None else {"num_speculative_tokens": k}
        return {"method": None if method in ("off", "none") else method, "num_speculative_tokens": k}

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int, eos_ids=()) -> SamplingParams:
        """The request's SamplingParams; a value out of range (SamplingParams) or a token id outside the
        vocabulary (check_token_ids) is a 400 naming its field."""
        try:
            params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                  seed=self.seed, max_tokens=max_tokens, stop=tuple(self.stop or ()),
                                  stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                                  logprobs=logprobs, n=self.n, skip_special_tokens=self.skip_special_tokens,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logit_bias=self._logit_bias(),
                                  min_tokens=self.min_tokens, prompt_logprobs=self.prompt_logprobs_asked(logprobs),
                                  allowed_token_ids=self.allowed_token_ids)
            check_token_ids(params, vocab_size, eos_ids)
        except ValueError as e:  # "<field> must be ..." / "<field>: ...": name the field
            field = str(e).split(" ", 1)[0].rstrip(":")
            raise APIError(400, str(e), field if field in type(self).model_fields else None) from None
        return params

    def prompt_logprobs_asked(self, logprobs: int | None) -> int | None:
        """vLLM's prompt_logprobs, or the completions API's echo with logprobs (the prompt's come back too)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return logprobs if getattr(self, "echo", False) and logprobs is not None else None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's {"token id": bias} with the ids parsed (decimal strings); ranges: SamplingParams,
        check_token_ids."""
        if any(not (key.isascii() and key.isdigit() and len(key) <= 9) for key in self.logit_bias or {}):
            raise ValueError("logit_bias: the keys must be token ids (decimal strings)")
        return {int(key): value for key, value in (self.logit_bias or {}).items()}


class CompletionRequest(_Common):
    # (strict ints: lax ones took [true, false] as token ids 1 and 0, and 5.0 as 5)
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the completion


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # the participant's name: to the chat template, as vLLM passes it (it was dropped)

    def for_template(self) -> dict:
        """The message as the chat template reads it."""
        return {"role": self.role, "content": self.text(), **({"name": self.name} if self.name is not None else {})}

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(400, "only text content parts are supported", "messages")
            parts.append(p["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True  # vLLM's: False leaves the template's assistant header out

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if (self.model_extra or {}).get("continue_final_message"):
            raise APIError(400, "continue_final_message is not supported", "continue_final_message",
                           "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:  # (OpenAI's and vLLM's rule; it was ignored)
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        for i, m in enumerate(self.messages):  # what the template would drop without a word
            if (m.model_extra or {}).get("tool_calls"):
                raise APIError(400, "tool calling is not supported", f"messages.{i}.tool_calls",
                               "unsupported_parameter")


_UNION_MEMBER = re.compile(r"(str|int|float|bool|[\w-]+\[.*\])$")  # pydantic's tags of a union's members


def pydantic_error(exc) -> APIError:
    """A FastAPI RequestValidationError as a 400 naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = []
    for part in first.get("loc", ()):
        if isinstance(part, str) and _UNION_MEMBER.match(part):
            break  # ("prompt", "list[int]", 0): which member the client meant is unknown; name the field
        if part != "body":
            loc.append(str(part))
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", None, "invalid_json")
    return APIError(400, f"{param}: {msg}" if param else msg, param)
