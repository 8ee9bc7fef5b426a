"""Quantized models: conversion, save/load round trip through the ordinary loader, AWQ scale folding,
and the `specdec quantize` command."""
import json

import pytest
import torch

from specdec import SamplingParams
from specdec.cli import main as cli_main
from specdec.config import ConfigError
from specdec.llm import LLM
from specdec.model.loader import load_model
from specdec.model.tokenizer import Tokenizer
from specdec.quant.awq import apply_awq, collect_inputs, search_scale
from specdec.quant.io import save_quantized
from specdec.quant.qlinear import QEmbedding, QLinear, QuantizedWeight
from specdec.quant.qmodel import describe, quantize_model, quantized_copy, weight_bytes
from specdec.quant.schemes import QuantScheme, dequantize, quantize

INT4, INT8 = QuantScheme(4, 32, False), QuantScheme(8, 32, True)


def logits_of(model, ids):
    cache = model.new_cache(len(ids) + 1)
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0]


def greedy_ids(model, ids, n=8):
    """n greedy tokens, one-token decode steps (the kernel path)."""
    cache = model.new_cache(len(ids) + n)
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, num_logits=1).logits[0, -1]
    toks = [int(out.argmax())]
    for _ in range(n - 1):
        out = model(torch.tensor([[toks[-1]]]), torch.tensor([[cache.length]]), cache).logits[0, -1]
        toks.append(int(out.argmax()))
    return toks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", [INT4, INT8], ids=lambda s: s.name)
def test_save_load_round_trip(tiny_dir, tmp_path, arch, scheme):
    src = tiny_dir(arch)
    model = quantize_model(load_model(src, torch.float32), scheme)
    out = save_quantized(model, src, tmp_path / "q", scheme, INT8, "rtn")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == scheme.bits
    loaded = load_model(out, torch.float32)  # the ordinary loader recognises the directory
    assert isinstance(loaded.layers[0].qkv, QLinear) and isinstance(loaded.embed, QEmbedding)
    assert loaded.lm_head.weight is loaded.embed.weight  # tied, stored once
    sd_a, sd_b = model.state_dict(), loaded.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    ids = list(range(5, 25))
    assert torch.equal(logits_of(model, ids), logits_of(loaded, ids))
    assert Tokenizer(out).encode("hello") == Tokenizer(src).encode("hello")
    # bf16 (what dtype "auto" picks on a CPU with AVX512-BF16) is a weight format on a CPU: packed weights
    # keep fp32 activations and the kernels (bf16 activations fell back to torch: 30x slower)
    as_bf16 = load_model(out, torch.bfloat16)
    assert as_bf16.dtype == torch.float32
    assert torch.equal(logits_of(as_bf16, ids), logits_of(loaded, ids))


def test_quantized_model_is_close_to_fp32_and_smaller(tiny_dir):
    src = tiny_dir("llama")
    fp = load_model(src, torch.float32)
    ids = list(range(100, 140))
    ref = logits_of(fp, ids)
    errs = {}
    for scheme in (INT8, INT4):  # random weights: errors compound over layers, so only loose bounds
        q = quantized_copy(fp, scheme)
        errs[scheme.bits] = float((logits_of(q, ids) - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        packed = sum(m.nbytes() for m in q.modules() if isinstance(m, QuantizedWeight))
        dense = sum(m.weight.numel() * 4 for m in fp.modules() if isinstance(m, torch.nn.Linear))
        assert packed < dense * 0.3  # the copy's own bytes (lm_head int8 here); the rest is shared
    assert errs[8] < 0.05 and errs[4] < 0.5 and errs[8] < errs[4] / 4, errs
    q8 = quantize_model(load_model(src, torch.float32), INT8)
    assert weight_bytes(q8) < weight_bytes(fp) * 0.35
    assert describe(q8) == "int8-g32" and describe(fp) == "float32"


def test_quantized_copy_shares_and_leaves_target_alone(tiny_dir):
    fp = load_model(tiny_dir("llama"), torch.float32)
    before = {k: v.clone() for k, v in fp.state_dict().items()}
    q = quantized_copy(fp, INT4)
    assert q.embed is fp.embed and q.layers[0].input_norm is fp.layers[0].input_norm
    assert isinstance(q.layers[0].gate_up, QLinear) and not isinstance(fp.layers[0].gate_up, QLinear)
    for k, v in fp.state_dict().items():
        assert torch.equal(v, before[k])
    # decode steps (kernel) and a prefill (dequantize + BLAS) agree on the argmax path
    ids = list(range(7, 19))
    assert greedy_ids(q, ids, 6) == logits_of(q, ids + greedy_ids(q, ids, 6)[:-1])[-6:].argmax(-1).tolist()


def test_awq_search_never_worse_than_rtn_and_folding_is_exact(tiny_dir, smollm_dir):
    fp = load_model(tiny_dir("llama"), torch.float32)
    tok = Tokenizer(smollm_dir)
    seqs = [tok.encode("The quick brown fox jumps over the lazy dog. " * 4), tok.encode("def f(x):\n    return x * 2\n" * 3)]
    # the search: alpha = 0 is RTN, so the chosen scale's output error is never larger
    x = collect_inputs(fp, seqs)[(1, "gate_up")]
    w = fp.layers[1].gate_up.weight.detach()
    s, _ = search_scale(w, x, INT4, grid=10)
    err = lambda wq: float((x @ wq.T - x @ w.T).pow(2).mean())  # noqa: E731
    assert err(dequantize(quantize(w * s, INT4)) / s) <= err(dequantize(quantize(w, INT4))) * (1 + 1e-6)
    # folding the scales leaves the fp model's function unchanged
    ids = seqs[0][:30]
    ref = logits_of(fp, ids)
    alphas = apply_awq(fp, seqs, INT4, grid=5)
    assert len(alphas) == 4 * len(fp.layers)
    torch.testing.assert_close(logits_of(fp, ids), ref, atol=2e-4, rtol=1e-4)


def test_quantize_cli_and_generate(tiny_dir, tmp_path, capsys):
    src = tiny_dir("llama")
    out = tmp_path / "q4"
    assert cli_main(["quantize", str(src), "--scheme", "int4", "--group-size", "32", "--method", "awq",
                     "--calib-tokens", "64", "--awq-grid", "4", "--out", str(out)]) == 0
    assert "int4-g32" in capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "awq" and qc["calibration"]["tokens"] == 64
    llm = LLM(str(out), dtype="float32", progress=False)
    r = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(r.outputs[0].token_ids) == 6
    # re-quantizing a quantized model, or a bad scheme, is a one-line user error
    assert cli_main(["quantize", str(out), "--out", str(tmp_path / "again")]) == 2
    assert cli_main(["quantize", str(src), "--group-size", "48", "--out", str(tmp_path / "x")]) == 2


def test_loader_rejects_foreign_quantization(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    model = quantize_model(load_model(src, torch.float32), INT4)
    out = save_quantized(model, src, tmp_path / "q", INT4, INT8, "rtn")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="gptq"):
        load_model(out)


def _tampered(out, edit) -> None:
    """Rewrite the quantized directory's tensors through edit(dict of tensors)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.zeros"), "zero points"),  # the kernel read a NULL
    (lambda t: t.update({"model.layers.0.mlp.up_proj.scales": t["model.layers.0.mlp.up_proj.scales"].float()}),
     "int4, group 32"),  # fp32 scales read as fp16
    (lambda t: t.update({"model.layers.0.mlp.up_proj.zeros": t["model.layers.0.mlp.up_proj.zeros"][:, :1]}),
     "widths differ"),  # read past its end
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.zeros": t["model.layers.0.self_attn.o_proj.zeros"][:, :1]}),
     "int4, group 32"),
    (lambda t: t.update({"model.embed_tokens.qweight": t["model.embed_tokens.qweight"][:-8],
                         "model.embed_tokens.scales": t["model.embed_tokens.scales"][:-8]}), "embed_tokens"),
    (lambda t: t.update({"model.layers.1.self_attn.k_proj.qweight": t["model.layers.1.self_attn.k_proj.qweight"][0]}),
     "rank"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}), "norm"),
])
def test_a_tampered_quantized_file_is_a_clear_error(tiny_dir, tmp_path, edit, why):
    """The kernels read the stored tensors raw: each wrong type or shape is refused at load, not a segfault,
    silent garbage or a traceback."""
    src = tiny_dir("llama")
    out = save_quantized(quantize_model(load_model(src, torch.float32), INT4), src, tmp_path / "q", INT4, INT8, "rtn")
    _tampered(out, edit)
    with pytest.raises(ConfigError, match=why):
        load_model(out)


def test_a_malformed_quantization_config_is_a_clear_error(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    out = save_quantized(quantize_model(load_model(src, torch.float32), INT4), src, tmp_path / "q", INT4, INT8, "rtn")
    good = json.loads((out / "config.json").read_text())
    for change in ({"lm_head": "int8"}, {"symmetric": "false"}):
        cfg = json.loads(json.dumps(good))
        cfg["quantization_config"].update(change)
        (out / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match="quantization_config"):
            load_model(out)


def test_quantized_files_the_kernels_would_misread_are_refused(tiny_dir, tmp_path):
    """Loading checked shapes but not that K is whole blocks of 32 (the kernels read bytes past a 48-wide
    row), let a Qwen2 projection lose its bias silently, and raised a ValueError on a format_version of
    "1.0". Saving int8 weights under the other symmetry wrote a config that did not load."""
    from safetensors.torch import load_file

    from specdec.quant.io import _stored_weight

    t = {"x.qweight": torch.zeros(4, 48, dtype=torch.int8), "x.scales": torch.ones(4, 2, dtype=torch.float16)}
    with pytest.raises(ConfigError, match="multiple of 32"):
        _stored_weight(t, ("x",), QuantScheme(8, 32, True), 48, 4, torch.float32)
    src = tiny_dir("qwen2")
    out = save_quantized(quantize_model(load_model(src, torch.float32), INT4), src, tmp_path / "q", INT4, INT8, "rtn")
    assert "model.layers.0.self_attn.k_proj.bias" in load_file(str(out / "model.safetensors"))
    _tampered(out, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(ConfigError, match="biases stored for 2 of its 3"):
        load_model(out)
    _tampered(out, lambda t: [t.pop(f"model.layers.0.self_attn.{n}_proj.bias") for n in "qv"])
    with pytest.raises(ConfigError, match="biases stored for 0 of its 3"):
        load_model(out)
    llama = tiny_dir("llama")
    q = save_quantized(quantize_model(load_model(llama, torch.float32), INT4), llama, tmp_path / "l", INT4, INT8, "rtn")
    good = json.loads((q / "config.json").read_text())
    for version in ("1.0", None, 1.5):
        cfg = json.loads(json.dumps(good))
        cfg["quantization_config"]["format_version"] = version
        (q / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match="not one specdec reads"):
            load_model(q)
    model = quantize_model(load_model(llama, torch.float32), INT8)  # symmetric: no zero points
    with pytest.raises(ValueError, match="zero points"):
        save_quantized(model, llama, tmp_path / "s", QuantScheme(8, 32, False), INT8, "rtn")
