"""grammar_worker: a client's JSON schema becomes a regex, and a regex an index over the vocabulary, in a
child process bounded in time, memory and size, so a small request whose automaton explodes costs the
server neither its memory nor its GIL; and the compiler's cache is bounded in bytes."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

outlines_core = pytest.importorskip("outlines_core")

from outlines_core.json_schema import build_regex_from_schema  # noqa: E402

from specdec.engine.grammar_worker import WHITESPACE, GrammarWorker, TooLarge, binary  # noqa: E402

# a small byte-level vocabulary: every printable ASCII character, some pairs, and EOS (0)
TOKENS = {bytes([c]): [i + 1] for i, c in enumerate(range(32, 127))}
TOKENS.update({bytes([a, b]): [200 + i] for i, (a, b) in enumerate((a, b) for a in b"abc{}\"" for b in b"xyz:, ")})


def _worker(**limits) -> GrammarWorker:
    return GrammarWorker(binary(outlines_core.Vocabulary(0, TOKENS)), **limits)


def _optional_properties(n: int, schema: dict | None = None) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": schema or {} for i in range(n)}})


def test_the_child_builds_what_outlines_builds_and_refuses_what_it_refuses():
    """A schema's regex is outlines-core's; an index comes back whole (the same transitions as one built
    here); a schema or regex it refuses is a ValueError, and the same child goes on."""
    worker = _worker()
    try:
        schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                              "age": {"type": "integer"}}, "required": ["name"]})
        regex = worker.schema_regex(schema)
        assert regex == build_regex_from_schema(schema, WHITESPACE)
        here = outlines_core.Index(regex, outlines_core.Vocabulary(0, TOKENS))
        there = outlines_core.Index.from_binary(worker.index(regex))
        assert there.get_transitions() == here.get_transitions() and there.get_initial_state() == here.get_initial_state()
        with pytest.raises(ValueError):
            worker.schema_regex(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
        with pytest.raises(ValueError):
            worker.index("a(b")
        assert worker.schema_regex(schema) == regex
    finally:
        worker.close()


def test_an_exploding_schema_or_automaton_is_refused_and_the_next_one_is_served():
    """100 optional {} properties (a 1 KB schema) make a 70 MB regex: refused by its length. A broad class
    repeated (a string's maxLength) makes an automaton of a transition per token and state: refused by its
    size. 1,000 optional properties ran 45 s to 7 GB: the child is stopped by the time limit, or by its
    memory limit, and a new child serves the next request."""
    small = _optional_properties(3, {"type": "integer"})
    worker = _worker(max_chars=640_000, max_index_bytes=1 << 16)
    try:
        with pytest.raises(TooLarge, match="characters"):
            worker.schema_regex(_optional_properties(100))
        with pytest.raises(TooLarge, match="automaton takes"):
            worker.index('[^"]{400}')
        assert worker.schema_regex(small) == build_regex_from_schema(small, WHITESPACE)
        assert worker.index("[0-9]{1,3}")
    finally:
        worker.close()
    for limits in ({"schema_seconds": 1.0}, {"schema_seconds": 30.0, "memory_bytes": 512 << 20}):
        worker = _worker(**limits)
        try:
            t0 = time.monotonic()
            with pytest.raises(TooLarge):
                worker.schema_regex(_optional_properties(1000))
            assert time.monotonic() - t0 < 25, limits
            assert worker.schema_regex(small) == build_regex_from_schema(small, WHITESPACE)
        finally:
            worker.close()


def test_the_compilers_cache_is_bounded_in_bytes(tiny_dir):
    """The compiled grammars kept are bounded by their automata's bytes as well as by count (32 of them at
    200 MB of masks and any size of automaton each could take gigabytes), always keeping the newest."""
    from specdec.config import ConfigError
    from specdec.engine.grammar import GrammarCompiler
    from specdec.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir("llama"))
    compiler = GrammarCompiler(tok, len(tok.get_vocab()), cache_size=8, cache_bytes=1)
    try:
        for regex in ("[0-9]{1,3}", "[a-c]{2}", "(yes|no)"):
            g = compiler.compile({"type": "regex", "regex": regex})
            assert g.nbytes > 0 and list(compiler._cache) == [regex]
        with pytest.raises(ConfigError, match="json_schema.schema must be"):
            compiler.compile({"type": "json_schema", "json_schema": "x"})  # (an AttributeError: a 500)
    finally:
        compiler.close()


def test_the_child_outlives_the_thread_that_asked_for_it():
    """A request's thread comes and goes; the child (on Linux killed with the thread that started it) is
    started by the worker's own thread, so the next request finds it alive (every other one failed)."""
    import threading

    worker = _worker()
    try:
        asker = threading.Thread(target=worker.index, args=("[0-9]{1,3}",))
        asker.start()
        asker.join()
        pid = worker._proc.pid
        time.sleep(0.2)
        assert worker.index("(yes|no){2}") and worker._proc.pid == pid
    finally:
        worker.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_with_its_parent_mid_build(tmp_path):
    """A build in Rust reads no stdin, so a child whose server died (or whose daemon warm-up thread was cut
    off at exit) ran on for the rest of its build: it now dies with the thread that started it."""
    script = tmp_path / "parent.py"
    script.write_text(f"""
import os, sys, threading, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
import outlines_core
from specdec.engine.grammar_worker import GrammarWorker, binary
worker = GrammarWorker(binary(outlines_core.Vocabulary(0, {{bytes([c]): [c] for c in range(32, 127)}})), index_seconds=100)
threading.Thread(target=lambda: worker.index('[^"]{{3000}}'), daemon=True).start()
while worker._proc is None:
    time.sleep(0.05)
time.sleep(0.5)
print(worker._proc.pid, flush=True)
os._exit(0)
""")
    child = int(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60).stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
