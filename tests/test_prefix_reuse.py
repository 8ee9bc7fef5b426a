"""The offline prefix cache (specdec/cache/kept_prefix.py): a request that shares a prompt prefix with the
previous one prefills only the rest, and its output and logprobs are bitwise those of a cold run, for
plain decoding and every drafter, through a chat's next turn (the earlier answer reused), a branch-off,
a repeat and a cache that must grow; only where that is exact (reuse_level), with a negative control."""
import pytest
import torch

import specdec.kernels as kernels
from specdec import SamplingParams
from specdec.cache.kept_prefix import MIN_REUSE, reuse_level
from specdec.kernels import MAX_ROWS
from specdec.llm import LLM
from specdec.model.loader import cpu_has_amx, cpu_has_bf16, load_model
from specdec.quant.qmodel import quantize_model
from specdec.quant.schemes import QuantScheme
from specdec.spec.decoder import SpeculativeDecoder

from conftest import use_row_count_dependent_linear

BASE = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat near the door. "
        "A river runs through the valley, and the birds sing in the tall trees every single morning. ")


@pytest.fixture(autouse=True)
def _need_kernels():
    if kernels._load() is None:
        pytest.skip("kernels unavailable")


def _params(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def _requests(tok, first_output=None):
    """(prompt ids, max_tokens) of a session: a prompt, its next turn (with the first answer), a
    branch-off from the middle, the same again, and the same with room past the kept cache's."""
    base = tok.encode(BASE * 2)
    turn = base + (first_output or []) + tok.encode(" And then what happened next?")
    branch = base[:MAX_ROWS + 7] + tok.encode(" Meanwhile, far away, a ship set sail.")
    return [(base, 20), (turn, 20), (branch, 12), (branch, 12), (branch, 60)]


def _session(decoder, tok):
    first = decoder.generate(_requests(tok)[0][0], _params(20))
    results = [first]
    for ids, n in _requests(tok, first.token_ids)[1:]:
        results.append(decoder.generate(ids, _params(n)))
    return results


def _pair(llm_):
    """The LLM's decoder (prefix caching on) and a cold one over the same model and proposer."""
    cold = SpeculativeDecoder(llm_.model, llm_.tokenizer, llm_.proposer, llm_.speculative_config)
    assert llm_.decoder.prefix is not None and cold.prefix is None
    return llm_.decoder, cold


def _equal_runs(warm_results, cold_results):
    for w, c in zip(warm_results, cold_results):
        assert w.token_ids == c.token_ids
        assert w.logprobs == c.logprobs  # bitwise: the reused rows are the cold pass's


METHODS = [None, "ngram", "suffix", "layerskip", "lookahead", "recycle"]


@pytest.mark.parametrize("method", METHODS)
def test_reuse_equals_cold_tiny(tiny_dir, method):
    spec = None if method is None else {"method": method, "num_speculative_tokens": 4}
    llm_ = LLM(str(tiny_dir("llama")), speculative_config=spec, dtype="float32", progress=False)
    warm, cold = _pair(llm_)
    warm_results = _session(warm, llm_.tokenizer)
    _equal_runs(warm_results, _session(cold, llm_.tokenizer))
    cached = [r.num_cached_tokens for r in warm_results]
    assert cached[0] == 0 and all(c >= MIN_REUSE for c in cached[1:]), cached
    # the first answer's rows were reused too (recycle's: an accepted tree path, tests/test_tree_rows.py)
    assert cached[1] > len(_requests(llm_.tokenizer)[0][0])
    assert cached[3] == len(_requests(llm_.tokenizer)[3][0]) - 1  # a repeat reuses all but the last token


def test_reuse_off_when_asked(tiny_dir):
    llm_ = LLM(str(tiny_dir("llama")), dtype="float32", progress=False, enable_prefix_caching=False)
    assert llm_.decoder.prefix is None and llm_.info()["prefix_caching"] is None
    ids, n = _requests(llm_.tokenizer)[0]
    outs = [llm_.generate({"prompt_token_ids": ids}, _params(n))[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_n_samples_reuse_their_prompt(tiny_dir):
    llm_ = LLM(str(tiny_dir("llama")), dtype="float32", progress=False)
    ids, _ = _requests(llm_.tokenizer)[0]
    params = SamplingParams(temperature=0.8, max_tokens=8, n=3, seed=5)
    warm = llm_.generate({"prompt_token_ids": ids}, params)[0]
    cold = LLM(str(tiny_dir("llama")), dtype="float32", progress=False, enable_prefix_caching=False)
    assert [o.token_ids for o in warm.outputs] == [o.token_ids for o in cold.generate({"prompt_token_ids": ids}, params)[0].outputs]
    assert [o.metrics["cached_prompt_tokens"] for o in warm.outputs] == [0, len(ids) - 1, len(ids) - 1]


def test_a_failed_request_drops_the_kept_cache(tiny_dir):
    llm_ = LLM(str(tiny_dir("llama")), dtype="float32", progress=False)
    warm, cold = _pair(llm_)
    ids, n = _requests(llm_.tokenizer)[0]
    warm.generate(ids, _params(n))

    def fail(delta, toks):
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        warm.generate(ids, _params(n), on_delta=fail)
    again = warm.generate(ids, _params(n))
    assert again.num_cached_tokens == 0  # the interrupted request's cache was not kept
    assert again.logprobs == cold.generate(ids, _params(n)).logprobs


def test_reuse_levels(tiny_dir):
    assert reuse_level(load_model(tiny_dir("llama"), torch.float32)) == "all"
    assert reuse_level(load_model(tiny_dir("qwen3"), torch.float32)) is None  # q/k norm: torch's attention
    assert reuse_level(quantize_model(load_model(tiny_dir("llama"), torch.float32), QuantScheme(8, 32, True))) is None
    bf16 = load_model(tiny_dir("llama"), torch.bfloat16)  # oneDNN's bf16 GEMM is row-invariant only without AMX
    assert reuse_level(bf16) == ("prompt" if cpu_has_bf16() and not cpu_has_amx() else None)


def test_the_session_test_catches_rows_that_depend_on_the_pass(tiny_dir, monkeypatch):
    """Negative control: the linear as it was (torch's GEMM past MAX_ROWS rows, our kernel below, so a
    decoded row differs from its prompt-pass row) makes the reused session differ from the cold one."""
    llm_ = LLM(str(tiny_dir("llama")), dtype="float32", progress=False)
    warm, cold = _pair(llm_)
    use_row_count_dependent_linear(monkeypatch)
    warm_results, cold_results = _session(warm, llm_.tokenizer), _session(cold, llm_.tokenizer)
    assert any(w.logprobs != c.logprobs for w, c in zip(warm_results, cold_results))


def test_reuse_equals_cold_real_model(smollm_dir):
    """SmolLM2-135M: plain and an EAGLE-3 tree (features of the computed rows only; the earlier answer's
    accepted tree paths reused) in fp32, plain in bf16 where the CPU has bf16 dot products (prompt rows
    only)."""
    runs = [("float32", None), ("float32", {"method": "eagle3", "eagle_topk": 2, "num_steps": 3})]
    runs += [("bfloat16", None)] if cpu_has_bf16() and not cpu_has_amx() else []
    for dtype, spec in runs:
        llm_ = LLM(str(smollm_dir), speculative_config=spec, dtype=dtype, progress=False, max_model_len=1024)
        warm, cold = _pair(llm_)
        warm_results = _session(warm, llm_.tokenizer)
        _equal_runs(warm_results, _session(cold, llm_.tokenizer))
        assert all(r.num_cached_tokens >= MIN_REUSE for r in warm_results[1:]), (dtype, spec)
        if dtype == "float32":  # decoded rows kept: the second request reuses the first one's answer
            assert warm_results[1].num_cached_tokens > len(_requests(llm_.tokenizer)[0][0]), spec


def test_engine_prompt_rows_do_not_depend_on_its_chunking(tiny_dir):
    """The serving engine prefills a prompt in chunks of max_num_batched_tokens (and a paged pass wider
    than PAGED_ROWS in column groups): the logprobs are bitwise the same at every chunk size, and the
    same as the offline decoder's."""
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    llm_ = LLM(str(tiny_dir("llama")), dtype="float32", progress=False, max_model_len=512,
               enable_prefix_caching=False)
    ids = llm_.tokenizer.encode(BASE * 3)[:300]
    params = _params(12)
    want = llm_.decoder.generate(ids, params).logprobs
    for chunk in (16, 100, 300):
        engine = Engine(llm_, EngineConfig(max_num_seqs=2, max_num_batched_tokens=chunk, block_size=16))
        engine.add_request(EngineRequest("r", ids, params))
        got = []
        while engine.has_unfinished():
            for o in engine.step():
                got += o.logprobs or []
        assert got == want, chunk
