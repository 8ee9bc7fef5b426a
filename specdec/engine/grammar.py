"""Structured output (JSON schema, regex) through outlines-core, made to work with speculation.

outlines-core compiles a regex against the tokenizer's vocabulary into an index whose states are
plain integers (built in a child process under limits of time, memory and size: grammar_worker.py), so
speculation needs no rollback: a sequence keeps its state, drafts are walked from it on the side. Per
verified row i the target's logits are masked to the tokens allowed after the drafts before it, drafted
tokens the grammar forbids are cut before the verify pass, and every emitted token advances the state.
Greedy or sampled, output is what the masked target alone gives.
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.config import ConfigError
from specdec.engine.grammar_worker import WHITESPACE, GrammarWorker, TooLarge, binary
from specdec.engine.regex_size import regex_size, uses_verbose_flag

try:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
except ImportError:  # optional: `pip install outlines-core` (the serve extra)
    outlines_core = None

# allowed-token masks kept per grammar (states are revisited constantly), in bytes: a mask is a byte a
# token (49 KB for SmolLM2, 262 KB for Gemma 3), so ~1,300 or ~250 of them
MASK_CACHE_BYTES = 64 << 20
# the compiled grammars kept (by regex), at most this many and this many bytes of automata together
CACHE_GRAMMARS, CACHE_BYTES = 8, 512 << 20
# the grammar worker's limits (grammar_worker.py) for SmolLM2's 49,152 tokens: a schema's regex in 10 s, of
# at most 640,000 characters (regex_size then bounds its states: 10,000 states take ~40,000 characters,
# json_object's 6,900 ~7,000); an automaton in 60 s (json_object's took 8-9 s here, and 1 GiB of address
# space sufficed), of at most 256 MiB (json_object's: 25 MiB; `[^"]{400}`'s 124 MiB, `[^"]{800}`'s 274);
# 2 GiB of address space. An automaton's time, memory and size grow with the vocabulary: those three scale
# with it (Gemma 3's 262k tokens: x5.3), as does the cache's bytes
LIMITS_VOCAB = 49_152
# the most states a response_format's regex may have by regex_size's bound (~5 s of compiling at most
# here; a counted repetition like c{1000000} ran for minutes and took gigabytes)
MAX_REGEX_STATES = 10_000
# compiles one at a time, and at most this many requests waiting for their turn (the server answers the
# next ones 429): each waiting request holds a worker thread of the event loop's executor
MAX_WAITING_COMPILES = 4


def _vocab_scale(vocab_size: int) -> float:
    """How far past LIMITS_VOCAB's the limits that grow with the vocabulary stretch."""
    return max(1.0, vocab_size / LIMITS_VOCAB)


def worker_limits(vocab_size: int) -> dict:
    """The grammar worker's limits for a vocabulary of this size (see LIMITS_VOCAB)."""
    scale = _vocab_scale(vocab_size)
    return {"schema_seconds": 10.0, "index_seconds": 60.0 * scale, "memory_bytes": int((2 << 30) * scale),
            "max_chars": 640_000, "max_index_bytes": int((256 << 20) * scale)}


@contextmanager
def _refused(invalid: str):
    """The grammar worker's refusals as ConfigErrors (a 400): what outlines-core rejects, and TooLarge."""
    try:
        yield
    except ValueError as e:
        raise ConfigError(f"{invalid}: {e}") from None
    except TooLarge as e:
        raise ConfigError(f"response_format is too large to compile: {e}") from None


class CompilerBusy(Exception):
    """Too many response formats are waiting to be compiled; retry later."""


def available() -> bool:
    return outlines_core is not None


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; on Linux a thread's nice value is its
    own). A compile in the background then takes only the cores the engine's kernels leave idle: at
    normal priority it shares a core with a kernel thread, whose parallel regions wait for it at every
    barrier (the first requests after start, while json_object's grammar was warming: TPOT 45 against
    14 ms at 4 sequences, bf16, 2 vCPUs). Where the system refuses, the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # (no setpriority on this platform, or not allowed)
        pass


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """The bytes each non-special token stands for (byte-level BPE or SentencePiece-style vocabularies)."""
    spec = json.loads(tokenizer._tok.to_str())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    dec = _byte_decoder()
    out: dict[bytes, list[int]] = {}
    for tok, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level:
            if any(c not in dec for c in tok):
                continue
            b = bytes(dec[c] for c in tok)
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            b = bytes([int(tok[3:5], 16)])
        else:
            b = tok.replace("\u2581", " ").encode()
        out.setdefault(b, []).append(i)
    return out


class Grammar:
    """A compiled regex: states, allowed-token masks over the model's vocabulary."""

    def __init__(self, index, eos_id: int, vocab_size: int, nbytes: int = 0):
        self.index, self.eos_id, self.vocab_size = index, eos_id, vocab_size
        self.nbytes = nbytes  # the automaton's serialized size: what the compiler's cache counts
        self.max_masks = max(16, MASK_CACHE_BYTES // vocab_size)
        # (the cache counts nbytes; the automaton's maps in memory take more, and its masks up to 64 MiB)
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def initial(self) -> int:
        return self.index.get_initial_state()

    def mask(self, state: int) -> torch.Tensor:
        """[V] bool: the tokens allowed in `state`."""
        with self._lock:
            m = self._masks.get(state)
            if m is not None:
                self._masks.move_to_end(state)
                return m
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed = [t for t in (self.index.get_allowed_tokens(state) or []) if t < self.vocab_size]
        if allowed:
            m[torch.tensor(allowed)] = True
        with self._lock:
            self._masks[state] = m
            if len(self._masks) > self.max_masks:
                self._masks.popitem(last=False)
        return m

    def next(self, state: int, token: int) -> int | None:
        """The state after `token`, None when the grammar forbids it (EOS ends the grammar)."""
        if token == self.eos_id:
            return state if self.index.is_final_state(state) else None
        return self.index.get_next_state(state, token)


@dataclass
class GrammarState:
    grammar: Grammar
    state: int

    def cut(self, drafts: list[int]) -> tuple[int, bool]:
        """How many leading drafts the grammar allows, and whether the draft after them is cut for its
        value (the grammar forbids it) rather than for its place (after an EOS that ends the grammar,
        which the target's own draw then follows, or past the drafts' end)."""
        s = self.state
        for i, tok in enumerate(drafts):
            s = self.grammar.next(s, tok)
            if s is None:
                return i, True
            if tok == self.grammar.eos_id:
                return i + 1, False
        return len(drafts), False

    def row_masks(self, drafts: list[int]) -> torch.Tensor:
        """[k + 1, V] masks for the rows of a verify pass over [last, drafts] (drafts already cut)."""
        states, s = [self.state], self.state
        for tok in drafts:
            s = self.grammar.next(s, tok)
            states.append(s)
        return torch.stack([self.grammar.mask(x) for x in states])

    def advance(self, tokens: list[int]) -> None:
        for tok in tokens:
            nxt = self.grammar.next(self.state, tok)
            if nxt is None:
                return  # EOS or a token past the end: the sequence is finishing
            self.state = nxt


class GrammarCompiler:
    """Compiles response formats for one tokenizer; compiled grammars are cached by regex."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_GRAMMARS, cache_bytes: int = CACHE_BYTES):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self.cache_bytes = int(cache_bytes * _vocab_scale(vocab_size))
        self._vocab = None
        self._worker: GrammarWorker | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._schemas: OrderedDict[str, str] = OrderedDict()  # schema (JSON text) -> its regex, the last 64
        self._lock = threading.Lock()
        self._compiling = threading.Lock()  # one compile at a time: a burst of them does not starve the engine
        self._waiting = 0  # requests in compile() that found no cached grammar (guarded by _lock)
        eos = tokenizer.eos_token
        eos_id = tokenizer._tok.token_to_id(eos) if eos else None
        self.eos_id = eos_id if eos_id is not None else min(tokenizer.eos_token_ids or {0})

    def _vocabulary(self) -> bytes:
        """outlines-core's vocabulary, serialized for the grammar worker."""
        if self._vocab is None:
            self._vocab = binary(outlines_core.Vocabulary(self.eos_id, token_bytes(self.tokenizer)))
        return self._vocab

    def _grammar_worker(self) -> GrammarWorker:
        if self._worker is None:
            self._worker = GrammarWorker(self._vocabulary(), **worker_limits(self.vocab_size))
        return self._worker

    def close(self) -> None:
        """Stop the grammar worker's child process (a later compile starts another)."""
        if self._worker is not None:
            self._worker.close()

    def regex_for(self, response_format: dict) -> str | None:
        """The regex of an OpenAI-style response_format (None for plain text)."""
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "regex":
            regex = response_format.get("regex")
            if not isinstance(regex, str) or not regex:
                raise ConfigError("response_format.regex must be a non-empty string")
            return regex
        if kind == "json_object":  # (a fixed schema of known size: built here)
            return build_regex_from_schema(json.dumps({"type": "object"}), WHITESPACE)
        if kind != "json_schema":
            raise ConfigError(f"response_format.type {kind!r} is not supported (text, json_object, json_schema, regex)")
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ConfigError("response_format.json_schema.schema must be a JSON schema object")
        text = json.dumps(schema)
        with self._lock:
            regex = self._schemas.get(text)
        if regex is None:
            with self._turn(), _refused("cannot use this JSON schema"):
                regex = self._grammar_worker().schema_regex(text)
            with self._lock:
                self._schemas[text] = regex
                if len(self._schemas) > 64:
                    self._schemas.popitem(last=False)
        return regex

    def compile(self, response_format: dict) -> Grammar | None:
        if not available():
            raise ConfigError("structured output needs outlines-core (pip install outlines-core)")
        regex = self.regex_for(response_format)
        if regex is None:
            return None
        g = self._cached(regex)
        if g is not None:
            return g
        if uses_verbose_flag(regex):
            raise ConfigError("response_format: a regex may not use the verbose flag (?x); write it without "
                              "the whitespace and comments that flag ignores")
        states = regex_size(regex)
        if states > MAX_REGEX_STATES:
            raise ConfigError(f"response_format is too large to compile: its regex may need {states} states "
                              f"(at most {MAX_REGEX_STATES}; counted repetitions such as {{n}} multiply them)")
        with self._turn():
            g = self._cached(regex)  # (compiled meanwhile by the request this one waited for)
            return g if g is not None else self._build(regex, self._grammar_worker())

    @contextmanager
    def _turn(self):
        """The grammar worker's turn: one job at a time, and at most MAX_WAITING_COMPILES requests waiting
        for it (each holds a thread of the event loop's executor); the next one gets CompilerBusy."""
        with self._lock:
            if self._waiting >= MAX_WAITING_COMPILES:
                raise CompilerBusy(f"{self._waiting} response formats are waiting to be compiled; retry later")
            self._waiting += 1
        try:
            with self._compiling:
                yield
        finally:
            with self._lock:
                self._waiting -= 1

    def _build(self, regex: str, worker: GrammarWorker) -> Grammar:
        """Compile a regex (its size checked) in the worker's child and keep it in the cache."""
        with _refused("cannot compile this response_format"):
            data = worker.index(regex)
        g = Grammar(outlines_core.Index.from_binary(data), self.eos_id, self.vocab_size, len(data))
        with self._lock:
            self._cache[regex] = g
            self._cache.move_to_end(regex)  # (built twice, by the warm-up and a request: the newest stays)
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size
                                            or sum(x.nbytes for x in self._cache.values()) > self.cache_bytes):
                self._cache.popitem(last=False)
        return g

    def warm_up(self) -> None:
        """Compile the generic JSON object's grammar (response_format json_object) on a daemon thread, so
        that the first request for it does not wait: on a 2-vCPU Xeon it takes ~5-9 s (SmolLM2's 49k
        tokens). It compiles in a child of its own at the lowest priority (nice 19), outside the compile
        lock: a request that wants the grammar meanwhile compiles it at its own priority instead of waiting
        for this one."""
        if available():
            threading.Thread(target=self._warm, args=(self.regex_for({"type": "json_object"}),), daemon=True,
                             name="grammar-warm-up").start()

    def _warm(self, regex: str) -> None:
        lower_priority()
        if self._cached(regex) is None:
            # no time limit (a fixed regex of known size; at nice 19 on a busy machine it takes long): a
            # request that wants it meanwhile compiles it itself
            worker = GrammarWorker(self._vocabulary(), **{**worker_limits(self.vocab_size), "index_seconds": 3600.0},
                                   nice=19)
            try:
                self._build(regex, worker)
            except ConfigError:  # (out of memory here: the first request's compile will say so)
                pass
            finally:
                worker.close()

    def _cached(self, regex: str) -> Grammar | None:
        with self._lock:
            g = self._cache.get(regex)
            if g is not None:
                self._cache.move_to_end(regex)
            return g
