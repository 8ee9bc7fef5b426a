"""`dtype=bfloat16` on a CPU: bf16 weights, fp32 activations and sums (specdec/quant/bf16.py).

Without bf16 dot products its only rounding is the weights': the model equals the fp32 model over
bf16-rounded weights. Where the CPU has them every matmul's input is rounded to bf16 too (a prompt's
layer matmuls also their outputs); plain and speculative decoding, single requests and the serving engine
share it, and every speculative method reproduces its own plain greedy decoding token for token.
"""
import pytest
import torch

from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.kernels import amx_active
from specdec.llm import LLM
from specdec.model.loader import cpu_has_amx, cpu_has_bf16, load_model
from specdec.quant.bf16 import Bf16Weight, set_bf16_inputs
from specdec.quant.qmodel import LAYER_LINEARS, describe
from specdec.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add("]


def _need_amx(amx: bool) -> None:
    if amx and not amx_active():
        pytest.skip("no AMX tiles on this CPU")


def _rounded_fp32(directory):
    """The fp32 model with every matrix the bf16 model stores in bf16 rounded to bf16 (and widened back)."""
    model = load_model(directory, torch.float32)
    with torch.no_grad():
        for layer in model.layers:
            for name in LAYER_LINEARS:
                w = getattr(layer, name).weight
                w.copy_(w.bfloat16().float())
        model.lm_head.weight.copy_(model.lm_head.weight.bfloat16().float())  # tied: the embedding too
    return model


def _passes(model):
    """Logits of a 6-token prefill, two single-token steps and a 4-token verify-shaped block."""
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(32)
    out = [model(ids[:, :6], torch.arange(6)[None], cache).logits]
    for i in (6, 7):
        out.append(model(ids[:, i:i + 1], torch.tensor([[i]]), cache).logits)
    out.append(model(ids[:, 8:12], torch.arange(8, 12)[None], cache).logits)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cpu_bf16_model_is_the_fp32_model_over_rounded_weights(tiny_dir, arch):
    """With fp32 matmul inputs (a CPU without bf16 dot products)."""
    bf16 = load_model(tiny_dir(arch), torch.bfloat16)
    set_bf16_inputs(bf16, False)
    assert all(isinstance(getattr(layer, n).weight, Bf16Weight) for layer in bf16.layers for n in LAYER_LINEARS)
    assert isinstance(bf16.lm_head.weight, Bf16Weight) and describe(bf16) == "bf16"
    assert bf16.dtype is torch.float32  # activations and KV cache
    want = _passes(_rounded_fp32(tiny_dir(arch)))
    got = _passes(bf16)
    for a, b in zip(got, want):
        assert a.dtype is torch.float32
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # and it is not the unrounded fp32 model (the comparison above can tell them apart)
    fp32 = _passes(load_model(tiny_dir(arch), torch.float32))
    assert max((a - b).abs().max().item() for a, b in zip(got, fp32)) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_inputs_are_rounded_alike_at_any_row_count(tiny_dir, arch):
    """With bf16 matmul inputs (the loader's choice where the CPU has bf16 dot products): blocks of 1, 5 and
    8 tokens (the C kernels: bf16 dot products, or rounded inputs widened on other CPUs) give bitwise the
    same logits, and those of one 70-token pass (more rows than layer.c takes: the per-op path, torch's
    attention) up to summation order and the rounding flips it causes: several times closer than the
    same long pass without the rounding (the negative control)."""
    model = load_model(tiny_dir(arch), torch.bfloat16)
    assert set_bf16_inputs(model, True) == 4 * len(model.layers) + 1  # every layer linear and the LM head
    ids = torch.randint(0, 1000, (1, 70), generator=torch.Generator().manual_seed(2))

    def logits(blocks, rounded_long_pass=True):
        cache = model.new_cache(80)
        out = []
        for start in range(0, 70, blocks):
            set_bf16_inputs(model, blocks < 70 or rounded_long_pass)
            out.append(model(ids[:, start:start + blocks], torch.arange(start, min(start + blocks, 70))[None],
                             cache).logits)
        return torch.cat(out, dim=1)

    blocks = logits(8)
    assert torch.equal(logits(1), blocks) and torch.equal(logits(5), blocks)
    rounded_gap = (blocks - logits(70)).abs().mean().item()
    unrounded_gap = (blocks - logits(70, rounded_long_pass=False)).abs().mean().item()
    assert rounded_gap < 0.4 * unrounded_gap, (rounded_gap, unrounded_gap)


def test_loader_rounds_inputs_where_the_cpu_has_bf16_dot_products(tiny_dir):
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    weights = [m for m in model.modules() if isinstance(m, Bf16Weight)]
    assert weights and all(w.round_inputs == cpu_has_bf16() for w in weights)


def test_cpu_bf16_weights_take_half_the_bytes(tiny_dir):
    from specdec.quant.qmodel import weight_bytes
    fp32, bf16 = load_model(tiny_dir("llama"), torch.float32), load_model(tiny_dir("llama"), torch.bfloat16)
    assert weight_bytes(bf16) < 0.52 * weight_bytes(fp32)


def test_prompt_pass_rounds_its_matmuls_to_bf16(tiny_dir):
    """forward(prefill=True) on a bf16 model rounds its layer matmuls to bf16: close to the fp32 pass and
    not equal to it. The loader asks for it where the CPU has bf16 dot products; fp32 never does."""
    assert load_model(tiny_dir("llama"), torch.float32).prefill_matmul_dtype is None
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    assert (model.prefill_matmul_dtype is torch.bfloat16) == cpu_has_bf16()
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(1))

    def prompt_logits(prefill):
        return model(ids, torch.arange(24)[None], model.new_cache(32), num_logits=1, prefill=prefill).logits

    exact = prompt_logits(False)
    model.prefill_matmul_dtype = None
    assert torch.equal(prompt_logits(True), exact)  # nothing asked, nothing changes
    model.prefill_matmul_dtype = torch.bfloat16
    rounded = prompt_logits(True)
    gap = (rounded - exact).abs().max().item()
    assert 1e-5 < gap < 0.05 * exact.std().item(), gap


@pytest.mark.skipif(cpu_has_amx(), reason="oneDNN's bf16 GEMM on AMX sums a row one way at 1-32 rows and another "
                    "at more: no prefix reuse there (specdec/cache/kept_prefix.py)")
def test_prompt_matmul_rows_do_not_depend_on_the_row_count():
    """What the prompt pass's bf16 matmul is kept for: a row's result is bitwise the same whether 1, 37,
    64, 65 or 700 rows went in (rounded_linear: oneDNN's bf16 GEMM). The RMSNorm, SiLU and attention
    around it switch kernels with the row count (README), so this is the matmul's property alone."""
    from specdec.model.layers import rounded_linear
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(700, 576, generator=gen)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    full = rounded_linear(x, w, None, torch.bfloat16)
    for rows in (1, 37, 64, 65, 300):
        assert torch.equal(rounded_linear(x[:rows].clone(), w, None, torch.bfloat16), full[:rows]), rows


@pytest.mark.parametrize("amx", [False, True], ids=["vdpbf16ps", "amx"])
def test_engine_prompt_chunks_and_recomputed_outputs_run_apart(tiny_dir, amx):
    """The serving engine with bf16 prompt passes, chunked prefill and preemption by recompute: a chunk is
    all prompt (bf16 matmuls) or all recomputed output (fp32, as decoded), never both; greedy outputs
    equal single-request decoding (with decode passes on AMX tiles too)."""
    _need_amx(amx)
    llm = LLM(str(tiny_dir("llama")), dtype="bfloat16", max_model_len=160, progress=False, num_threads=1, amx=amx)
    assert llm.amx == amx
    llm.model.prefill_matmul_dtype = torch.bfloat16
    set_bf16_inputs(llm.model, True)  # as on a CPU with bf16 dot products (emulated elsewhere)
    engine = Engine(llm, EngineConfig(max_num_seqs=6, max_num_batched_tokens=16, block_size=8, num_kv_blocks=21))
    seen = []  # per prefill forward: its rows' (kind, first token, end, prompt length)
    real_run = engine.runner.run

    def run(rows, all_logits, **kw):
        if not all_logits:
            seen.append([(r.in_prompt, r.seq.num_computed, r.seq.num_computed + r.num_new, len(r.seq.prompt_ids))
                         for r in rows])
        return real_run(rows, all_logits, **kw)
    engine.runner.run = run
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["The cat sat on the mat. The cat sat on the", "Hello world, hello world, hello", "1 2 3 4 5 6 7 8",
               "a", "Once upon a time there was a little robot who loved to count: one, two, three,", "x y z x y"]
    reqs = [EngineRequest(str(i), llm.tokenizer.encode(t), params) for i, t in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_used == 0
    rows = [row for forward in seen for row in forward]
    assert all(len({kind for kind, *_ in forward}) == 1 for forward in seen)  # one kind per forward
    assert not any(start < prompt < end for _, start, end, prompt in rows)  # no chunk crosses the prompt's end
    assert {True, False} == {kind for kind, *_ in rows}  # both kinds ran
    for r in reqs:
        assert got[r.request_id] == llm.generate({"prompt_token_ids": r.prompt_ids}, params)[0].outputs[0].token_ids


@pytest.mark.parametrize("amx", [False, True], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("method", [{"method": "ngram", "num_speculative_tokens": 4},
                                    {"method": "qdraft", "num_speculative_tokens": 3},
                                    {"method": "suffix"}], ids=["ngram", "qdraft", "suffix"])
def test_bf16_speculation_equals_bf16_plain_greedy(tiny_dir, method, amx):
    _need_amx(amx)
    d = str(tiny_dir("llama"))
    plain = LLM(d, dtype="bfloat16", progress=False, amx=amx)
    spec = LLM(d, dtype="bfloat16", progress=False, speculative_config=method, amx=amx)
    for llm in (plain, spec):  # bf16 matmul inputs, as on a CPU with native bf16 (emulated elsewhere)
        llm.model.prefill_matmul_dtype = torch.bfloat16
        set_bf16_inputs(llm.model, True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        a, b = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.metrics["speculative"]["num_drafts"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("amx", [False, True], ids=["vdpbf16ps", "amx"])
def test_bf16_real_model_speculation_equals_plain(smollm_llm, amx):
    """The real default model in bf16: qdraft+ngram (an int4 copy of the bf16 target) reproduces bf16 plain
    decoding, with every decode and verify pass on vdpbf16ps or on AMX tiles."""
    _need_amx(amx)
    plain = LLM("smollm2-135m", dtype="bfloat16", progress=False, amx=amx)
    info = plain.info()
    assert (info["dtype"], info["weights"], info["activations"]) == ("bfloat16", "bf16", "float32")
    assert info["prefill_matmuls"] == info["matmul_inputs"] == ("bfloat16" if cpu_has_bf16() else "float32")
    assert info["amx_tiles"] == amx
    spec = LLM("smollm2-135m", dtype="bfloat16", progress=False, amx=amx,
               speculative_config={"method": "qdraft", "lookup": "ngram", "num_speculative_tokens": 4})
    tok = plain.tokenizer
    params = SamplingParams(temperature=0, max_tokens=48)
    for content in ["Explain in three sentences why the sky is blue.", "Write a Python function that reverses a list."]:
        prompt = tok.apply_chat_template([{"role": "user", "content": content}])
        a, b = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.metrics["speculative"]["acceptance_rate"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_bf16_learned_heads_read_the_packed_target(method):
    """The shipped heads on a bf16 target: embeddings and LM-head rows come from the bf16 weights. A
    fixed k: adaptive k may rightly leave a weak head off for a whole short answer."""
    plain = LLM("smollm2-135m", dtype="bfloat16", progress=False)
    spec = LLM("smollm2-135m", dtype="bfloat16", progress=False,
               speculative_config={"method": method, "num_speculative_tokens": 3})
    prompt = plain.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors of the rainbow."}])
    params = SamplingParams(temperature=0, max_tokens=32)
    a, b = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.metrics["speculative"]["num_drafts"] > 0
