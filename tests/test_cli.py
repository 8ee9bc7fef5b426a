"""The CLI: bad input gets one clear line and a non-zero exit, never a traceback."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


HEAD = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "smollm2-135m-eagle3"


def specdec(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["generate", "no-such-model", "--prompt", "hi"], "unknown model"),
    (["generate", "--prompt", "   "], "empty"),
    (["generate", "--prompt", "hi", "--temperature", "5"], "temperature"),
    (["generate", "--prompt", "hi", "--repetition-penalty", "3"], "repetition_penalty"),
    (["generate", "--prompt", "hi", "--frequency-penalty", "-2.5"], "frequency_penalty"),
    (["generate", "--prompt", "hi", "--speculative-config", "{bad json"], "JSON"),
    (["generate", "--prompt", "hi", "--speculative-config", '{"method": "ngram", "bogus": 1}'], "bogus"),
    (["generate", "--prompt", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["generate", "--prompt", "abc\udcff"], "not valid Unicode"),  # argv byte 0xff, not UTF-8 (surrogateescape)
    (["generate", "--prompt", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": "3"}'],
     "must be an integer"),
    (["generate", "--prompt", "hi", "--threads", "-3"], "num_threads"),
    (["generate", "--prompt", "hi", "--max-model-len", "1"], "max_model_len"),
    (["bench", "--methods", "ngram,nope", "--out", "/nonexistent-never-made"], "unknown speculative method 'nope'"),
    (["bench", "--methods", "ngram+suffix", "--out", "/nonexistent-never-made"], "pairs with a lookup"),
    (["bench", "--peers", "vllm", "--out", "/nonexistent-never-made"], "unknown peer"),
    (["bench", "--sweep-k", "two", "--out", "/nonexistent-never-made"], "--sweep-k"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--kv-cache-memory-gb", "-1"], "kv_cache_memory_gb must be > 0"),
    (["serve", "--request-speculative-methods", "ngram,nope"], "unknown speculative method 'nope'"),
    (["bench", "serve", "--concurrency", "0", "--out", "/nonexistent-never-made"], "--concurrency"),
    (["bench", "serve", "--speculative-method", "nope", "--out", "/nonexistent-never-made"], "unknown speculative"),
    (["eval-draft", str(HEAD)], "nothing to evaluate"),
    (["eval-draft", str(HEAD), "--data", "/nonexistent"], "no heldout/ split"),
    (["eval-draft", str(HEAD), "--engine", "--compare", "nope"], "unknown speculative method"),
])
def test_bad_input_one_line(args, needle):
    r = specdec(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bad_paths_and_files_are_one_line(tmp_path):
    """An output path that cannot be a directory fails before any work (bench: not after the whole run);
    a JSON file that is no bench report, and bad training sizes, are one line too."""
    a_file = tmp_path / "file"
    a_file.write_text("{}")
    for args, needle in [
        (["bench", "--methods", "ngram", "--peers", "none", "--out", str(a_file / "report")], "Not a directory"),
        (["bench", "--from-json", str(a_file), "--out", str(tmp_path / "r")], "not a bench report"),
        (["make-draft", "--layers", "2", "--out", str(a_file)], "not an empty directory"),
        # before the model's load and the AWQ search (it wrote into, and over, another model's files)
        (["quantize", "smollm2-135m", "--method", "awq", "--out", str(tmp_path)], "not an empty directory"),
        (["quantize", "smollm2-135m", "--method", "awq", "--out", str(tmp_path / "q"),
          "--calib-file", str(tmp_path / "none")], "--calib-file"),
        (["train", "data", "--out", str(tmp_path / "d"), "--num-prompts", "-1"], "num_prompts must be >= 1"),
        # (it took no held-out split from the head, and wrote data whose held-out prompts that head trained on)
        (["train", "data", "--out", str(tmp_path / "d"), "--teacher-forced", "4", "--heldout-from", str(HEAD)],
         "--heldout-from do not apply to --teacher-forced"),
        (["train", "draft-model", "--data", str(tmp_path), "--out", str(tmp_path / "dm")], "no training sequences"),
    ]:
        r = specdec(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args", [
    ["export", str(HEAD), "--format", "sglang", "--out", "/nonexistent-never-made", "--num-steps", "0"],
    ["quantize", "--scheme", "int4", "--method", "awq", "--awq-grid", "0", "--out", "/nonexistent-never-made"],
    ["advise", "--prompts", "/nonexistent", "--k-max", "0"],
    ["eval-draft", str(HEAD), "--engine", "--prompts", "0"],
    ["train", "data", "--out", "/nonexistent-never-made", "--teacher-forced", "-3"],
    ["train", "eagle3", "--data", "/nonexistent", "--out", "/nonexistent-never-made", "--eval-depth", "0"],
    ["quantize", "--out", "/nonexistent-never-made", "--threads", "-1"],
])
def test_sizes_below_their_minimum_are_usage_errors(args):
    """Counts and sizes parsed with a floor: argparse's usage error (exit 2) before anything runs (they
    wrote nonsense serve commands, divided by zero, or ran with a negative count)."""
    r = specdec(*args, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "must be >= " in r.stderr, r.stderr


def test_prompt_longer_than_context(tmp_path):
    r = specdec("generate", "--max-model-len", "16", "--prompt", "word " * 40)
    assert r.returncode == 2 and "context" in r.stderr and "Traceback" not in r.stderr


def test_generate_json_and_info():
    r = specdec("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--json",
                "--speculative-method", "ngram", "--num-speculative-tokens", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert out["metrics"]["target_forward_passes"] >= 2 and "speculative" in out["metrics"]
    r = specdec("info", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["architecture"] == "llama"


def test_prompt_file_json_and_chat_session(tmp_path):
    """--prompt-file gives one JSON line per prompt; `chat` streams each turn with the chat template and
    keeps the conversation: its first greedy answer is `generate --chat`'s for the same message."""
    f = tmp_path / "prompts.txt"
    f.write_text("The capital of France is\n\nOne, two, three,\n")
    r = specdec("generate", "--prompt-file", str(f), "--max-tokens", "6", "--json", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [o["prompt"] for o in outs] == ["The capital of France is", "One, two, three,"]
    assert all(len(o["token_ids"]) == 6 for o in outs)

    # fp32: the prefix cache reuses rows at any CPU's (bf16 prompt rows are not reused on AMX CPUs)
    one = specdec("generate", "--chat", "--prompt", "Name a color.", "--max-tokens", "10", "--temperature", "0",
                  "--json", "--dtype", "float32")
    expected = json.loads(one.stdout.strip().splitlines()[-1])["text"]
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--max-tokens", "10", "--temperature", "0",
                        "--speculative-method", "ngram", "--dtype", "float32"],
                       input="Name a color.\nAnd another one?\n\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("> " + expected)
    assert r.stdout.count("> ") >= 3 and r.stderr.count(" tok/s; prompt ") == 2  # two answered turns, then the empty line
    second = [line for line in r.stderr.splitlines() if " tok/s; prompt " in line][1]
    assert re.search(r"prompt \d+ tokens, \d+ cached", second)  # the second turn reused the first's prefix


def test_missing_prompt_file_is_one_line(tmp_path):
    r = specdec("generate", "--prompt-file", str(tmp_path / "nope.txt"))
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_freezes_the_start_up_heap():
    """`specdec serve` moves what start-up allocated to the GC's permanent generation (full collections
    then skip it); undone here, not to change the test process."""
    import gc

    from specdec.cli.serve import freeze_heap

    held = [[i] for i in range(1000)]  # tracked containers, alive at "start-up"
    try:
        assert freeze_heap() >= len(held)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in tracked for x in held)  # frozen: no collection scans them
    finally:
        gc.unfreeze()
    assert id(held[0]) in {id(o) for o in gc.get_objects()}


def test_the_cli_stream_holds_back_what_a_stop_string_could_begin(capsys):
    """generate and chat print the decoder's deltas as they come, but not the tail a stop string could
    still begin: the final text is cut where a stop string starts, and what was printed stays its prefix."""
    from specdec.cli._common import StreamPrinter

    stream = StreamPrinter(("END", "x"))
    for piece in ("hello ", "E", "N"):
        stream(piece, [0])
    assert capsys.readouterr().out == "hello "  # "EN" held back: "END" could follow
    stream.finish("hello ")  # "D" came: the decoder cut the text before "END" (passing no delta), nothing more
    assert capsys.readouterr().out == ""
    stream = StreamPrinter(("END",))
    for piece in ("so E", "NOUGH"):
        stream(piece, [0])
    stream.finish("so ENOUGH")
    assert capsys.readouterr().out == "so ENOUGH"
    plain = StreamPrinter(())
    for piece in ("a", "bc"):
        plain(piece, [0])
    plain.finish("abc")
    assert capsys.readouterr().out == "abc"


def test_parsing_the_command_line_does_not_import_torch():
    """Every subcommand's module is imported to build the parser; none may import torch at the top, or a
    usage error (or --help) waits ~2-3 s for it (it did: quantize, train, eval-draft, make-draft)."""
    import subprocess
    import sys

    code = "import sys; from specdec.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on():
    """A line of bytes that are not UTF-8 is refused alone; the session goes on (it ended the session)."""
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--max-tokens", "3", "--temperature", "0",
                        "--dtype", "float32"], input=b"caf\xe9 \xff\nName a color.\n\n", capture_output=True,
                       timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "not valid UTF-8" in err and err.count(" tok/s; prompt ") == 1  # the good line was answered


@pytest.mark.parametrize("args", [
    ["train", "data", "--out", "/nonexistent-never-made", "--threads", "-1"],
    ["eval-draft", str(HEAD), "--engine", "--threads", "-1"],
    ["bench", "--threads", "-2", "--out", "/nonexistent-never-made"],
    ["bench", "serve", "--threads", "-1", "--out", "/nonexistent-never-made"],
])
def test_a_negative_thread_count_is_a_usage_error(args):
    """torch.set_num_threads(-1) raised a RuntimeError traceback (and train's 0 too, which now means all cores)."""
    r = specdec(*args, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "must be >= 0" in r.stderr, r.stderr


def test_a_bench_report_without_its_parts_is_one_line(tmp_path):
    """--from-json checked that runs was an object, then the report's rendering raised a KeyError traceback."""
    for bad in ({"runs": {"float32": {}}}, {"runs": {}}, {"runs": {"float32": {"records": []}}},
                {"config": {}, "environment": {}, "runs": {"float32": {"records": []}}}):
        path = tmp_path / "report.json"
        path.write_text(json.dumps(bad))
        r = specdec("bench", "--from-json", str(path), "--out", str(tmp_path / "r"), timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "not a bench report" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
