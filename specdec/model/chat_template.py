"""Chat templates (Jinja2, as in HF tokenizer_config.json), rendered in a sandbox.

Templates come from model files, which users download from strangers: they are rendered in
jinja2's ImmutableSandboxedEnvironment, so a template cannot reach Python internals or mutate data.
"""
from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specdec.config import ConfigError


def _raise(message: str):
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    if not messages:
        raise ConfigError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise ConfigError("each message needs a 'role' and a string 'content'")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as e:
        raise ConfigError(f"chat template error: {e}") from None
