"""The CLI: bad input gets one clear line and a non-zero exit, never a traceback."""
import json
import subprocess
import sys

import pytest


def specdec(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["generate", "no-such-model", "--prompt", "hi"], "unknown model"),
    (["generate", "--prompt", "   "], "empty"),
    (["generate", "--prompt", "hi", "--temperature", "5"], "temperature"),
    (["generate", "--prompt", "hi", "--speculative-config", "{bad json"], "JSON"),
    (["generate", "--prompt", "hi", "--speculative-config", '{"method": "ngram", "bogus": 1}'], "bogus"),
    (["generate", "--prompt", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens"),
])
def test_bad_input_one_line(args, needle):
    r = specdec(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


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
