"""FP8 (e4m3) weights through torch._scaled_mm: error bounds, the kernel against its definition, model
conversion, and the FP8 self-draft's lossless output (on the CPU, where _scaled_mm runs exactly)."""
import pytest
import torch

from specdec.config import ConfigError
from specdec.quant.fp8 import E4M3_MAX, FP8, Fp8Scheme, Fp8Weight, quantize_fp8
from specdec.quant.qmodel import quantize_model


def test_quantize_error_is_within_e4m3_rounding():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scales
    w[5] = 0.0
    q, s = quantize_fp8(w)
    assert q.dtype == FP8 and s.shape == (64,) and s[5] == 1.0
    deq = q.float() * s[:, None]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal values; the subnormal step is 2^-9 * s
    bound = torch.maximum(w.abs() * 2.0**-4, 2.0**-10 * s[:, None])
    assert (deq - w).abs().le(bound).all()
    assert deq.abs().amax(1).sub(w.abs().amax(1)).abs().le(1e-6 * w.abs().amax(1)).all()  # amax is exact


def test_a_row_too_small_for_a_scale_is_not_nan():
    w = torch.zeros(2, 32)
    w[0, 3], w[1, 0] = 1e-43, 1.0  # 1e-43 / 448 underflows to 0: a zero scale made the row NaN
    q, s = quantize_fp8(w)
    assert s[0] == 1.0 and not q.float().isnan().any()


def test_linear_equals_its_definition():
    """y = sx[t] * sw[n] * <xq[t], Wq[n]> (+ bias), with xq the per-token e4m3 activations."""
    torch.manual_seed(1)
    w, b, x = torch.randn(48, 64) * 0.05, torch.randn(48), torch.randn(2, 3, 64)
    x[0, 1] = 0.0  # an all-zero token
    fw = Fp8Weight.from_float(w)
    y = fw.linear(x, b)
    x2 = x.reshape(-1, 64)
    sx = x2.abs().amax(1, keepdim=True) / E4M3_MAX
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = (x2 / sx).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).float()
    want = (xq @ fw.qweight.float().t()) * sx * fw.scales[None, :] + b
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y.reshape(-1, 48), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=0.1, atol=0.05)  # ~FP8 error


def test_rows_and_shape_checks():
    w = torch.randn(32, 16)
    fw = Fp8Weight.from_float(w)
    assert torch.equal(fw.rows(torch.tensor([[3, 0]])), fw.dequantize()[[3, 0]][None])
    with pytest.raises(ConfigError):
        Fp8Weight(w, torch.ones(32))  # not e4m3
    with pytest.raises(ConfigError):
        quantize_fp8(torch.randn(3, 4, 5))


def test_quantize_model_fp8(tiny_dir):
    from specdec.model.loader import load_model

    ref = load_model(tiny_dir("llama"), torch.float32)
    model = quantize_model(load_model(tiny_dir("llama"), torch.float32), Fp8Scheme(), head=Fp8Scheme())
    assert isinstance(model.layers[0].qkv.weight, Fp8Weight) and isinstance(model.lm_head.weight, Fp8Weight)
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = ref(ids, torch.arange(12)[None], ref.new_cache(16)).logits
        b = model(ids, torch.arange(12)[None], model.new_cache(16)).logits
    rel = (b - a).abs().mean() / a.abs().mean()
    assert 0 < rel < 0.1, rel  # really quantized, and close to fp32 (a random model: flat logits, so
    # argmax agreement says little; the FP8 self-draft test below checks that drafts get accepted)


def test_fp8_self_draft_greedy_equals_plain(tiny_dir):
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    plain = LLM(str(tiny_dir("llama")), progress=False)
    spec = LLM(str(tiny_dir("llama")), progress=False,
               speculative_config={"method": "qdraft", "num_speculative_tokens": 3,
                                   "extra": {"scheme": "fp8", "lm_head": "fp8"}})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in ([1, 2, 3, 4], [7, 7, 9, 11, 5]):
        got = spec.generate_one(prompt, params)
        assert got.token_ids == plain.generate_one(prompt, params).token_ids
        assert got.metrics.num_accepted_tokens > 0  # the FP8 copy drafts what the target says


def test_save_and_load_round_trip(tiny_dir, tmp_path):
    from specdec.model.loader import load_model
    from specdec.quant.io import save_quantized

    src = tiny_dir("llama")
    model = quantize_model(load_model(src, torch.float32), Fp8Scheme(), head=Fp8Scheme())
    out = save_quantized(model, src, tmp_path / "fp8", Fp8Scheme(), Fp8Scheme(), "rtn")
    with pytest.warns(UserWarning, match="fp8 is for GPUs"):
        back = load_model(out, torch.float32)
    for a, b in ((model.layers[1].gate_up.weight, back.layers[1].gate_up.weight), (model.lm_head.weight, back.lm_head.weight)):
        assert isinstance(b, Fp8Weight)
        assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(ids, torch.arange(9)[None], model.new_cache(12)).logits
        got = back(ids, torch.arange(9)[None], back.new_cache(12)).logits
    assert torch.equal(got, want)


def test_cli_quantize_fp8(tiny_dir, tmp_path):
    from specdec.cli import main

    out = tmp_path / "q"
    assert main(["quantize", str(tiny_dir("llama")), "--scheme", "fp8", "--lm-head", "fp8", "--out", str(out)]) == 0
    assert (out / "model.safetensors").exists()
    assert main(["quantize", str(tiny_dir("llama")), "--scheme", "fp8", "--method", "awq", "--out", str(tmp_path / "r")]) == 2


def test_quality_report_variants_include_fp8():
    from specdec.quant.evaluate import parse_variants

    names = [(v.name, type(v.scheme).__name__) for v in parse_variants("int8-g128,int4-g32-awq,fp8")]
    assert names == [("fp32", "NoneType"), ("int8-g128-sym rtn", "QuantScheme"), ("int4-g32 awq", "QuantScheme"),
                     ("fp8-e4m3 rtn", "Fp8Scheme")]


def test_old_gpus_get_a_clear_error(monkeypatch):
    from specdec.quant import fp8

    fp8.check_cuda_fp8.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100")
    with pytest.raises(ConfigError, match="8.9"):
        fp8.check_cuda_fp8(0)
    fp8.check_cuda_fp8.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    fp8.check_cuda_fp8(0)  # Hopper: fine
    fp8.check_cuda_fp8.cache_clear()


def test_cli_warns_in_one_line_on_a_cpu(tiny_dir, tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "q"
    assert main(["quantize", str(tiny_dir("llama")), "--scheme", "fp8", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "hi", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "specdec: warning:" in err and "fp8 is for GPUs" in err and "warnings.warn" not in err


def test_quality_report_variants_say_what_they_run():
    """'int4-awq' ran RTN under an RTN label (awq was looked for after a group only); 'fp8-g128-awq' reached
    AWQ's int-group search; an unknown suffix was ignored."""
    from specdec.config import ConfigError
    from specdec.quant.evaluate import parse_variants

    assert [v.name for v in parse_variants("int4-awq,int8")][1:] == ["int4-g128 awq", "int8-g128-sym rtn"]
    for bad in ("fp8-g128-awq", "fp8-awq", "int4-g32-gptq", "int8-x"):
        with pytest.raises(ConfigError):
            parse_variants(bad)
