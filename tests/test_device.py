"""Device selection; the CUDA path is exercised only where a GPU exists (CI has none)."""
import pytest
import torch

from specdec.config import ConfigError
from specdec.model.loader import resolve_device, resolve_dtype

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_auto_device_and_dtype():
    dev = resolve_device("auto")
    assert dev == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", "cpu") in (torch.float32, torch.bfloat16)


def test_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu")


@cuda
def test_cuda_greedy_speculation_equals_plain(tiny_dir):
    from specdec import LLM, SamplingParams
    d = str(tiny_dir("llama"))
    sp = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(d, device="cuda", dtype="float32", progress=False)
    spec = LLM(d, device="cuda", dtype="float32", progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert plain.generate("one two three one two three", sp)[0].outputs[0].token_ids == \
        spec.generate("one two three one two three", sp)[0].outputs[0].token_ids
