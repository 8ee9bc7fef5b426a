"""kv_cache_dtype="bfloat16": the caches store keys and values in bf16 (rounded once, when written; read back
widened exactly), the offline decoder's static caches and the engine's paged pool alike. It is a precision
choice like dtype: speculative decoding must still equal plain decoding under it, token for token."""
from __future__ import annotations

import pytest
import torch

from specdec.cache.paged_cache import PagedKVPool
from specdec.config import ConfigError
from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.kernels import attention
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS, drain_engine

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def tiny(tiny_dir, spec=None, kv="bfloat16") -> LLM:
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=256, progress=False, num_threads=1,
               speculative_config=spec, kv_cache_dtype=kv)


def test_unknown_kv_cache_dtype_is_a_config_error(tiny_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        tiny(tiny_dir, kv="fp8")


def test_bf16_caches_halve_the_bytes_and_hold_rounded_values(tiny_dir):
    llm = tiny(tiny_dir)
    assert llm.info()["kv_cache_dtype"] == "bfloat16" and tiny(tiny_dir, kv="auto").info()["kv_cache_dtype"] == "float32"
    cache = llm.model.new_cache(32)
    assert cache.k.dtype is torch.bfloat16
    cfg = llm.model.config
    assert 2 * PagedKVPool.bytes_per_block(cfg, 16, torch.bfloat16) == PagedKVPool.bytes_per_block(cfg, 16, torch.float32)
    prompt = llm.tokenizer.encode(CHAT_PROMPTS[0])
    llm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    assert cache.k[:, :, :, :len(prompt)].abs().sum() > 0  # the prompt pass wrote into the bf16 cache


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "model": "self", "num_speculative_tokens": 4},
                                  {"method": "layerskip", "num_speculative_tokens": 3}])
def test_greedy_speculation_equals_plain_decoding_over_a_bf16_cache(tiny_dir, spec):
    spec = {**spec, "model": str(tiny_dir("llama"))} if spec.get("model") == "self" else spec
    plain, drafting = tiny(tiny_dir), tiny(tiny_dir, spec)
    for text in CHAT_PROMPTS:
        want = plain.generate(text, GREEDY)[0].outputs[0].token_ids
        out = drafting.generate(text, GREEDY)[0].outputs[0]
        assert out.token_ids == want
    assert out.metrics["speculative"]["num_accepted_tokens"] > 0  # verify passes did run


def test_engine_over_a_bf16_pool_equals_offline_plain_decoding(tiny_dir):
    plain = tiny(tiny_dir)
    llm = tiny(tiny_dir, {"method": "draft_model", "model": str(tiny_dir("llama")), "num_speculative_tokens": 3})
    calls, build = [], attention.PagedAttention.build
    engine = Engine(llm, EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, block_size=8))
    assert engine.pool.k.dtype is torch.bfloat16
    reqs = [EngineRequest(str(i), llm.tokenizer.encode(t), GREEDY) for i, t in enumerate(CHAT_PROMPTS)]
    for r in reqs:
        engine.add_request(r)
    try:
        attention.PagedAttention.build = classmethod(lambda cls, *a: calls.append(build(*a)) or calls[-1])
        got, drafted = drain_engine(engine)  # no KV block left in use
    finally:
        attention.PagedAttention.build = build
    assert calls and all(c is not None and c.kv_bf16 for c in calls)  # the C kernel read the bf16 pool
    assert drafted > 0
    for r in reqs:
        assert got[r.request_id] == plain.generate({"prompt_token_ids": r.prompt_ids}, GREEDY)[0].outputs[0].token_ids


def test_real_model_speculation_over_a_bf16_cache_equals_plain():
    """SmolLM2-135M in bf16 (on AMX tiles where the CPU has them) with bf16 caches: EAGLE-3 with the n-gram
    lookup, offline and in the engine, gives plain decoding's tokens."""
    kw = dict(dtype="bfloat16", max_model_len=512, progress=False, num_threads=2, kv_cache_dtype="bfloat16", amx=True)
    plain = LLM("smollm2-135m", **kw)
    spec = LLM("smollm2-135m", speculative_config={"method": "eagle3", "lookup": "ngram"}, **kw)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in CHAT_PROMPTS[1:]]
    want = [plain.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    outs = [spec.generate(p, params)[0].outputs[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics["speculative"]["num_accepted_tokens"] for o in outs) > 20
    engine = Engine(spec, EngineConfig(max_num_seqs=2, block_size=16))
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), spec.tokenizer.encode(p), params))
    got, _ = drain_engine(engine)
    assert [got[str(i)] for i in range(len(prompts))] == want


def test_every_command_passes_its_kv_cache_dtype_on(tiny_dir, capsys):
    """serve's engine, generate/info's LLM (make_llm) and the offline bench's models keep bf16 caches when asked
    (advise: tests/test_bench.py); a name outside the choices is refused before anything loads."""
    from specdec.bench.harness import BenchConfig, _cached_loader
    from specdec.cli import main
    from specdec.cli.serve import kv_cache_summary
    from tests.server_util import ThreadServer

    srv = ThreadServer(str(tiny_dir("llama")), "--dtype", "float32", "--threads", "1", "--max-model-len", "128",
                       "--kv-cache-dtype", "bfloat16")
    try:
        assert srv.engine.pool.k.dtype is torch.bfloat16
        line = kv_cache_summary(srv.engine)  # what serve prints at start
        blocks = srv.engine.blocks
        assert line.startswith(f"KV cache: {blocks.num_blocks} blocks of {blocks.block_size} tokens") and "bfloat16" in line
    finally:
        srv.stop()
    assert main(["info", str(tiny_dir("llama")), "--dtype", "float32", "--kv-cache-dtype", "bfloat16"]) == 0
    assert "kv_cache_dtype: bfloat16" in capsys.readouterr().out
    model = _cached_loader(torch.float32, 128, False, "bfloat16")(str(tiny_dir("llama")))[0]
    assert model.new_cache(8).k.dtype is torch.bfloat16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        BenchConfig(kv_cache_dtype="half")
