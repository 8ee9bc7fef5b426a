"""The child process that builds structured output's automata: a client's JSON schema into a regex, and a
regex into outlines-core's index over the vocabulary, each bounded in time, memory and size.

Both builds can explode on a small request, inside Rust. outlines-core's regex for a JSON schema grows with
the square of an object's optional properties, and again at every level of nesting: 100 optional `{}`
properties (a 1 KB body) made a 70 MB regex, 1,000 ran 45 s to 7 GB. An index keeps a transition for every
token each state allows, so a class of almost any character repeated a few hundred times (a JSON string's
maxLength: `[^"]{800}`, 800 states by regex_size's count) took 8 s and 6 GB to build over SmolLM2's 49k
tokens. So a child process builds both, under an address-space limit. The parent waits a bounded time
for each answer and takes back a regex of at most `max_chars` characters, or the index in outlines-core's
own binary form (`Index.from_binary`; no pickle) of at most `max_index_bytes`. A child past a limit is
killed, and the next request starts another; on Linux it dies with the thread that started it. The child
imports outlines-core alone (not specdec or torch).

Messages, both ways: a JSON header line, then `size` bytes of payload where the header has a size.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time

WHITESPACE = r"[ ]?"  # between a JSON schema's tokens: at most one space


class TooLarge(Exception):
    """A schema's regex or a regex's index past the worker's limits of time, memory or size."""


def binary(obj) -> bytes:
    """An outlines-core Vocabulary's or Index's serialized form (what its from_binary reads back)."""
    load, args = obj.__reduce__()
    if load != type(obj).from_binary or len(args) != 1 or not isinstance(args[0], bytes):
        raise TypeError(f"{type(obj).__name__} does not serialize as expected (outlines-core changed?)")
    return args[0]


class GrammarWorker:
    """One child process, started when first needed, that builds schemas' regexes and regexes' automata
    over `vocabulary` (outlines-core's, serialized: `binary`), one at a time."""

    def __init__(self, vocabulary: bytes, *, schema_seconds: float = 10.0, index_seconds: float = 60.0,
                 memory_bytes: int = 2 << 30, max_chars: int = 640_000, max_index_bytes: int = 256 << 20,
                 nice: int = 0):
        self.vocabulary, self.nice = vocabulary, nice
        self.schema_seconds, self.index_seconds = schema_seconds, index_seconds
        self.memory_bytes, self.max_chars, self.max_index_bytes = memory_bytes, max_chars, max_index_bytes
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one build at a time through the one child
        # children are started on a thread of their own that lives as long as this worker: on Linux a child
        # dies with the thread that started it, and the threads that ask (a request's) come and go
        self._spawns: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_spawner, args=(self._spawns,), daemon=True, name="grammar-worker-spawner").start()

    def schema_regex(self, schema_json: str) -> str:
        """The regex of a JSON schema (JSON text). ValueError: outlines-core refuses it; TooLarge."""
        header, _ = self._ask({"op": "schema", "schema": schema_json}, self.schema_seconds)
        return header["regex"]

    def index(self, regex: str) -> bytes:
        """The serialized index of a regex over the vocabulary. ValueError: not a regex outlines-core
        compiles; TooLarge."""
        return self._ask({"op": "index", "regex": regex}, self.index_seconds)[1]

    def _ask(self, header: dict, seconds: float) -> tuple[dict, bytes]:
        with self._lock:
            proc = self._proc  # (its own reference: close() at shutdown may clear self._proc meanwhile)
            try:
                if proc is None or proc.poll() is not None:
                    proc = self._proc = self._start()
                _send(proc, header)
                reply, data = _receive(proc, time.monotonic() + seconds)
            except (OSError, EOFError, TimeoutError, ValueError):  # killed at its memory limit, hung, garbled
                self.close()
                code = proc.returncode if proc is not None else None
                raise TooLarge(f"building it took more than {seconds:g} s or {self.memory_bytes >> 20} MiB"
                               + (f" (the worker ended with code {code})" if code not in (None, -9) else "")) from None
            except BaseException:  # anything else leaves bytes in the pipes: never reuse this child
                self.close()
                raise
        if "error" in reply:
            raise ValueError(reply["error"])
        if "too_large" in reply:
            raise TooLarge(reply["too_large"])
        return reply, data

    def _start(self) -> subprocess.Popen:
        """A child that holds the vocabulary. It gets the parent's import path (outlines-core may have come
        from a path added at run time)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        started: queue.SimpleQueue = queue.SimpleQueue()
        self._spawns.put(([sys.executable, __file__, str(self.memory_bytes), str(self.max_chars),
                           str(self.max_index_bytes), str(self.nice), str(os.getpid())], env, started))
        proc = started.get()
        if isinstance(proc, BaseException):
            raise proc
        try:
            _send(proc, {"op": "vocabulary", "size": len(self.vocabulary)}, self.vocabulary)
            reply, _ = _receive(proc, time.monotonic() + self.schema_seconds)
            if reply:  # (the vocabulary is ours: a bug, not the client's)
                raise RuntimeError(f"the grammar worker could not read the vocabulary: {reply}")
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return proc

    def close(self) -> None:
        """Stop the child (the next request starts another)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __del__(self):
        self.close()
        self._spawns.put(None)  # (its spawner thread ends)


def _spawner(jobs: queue.SimpleQueue) -> None:
    """Start each child asked for (argv, env, where to put it), until None."""
    while (job := jobs.get()) is not None:
        argv, env, started = job
        try:
            started.put(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, env=env))
        except BaseException as e:  # (handed to the thread that asked, which raises it)
            started.put(e)


def _send(proc: subprocess.Popen, header: dict, payload: bytes = b"") -> None:
    proc.stdin.write(json.dumps(header).encode() + b"\n" + payload)  # (a buffered writer: all of it)
    proc.stdin.flush()


def _receive(proc: subprocess.Popen, deadline: float) -> tuple[dict, bytes]:
    """A header line and its payload, by `deadline`."""
    buf = bytearray()
    while b"\n" not in buf:
        buf += _read(proc, deadline)
    line, _, rest = bytes(buf).partition(b"\n")
    header = json.loads(line)
    size = int(header.get("size", 0))
    data = bytearray(rest)
    while len(data) < size:
        data += _read(proc, deadline)
    return header, bytes(data[:size])


def _read(proc: subprocess.Popen, deadline: float) -> bytes:
    """What the child has written so far (the raw descriptor: the pipe's reader object is never used)."""
    fd = proc.stdout.fileno()
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise TimeoutError
    chunk = os.read(fd, 1 << 20)
    if not chunk:
        raise EOFError
    return chunk


def _serve(memory_bytes: int, max_chars: int, max_index_bytes: int, nice: int, parent: int) -> None:
    """The child: requests in on stdin, answers out on stdout, until stdin closes."""
    import resource

    if sys.platform.startswith("linux"):  # die with the thread that started it (the spawner), busy or not: a
        import ctypes                     # build in Rust reads no stdin, and an orphan ran on to its end
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # (it died before that)
            return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ValueError, OSError):  # (a platform that does not enforce it: the parent's time limit holds)
        pass
    if nice:
        os.nice(nice)
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary, inp, out = None, sys.stdin.buffer, sys.stdout.buffer
    while line := inp.readline():
        header = json.loads(line)
        payload = inp.read(header.get("size", 0))
        reply, data = {}, b""
        try:
            if header["op"] == "vocabulary":
                vocabulary = outlines_core.Vocabulary.from_binary(payload)
            elif header["op"] == "schema":
                regex = build_regex_from_schema(header["schema"], WHITESPACE)
                reply = ({"regex": regex} if len(regex) <= max_chars else
                         {"too_large": f"its regex has {len(regex)} characters (at most {max_chars})"})
            else:
                data = binary(outlines_core.Index(header["regex"], vocabulary))
                if len(data) > max_index_bytes:
                    reply, data = {"too_large": f"its automaton takes {len(data) >> 20} MiB "
                                                f"(at most {max_index_bytes >> 20})"}, b""
        except MemoryError:
            reply = {"too_large": f"building it needs more than {memory_bytes >> 20} MiB"}
        except (ValueError, TypeError, RuntimeError) as e:
            reply = {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}
        if data:
            reply["size"] = len(data)
        out.write(json.dumps(reply).encode() + b"\n" + data)
        out.flush()


if __name__ == "__main__":
    del sys.path[0]  # (this file's directory: its neighbours' names must not shadow what outlines-core imports)
    _serve(*map(int, sys.argv[1:6]))
