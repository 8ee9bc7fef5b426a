"""A prompt's pass does not depend on how it was cut: prefilled in one pass or in pieces of any size,
its keys, values and logits are bitwise the same (RMSNorm, SwiGLU, the linears and attention run our
kernels at any row count, attention MAX_ROWS rows a call). In fp32 a decoded token's row equals its
prompt-pass row too. This is what makes a reused prefix (the offline prefix cache) exact."""
import os

import pytest
import torch

import specdec.kernels as kernels
from specdec.kernels import MAX_ROWS
from specdec.model.loader import cpu_has_amx, cpu_has_bf16, load_model

from conftest import use_row_count_dependent_linear


@pytest.fixture(autouse=True)
def _need_kernels():
    if kernels._load() is None:
        pytest.skip("kernels unavailable")


def _prefill(model, ids, cuts, cap=400):
    """ids [1, N] prefilled in passes ending at each of `cuts` (then the rest): every pass's logits
    rows concatenated [N, V], and the cache."""
    cache = model.new_cache(cap)
    rows, start = [], 0
    for end in list(cuts) + [ids.shape[1]]:
        out = model(ids[:, start:end], torch.arange(start, end)[None], cache, prefill=True)
        rows.append(out.logits[0])
        start = end
    return torch.cat(rows), cache


def _same(a, b) -> bool:
    (la, ca), (lb, cb) = a, b
    n = ca.length
    return (cb.length == n and torch.equal(la, lb) and torch.equal(ca.k[..., :n, :], cb.k[..., :n, :])
            and torch.equal(ca.v[..., :n, :], cb.v[..., :n, :]))


CUTS = [(37,), (MAX_ROWS,), (MAX_ROWS + 1,), (10, 75, 140), (150,), (1, 2, 3, 100)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_prompt_pass_is_the_same_in_any_pieces(tiny_dir, arch):
    model = load_model(tiny_dir(arch), torch.float32)
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(0))
    whole = _prefill(model, ids, ())
    for cuts in CUTS:
        assert _same(_prefill(model, ids, cuts), whole), cuts


def test_fp32_decoded_rows_equal_prompt_pass_rows(tiny_dir):
    model = load_model(tiny_dir("llama"), torch.float32)
    ids = torch.randint(0, 1000, (1, MAX_ROWS + 40), generator=torch.Generator().manual_seed(1))
    N, P = ids.shape[1], MAX_ROWS + 20
    logits, cache = _prefill(model, ids, ())
    decoded = model.new_cache(400)
    model(ids[:, :P], torch.arange(P)[None], decoded, prefill=True)
    for i in range(P, N):
        last = model(ids[:, i:i + 1], torch.tensor([[i]]), decoded).logits[0, -1]
    assert torch.equal(decoded.k[..., :N, :], cache.k[..., :N, :]) and torch.equal(last, logits[-1])


def test_the_pieces_test_catches_a_row_count_dependent_linear(tiny_dir, monkeypatch):
    """Negative control: the linear as it was (torch's GEMM past MAX_ROWS rows, the kernel below)
    makes a prompt cut at 37 rows differ from one pass."""
    model = load_model(tiny_dir("llama"), torch.float32)
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(0))
    use_row_count_dependent_linear(monkeypatch)
    assert not _same(_prefill(model, ids, (37,)), _prefill(model, ids, ()))


# oneDNN's bf16 GEMM is row-invariant where the CPU has bf16 dot products but no AMX (AMD Zen 4); with AMX
# it sums a row one way at 1-32 rows and another at more (kept_prefix.py: no reuse there)
BF16_ROW_INVARIANT = cpu_has_bf16() and not cpu_has_amx()


@pytest.mark.skipif(not BF16_ROW_INVARIANT, reason="bf16 prompt passes are row-invariant only on bf16 CPUs without AMX")
def test_bf16_prompt_pass_is_the_same_in_any_pieces(tiny_dir):
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    assert model.prefill_matmul_dtype is torch.bfloat16
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(2))
    whole = _prefill(model, ids, ())
    for cuts in CUTS:
        assert _same(_prefill(model, ids, cuts), whole), cuts


def test_real_model_prompt_in_pieces(smollm_dir):
    """SmolLM2-135M, a 300-token prompt: fp32 and (where oneDNN's bf16 GEMM is row-invariant) bf16, cut in two."""
    ids = torch.randint(0, 49000, (1, 300), generator=torch.Generator().manual_seed(3))
    for dtype in [torch.float32] + ([torch.bfloat16] if BF16_ROW_INVARIANT else []):
        model = load_model(smollm_dir, dtype, max_len=512)
        whole = _prefill(model, ids, (), cap=512)
        for cuts in ((37,), (200,)):
            assert _same(_prefill(model, ids, cuts, cap=512), whole), (dtype, cuts)


@pytest.mark.skipif(not cpu_has_amx() or (os.cpu_count() or 1) < 2, reason="needs a CPU with AMX, 2 cores")
def test_onednn_bf16_rows_depend_on_the_row_count_on_amx():
    """Why an AMX CPU's bf16 prompt passes leave oneDNN (quant/bf16.py onednn_prompt_rows_invariant): its bf16
    GEMM gives a row other bits at 64-512 rows than at 900 (2 threads), so a prompt cut in two would not
    equal one pass. If this ever fails, oneDNN became row-invariant here."""
    from specdec.quant.bf16 import onednn_prompt_rows_invariant
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=gen).bfloat16()
    x = torch.randn(900, 576, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the engine runs here (other tests leave 1, where it happened to agree)
    try:
        full = torch.nn.functional.linear(x, w)
        assert any(not torch.equal(torch.nn.functional.linear(x[:n], w), full[:n]) for n in (64, 100, 256, 512))
    finally:
        torch.set_num_threads(threads)
    assert not onednn_prompt_rows_invariant()


@pytest.mark.skipif(not cpu_has_amx(), reason="needs a CPU with AMX")
def test_bf16_prompt_pass_on_amx_tiles_is_the_same_in_any_pieces_and_as_decoded(tiny_dir):
    """With the tiles packed a bf16 prompt's matmuls run on them (not oneDNN): the pass does not depend on
    its cuts, and a decoded token's row equals its prompt-pass row (the kept prefix reuses "all" rows)."""
    from specdec.cache.kept_prefix import reuse_level
    from specdec.quant.bf16 import use_amx_tiles
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    assert model.prefill_matmul_dtype is torch.bfloat16 and reuse_level(model) is None  # oneDNN: no reuse
    assert use_amx_tiles(model, True) > 0
    assert model.prefill_matmul_dtype is None and reuse_level(model) == "all"
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(2))
    whole = _prefill(model, ids, ())
    for cuts in CUTS:
        assert _same(_prefill(model, ids, cuts), whole), cuts
    N, P = ids.shape[1], MAX_ROWS + 20
    decoded = model.new_cache(400)
    model(ids[:, :P], torch.arange(P)[None], decoded, prefill=True)
    for i in range(P, N):
        last = model(ids[:, i:i + 1], torch.tensor([[i]]), decoded).logits[0, -1]
    assert torch.equal(decoded.k[..., :N, :], whole[1].k[..., :N, :]) and torch.equal(last, whole[0][-1])
    use_amx_tiles(model, False)
    assert model.prefill_matmul_dtype is torch.bfloat16  # off the tiles: oneDNN again


@pytest.mark.skipif(not cpu_has_amx(), reason="needs a CPU with AMX")
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
def test_wide_prompt_pass_on_tiles_runs_in_layer_c_as_the_per_op_path(tiny_dir, monkeypatch, paged):
    """A prompt's pass of up to TILE_CALL_ROWS (256) rows whose linears are all on AMX tiles goes through
    layer.c in one call (the per-op path cost 1.2-1.4x its time) and gives the per-op path's logits, keys and
    values bit for bit; a wider one stays on the per-op path."""
    from specdec.cache.paged_cache import BatchKV, PagedKVPool
    from specdec.kernels import layer
    from specdec.quant.bf16 import use_amx_tiles
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    assert use_amx_tiles(model, True) > 0
    ran = []
    real_run = layer._run
    monkeypatch.setattr(layer, "_run", lambda *a, **kw: ran.append(real_run(*a, **kw)) or ran[-1])

    def prompt_pass(n: int):
        ids = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(n))
        if paged:
            pool = PagedKVPool.for_model(model.config, 40, 8, model.dtype)
            cache, kv = BatchKV(pool, [list(range(39, -1, -1))], [0], [n]), pool
        else:
            cache = kv = model.new_cache(320)
        logits = model(ids, torch.arange(n)[None], cache, prefill=True).logits
        return logits, kv.k.clone(), kv.v.clone()

    for n in (MAX_ROWS + 1, 150, 256):
        ran.clear()
        wide = prompt_pass(n)
        assert ran and ran[-1] is not None, n  # layer.c ran the whole stack
        monkeypatch.setattr(layer, "_rows_fit", lambda x, fused, descs, packed: packed or x.shape[0] * x.shape[1] <= MAX_ROWS)
        ran.clear()
        per_op = prompt_pass(n)
        assert ran and ran[-1] is None  # the per-op path
        assert all(torch.equal(a, b) for a, b in zip(wide, per_op)), n
        monkeypatch.undo()
        monkeypatch.setattr(layer, "_run", lambda *a, **kw: ran.append(real_run(*a, **kw)) or ran[-1])
    ran.clear()
    prompt_pass(300)  # past TILE_CALL_ROWS
    assert ran[-1] is None


@pytest.mark.parametrize("invariant", [False, True])
def test_engine_keeps_prompt_passes_row_invariant(tiny_dir, monkeypatch, invariant):
    """The serving engine cuts prompts anywhere (chunked prefill, its prefix cache): where oneDNN's bf16 GEMM
    is not row-invariant it moves the model's prompt matmuls to our kernels; where it is, it leaves them."""
    import specdec.quant.bf16 as bf16
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.llm import LLM
    monkeypatch.setattr(bf16, "onednn_prompt_rows_invariant", lambda: invariant)
    llm = LLM(str(tiny_dir("llama")), dtype="bfloat16", max_model_len=128, progress=False, num_threads=1)
    llm.model.prefill_matmul_dtype = torch.bfloat16  # as the loader sets it on a CPU with bf16 dot products
    Engine(llm, EngineConfig(max_num_seqs=2, num_kv_blocks=32, profile_cost=False))
    assert llm.model.prefill_matmul_dtype is (torch.bfloat16 if invariant else None)


@pytest.mark.slow
def test_real_model_bf16_engine_chunks_equal_offline(smollm_dir, monkeypatch):
    """SmolLM2-135M in bf16 (on AMX tiles where the CPU has them, as `specdec serve` runs): RAG prompts of
    ~450-870 tokens prefilled in chunks of a small token budget beside other rows give LLM.generate's greedy
    tokens, with speculation too. Negative control on an AMX CPU: with oneDNN's prompt matmuls (as before
    session 33) they do not."""
    import specdec.quant.bf16 as bf16
    from specdec.bench.prompts import build_prompts
    from specdec.engine.engine import Engine, EngineConfig, EngineRequest
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams
    llm = LLM("smollm2-135m", dtype="bfloat16", progress=False, enable_prefix_caching=False, amx=cpu_has_amx())
    prompts = [p.token_ids for p in build_prompts(llm.tokenizer, 4, ("rag",))]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def served(speculative=None):
        engine = Engine(llm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=100, profile_cost=False))
        for i, ids in enumerate(prompts):
            engine.add_request(EngineRequest(str(i), ids, params, speculative=speculative))
        got = [[] for _ in prompts]
        while engine.has_unfinished():
            for o in engine.step():
                got[int(o.request_id)].extend(o.token_ids)
        return got

    def offline_and_served():
        return [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts], served()

    want, got = offline_and_served()
    assert got == want
    # drafted tokens take the chunks' token budget: the prompts are cut elsewhere, the outputs stay
    assert served({"method": "ngram", "num_speculative_tokens": 4}) == want
    if cpu_has_amx():
        llm.model.prefill_matmul_dtype = torch.bfloat16
        monkeypatch.setattr(bf16, "onednn_prompt_rows_invariant", lambda: True)  # the engine then keeps oneDNN
        want, got = offline_and_served()
        assert got != want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_pass_in_passes_gives_the_one_pass_rows(tiny_dir, dtype):
    """model.llama.prompt_pass (the offline decoder's prompt): passes of rows_per_pass tokens, put back
    together, give one pass's last logits, hidden states, kept layers and cache, bit for bit. A model on AMX
    tiles asks for TILE_CALL_ROWS a pass (layer.c then takes each whole), another for one pass."""
    from specdec.kernels import TILE_CALL_ROWS
    from specdec.model.llama import prompt_pass
    from specdec.quant.bf16 import use_amx_tiles
    model = load_model(tiny_dir("llama"), dtype)
    tiles = dtype is torch.bfloat16 and use_amx_tiles(model, True) > 0
    assert model.prompt_rows_per_pass() == (TILE_CALL_ROWS if tiles else None)
    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(3))
    start = 20  # a kept prefix of 20 tokens before these
    runs = []
    for rows in (None, 128, 100):
        cache = model.new_cache(400)
        model(ids[:, :start], torch.arange(start)[None], cache, prefill=True)
        out = prompt_pass(model, ids[:, start:], start, cache, output_layers=(0, 1), rows_per_pass=rows)
        runs.append((out, cache))
    (one, c1), *others = runs
    assert one.logits.shape[1] == 1 and one.hidden.shape[1] == 280
    for out, cache in others:
        assert torch.equal(out.logits, one.logits) and torch.equal(out.hidden, one.hidden)
        assert out.layer_hidden.keys() == one.layer_hidden.keys()
        assert all(torch.equal(out.layer_hidden[k], one.layer_hidden[k]) for k in one.layer_hidden)
        assert cache.length == c1.length == 300 and torch.equal(cache.k[..., :300, :], c1.k[..., :300, :])
