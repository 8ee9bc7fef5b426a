"""Chat templates (Jinja2, as in HF tokenizer_config.json), rendered in a sandbox.

Templates come from model files, which users download from strangers: they are rendered in
jinja2's ImmutableSandboxedEnvironment, so a template cannot reach Python internals or mutate data, and
with bounds on what it can build (`*` and `**` on large operands, the rendered text's length). Any failure
of a template is a ConfigError naming it. The environment is the one transformers renders with (loop
controls, a `{% generation %}` block, a `tojson` that keeps key order and non-ASCII text), so a template
renders here as it does there. What a template builds otherwise (`~`, `join`) is bounded only by the rendered
length's cap and memory: a template runs on the operator's say-so, from the model's files.
"""
from __future__ import annotations

import json
import operator
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specdec.config import ConfigError

MAX_RENDERED_CHARS = 1 << 22  # a prompt's text: far beyond any context this engine serves
MAX_BUILT_ITEMS = 1 << 20  # a string or list a template builds with `*`
MAX_EXPONENT = 256  # `**` on numbers
MAX_POWER_BITS = 1 << 16  # an integer `**`'s result


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's marker of assistant text for training masks): renders
    its body."""
    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with `*` and `**` bounded: `"x" * 10**10` or `9 ** 9 ** 9` would exhaust memory or time."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator_name: str, left, right):
        if operator_name == "**":
            if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                raise TemplateError(f"an exponent above {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and abs(left).bit_length() * right > MAX_POWER_BITS:
                raise TemplateError(f"a power of more than {MAX_POWER_BITS} bits")  # ((10**200)**256)**256
            return operator.pow(left, right)
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_BUILT_ITEMS:
                raise TemplateError(f"a repetition of more than {MAX_BUILT_ITEMS} items")
        return operator.mul(left, right)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    if not messages:
        raise ConfigError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise ConfigError("each message needs a 'role' and a string 'content'")
    try:
        parts, size = [], 0
        for piece in _compile(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **extra):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise TemplateError(f"it renders more than {MAX_RENDERED_CHARS} characters")
            parts.append(piece)
        return "".join(parts)
    except TemplateError as e:
        raise ConfigError(f"chat template error: {e}") from None
    # a template is a program from a model file: whatever else it raises (a TypeError from adding a number to
    # a string, a ZeroDivisionError, the sandbox's OverflowError for a huge range, a RecursionError) is its error
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RecursionError) as e:
        raise ConfigError(f"chat template error: {type(e).__name__}: {e}") from None
    except MemoryError:  # (a string doubled by `~` in a loop, a huge join: built before anything is rendered)
        raise ConfigError("chat template error: it ran out of memory") from None
