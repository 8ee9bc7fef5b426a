"""Loaders: GGUF conversion and its cache, tokenizer, chat templates, and clear errors on bad input."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.config import ConfigError
from specdec.model.config import ModelConfig
from specdec.model.chat_template import render_chat
from specdec.model.loader import load_model, resolve_model
from specdec.model.tokenizer import IncrementalDetokenizer, Tokenizer


def test_gguf_conversion_is_cached(smollm_dir, monkeypatch):
    """The second load reads the converted safetensors and never converts again (its time is a
    benchmark figure, `specdec bench`, not a timed test)."""
    import specdec.model.gguf as gguf_mod

    def fail(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_mod, "convert_gguf", fail)
    src = resolve_model("smollm2-135m", progress=False)
    model = load_model(src.directory)
    assert src.directory == smollm_dir and model.config.num_hidden_layers == 30


def test_gguf_tokenizer_matches_transformers(smollm_dir):
    from transformers import AutoTokenizer
    source = json.loads((smollm_dir / "source.json").read_text())["gguf"]
    import pathlib
    ref = AutoTokenizer.from_pretrained(str(pathlib.Path(source).parent), gguf_file=pathlib.Path(source).name)
    ours = Tokenizer(smollm_dir)
    for text in ["Hello world", "  spaces   and\ttabs\n\nnewlines", "digits 1234567 and 3.14",
                 "café ☕ naïve 日本語", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref(text).input_ids
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_incremental_detokenizer_streams_whole_characters(smollm_dir):
    tok = Tokenizer(smollm_dir)
    text = "naïve café ☕ 日本語 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_chat_template_is_sandboxed():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ConfigError):
        render_chat(evil, [{"role": "user", "content": "x"}])
    ok = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert render_chat(ok, [{"role": "user", "content": "hi"}]) == "[user]hi"


@pytest.mark.parametrize("template, why", [
    ("{{ messages[0].content + 1 }}", "TypeError"), ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10**6) %}{% endfor %}", "Range too big"), ("{{ 'x' * 10**10 }}", "repetition"),
    ("{{ [0] * 10**9 }}", "repetition"), ("{{ 2 ** 100000 }}", "exponent"),
    ("{{ ((10 ** 200) ** 256) ** 256 }}", "bits"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "renders more than"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_a_failing_or_runaway_template_is_one_config_error(template, why):
    """A template is a program from a model file: each way it fails or runs away is a ConfigError naming it
    (the CLI's one line, the server's 400), not a traceback, a 500 or an exhausted memory."""
    with pytest.raises(ConfigError, match=why):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_chat_template_environment_is_transformers_own():
    """Loop controls, the {% generation %} block and a tojson that keeps key order and non-ASCII text, as
    transformers renders templates (its tojson is not Jinja's HTML-escaping, key-sorting one)."""
    messages = [{"role": "user", "content": "h\u00e9 <b>"}, {"role": "assistant", "content": "ok"}]
    loop = "{% for m in messages %}{{ m.role }}{% if loop.first %}{% break %}{% endif %}{% endfor %}"
    assert render_chat(loop, messages) == "user"
    assert render_chat("{% generation %}[{{ messages[1].content }}]{% endgeneration %}", messages) == "[ok]"
    assert render_chat("{{ messages[0] | tojson }}", messages) == '{"role": "user", "content": "h\u00e9 <b>"}'
    assert render_chat("{{ {'b': 1, 'a': 2} | tojson }}", messages) == '{"b": 1, "a": 2}'


def test_unknown_model_and_hub_id_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="unknown model"):
        resolve_model("no-such-model")
    with pytest.raises(ConfigError, match="local Hugging Face cache"):
        resolve_model("someorg/somemodel")


def test_hub_id_resolves_from_local_cache(tmp_path, monkeypatch, tiny_dir):
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc"
    shutil.copytree(tiny_dir("llama"), snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("org/tiny").directory == snap
    # refs/main names the snapshot the hub resolves, whichever is newer on disk; a ref with a path is ignored
    newer = snap.parent / "def"
    shutil.copytree(snap, newer)
    assert resolve_model("org/tiny").directory == newer
    (snap.parent.parent / "refs").mkdir()
    for ref, want in (("abc\n", snap), ("../snapshots/abc", newer)):
        (snap.parent.parent / "refs" / "main").write_text(ref)
        assert resolve_model("org/tiny").directory == want


def test_corrupt_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ConfigError, match="GGUF"):
        resolve_model(str(bad))
    assert not list((tmp_path / "cache").rglob("model.safetensors"))  # nothing half-written


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ConfigError, match="unsupported architecture"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_a_config_with_missing_or_odd_values_is_one_clear_error(tmp_path, tiny_dir):
    """config.json keys missing, of the wrong type or out of range: a ConfigError naming the file (they were
    KeyError, TypeError, ZeroDivisionError tracebacks); a GGUF without its metadata likewise."""
    import gguf

    from specdec.model.loader import read_config

    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    good = json.loads((d / "config.json").read_text())
    odd = "invalid value|positive integers"
    for change, match in (({"num_attention_heads": None}, "missing key"), ({"num_attention_heads": "8"}, odd),
                          ({"num_attention_heads": 0}, odd), ({"num_hidden_layers": -1}, "positive integers"),
                          ({"num_key_value_heads": 3}, "multiple of"), ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
                          ({"rms_norm_eps": 0}, "rms_norm_eps")):
        cfg = {k: v for k, v in {**good, **change}.items() if v is not None}
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=match) as e:
            read_config(d)
        assert "config.json" in str(e.value)
    for raw, match in ((b"[]", "not a JSON object"), (b"5", "not a JSON object"), (b"\xff\xfe{}", "cannot read")):
        (d / "config.json").write_bytes(raw)
        for read in (read_config, load_model):  # load_model looks for a quantization_config first
            with pytest.raises(ConfigError, match=match):
                read(d)
    # q/k/v whose shapes do not join (from_hf concatenates them before the shape check): a RuntimeError before
    (d / "config.json").write_text(json.dumps(good))
    weights = load_file(str(d / "model.safetensors"))
    key = next(k for k in weights if k.endswith("layers.0.self_attn.k_proj.weight"))
    save_file({**weights, key: weights[key][:, :-1].contiguous()}, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="inconsistent shapes"):
        load_model(d)
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")  # an architecture, no sizes, no tokens
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="bare.gguf"):
        resolve_model(str(tmp_path / "bare.gguf"), progress=False)


def test_pickle_weights_are_refused(tmp_path, tiny_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickle"):
        load_model(d)


def test_make_bf16_model(tiny_dir):
    """On a CPU, bf16 stores the weights in bf16 and computes in fp32 (tests/test_bf16.py)."""
    model = load_model(tiny_dir("llama"), dtype=torch.bfloat16)
    cache = model.new_cache(8)
    out = model(torch.tensor([[5, 6]]), torch.arange(2)[None], cache)
    assert model.layers[0].qkv.weight.qweight.dtype == torch.bfloat16
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_weights_on_huge_pages_keep_values_and_ties(tiny_dir):
    """The loader moves CPU weights into one huge-page arena: same values, tied weights still tied."""
    from specdec.model.loader import load_model
    from specdec.model.memory import move_to_huge_pages
    model = load_model(tiny_dir("llama"), torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.lm_head.weight = model.embed.weight  # tie them, as tied checkpoints are
    big = torch.nn.Linear(1024, 1024)  # the arena needs >= 2 MiB
    model.add_module("extra", big)
    before["extra.weight"] = big.weight.detach().clone()
    moved = move_to_huge_pages(model)
    if not moved:
        pytest.skip("no transparent huge pages here (not Linux, or THP disabled)")
    for k, v in model.state_dict().items():
        if k in before and k != "lm_head.weight":
            assert torch.equal(v, before[k]), k
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert all(p.data_ptr() % 64 == 0 for p in model.parameters())


# relative RMS error of each GGUF type's round trip (a wrong block layout gives ~1.4)
GGUF_TYPES = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 1e-2, "Q5_0": 5e-2, "Q5_1": 5e-2, "Q4_0": 0.1, "Q4_1": 0.1}


@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_gguf_weight_types_dequantize(tmp_path, qtype):
    """Each weight type the GGUF loader reads (Q4_K and Q6_K: the real gemma3 file, test_gemma3), written
    by the gguf package's own writer and quantizer, comes back in HF layout within the type's error."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q, quants
    from specdec.model.gguf import _converted

    q = Q[qtype]
    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    data = quants.quantize(w, q)
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_shape=data.shape, raw_dtype=q)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    out = dict(_converted(reader, {}, "qwen2", reader.tensors))["model.layers.0.mlp.up_proj.weight"]
    assert out.dtype == torch.float32 and tuple(out.shape) == w.shape
    rel_rms = float(((out.numpy() - w) ** 2).mean() ** 0.5 / (w ** 2).mean() ** 0.5)
    assert rel_rms <= GGUF_TYPES[qtype] + 1e-9, rel_rms
    if qtype != "F32":
        assert rel_rms > 0  # really quantized: the test would catch a reader that ignored the type


def test_a_template_that_writes_bos_gets_one_bos(tiny_dir):
    """Gemma's and Llama's templates begin with {{ bos_token }}: a chat prompt is encoded with no special
    tokens added (as HF's apply_chat_template(tokenize=True)), so a tokenizer that adds BOS to plain text
    does not add a second one (the CLI's chat and generate --chat, LLM.chat, the bench once did)."""
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    llm = LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=128, progress=False, num_threads=1)
    tok = llm.tokenizer
    tok.add_bos, tok.chat_template = True, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode("Hello there")[0] == tok.bos_token_id  # plain text still gets its BOS
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1))
    assert out.prompt_token_ids == ids and out.prompt == tok.apply_chat_template(messages)


def test_gguf_byte_level_tokenizers_other_than_smollm2s_are_refused():
    """Qwen's and Llama 3's GGUF pre-tokenizers split text unlike SmolLM2's: refused by name, not built with
    the wrong regex (which gave the model token ids it was never trained on)."""
    from specdec.model.gguf_tokenizer import tokenizer_files

    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<x>", "<u>"],
              "tokenizer.ggml.token_type": [1, 1, 1, 3, 4], "tokenizer.ggml.merges": ["a b"]}
    for pre in ("qwen2", "llama-bpe", None):
        with pytest.raises(ConfigError, match="pre-tokenizer"):
            tokenizer_files(lambda key, default=None, pre=pre: {**fields, "tokenizer.ggml.pre": pre}.get(key, default),
                            "qwen2")
    tok, _ = tokenizer_files(lambda key, default=None: {**fields, "tokenizer.ggml.pre": "smollm"}.get(key, default),
                             "llama")
    added = {t["content"]: t["special"] for t in tok["added_tokens"]}
    assert added == {"<x>": True, "<u>": False}  # control tokens special; user-defined ones kept in text
    # merges the tokenizers library refuses (its own Exception type) or that are not strings: ConfigErrors
    for merges, match in ((["a c"], "out of vocabulary"), ([1, 2], "merges must be strings")):
        with pytest.raises(ConfigError, match=match):
            tokenizer_files(lambda key, default=None, m=merges: {**fields, "tokenizer.ggml.pre": "smollm",
                                                                  "tokenizer.ggml.merges": m}.get(key, default), "llama")


def test_bos_from_the_post_processor_when_the_config_does_not_say(tmp_path, smollm_dir):
    """Llama 3's tokenizer_config.json has no add_bos_token: its tokenizer.json post-processor adds BOS."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm_dir / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not Tokenizer(tmp_path).add_bos  # SmolLM2's post-processor adds nothing
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = cfg["bos_token"] if isinstance(cfg["bos_token"], str) else cfg["bos_token"]["content"]
    bos_id = Tokenizer(tmp_path).bos_token_id
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    tok = Tokenizer(tmp_path)
    assert tok.add_bos and tok.encode("hi")[0] == bos_id and tok.encode("hi", add_special_tokens=False)[0] != bos_id


def test_chat_template_and_eos_ids_from_the_files_transformers_reads(tmp_path, smollm_dir):
    """Newer transformers save the chat template as chat_template.jinja (not in tokenizer_config.json);
    older files list named templates (the one named "default" is used); generation_config.json's eos ids
    stop generation as they stop transformers' generate (some models name end of turn only there)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm_dir / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(tmp_path).chat_template is None  # (the negative control: no template anywhere)
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = Tokenizer(tmp_path)
    assert tok.chat_template == template and tok.encode_chat([{"role": "user", "content": "hi"}])
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named}))
    assert Tokenizer(tmp_path).chat_template == template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named[:1]}))
    with pytest.raises(ConfigError, match="none of them named 'default'"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    before = Tokenizer(tmp_path).eos_token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, True, "x"]}))
    assert Tokenizer(tmp_path).eos_token_ids == before | {7, 9}


def _copy_model(src, dst, config_change=None, tensors_change=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config_change:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_change)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_change:
        t = load_file(str(dst / "model.safetensors"))
        tensors_change(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


def test_configs_the_runtime_would_compute_wrongly_are_refused(tiny_dir, tmp_path):
    """RoPE settings it does not compute as transformers does, o_proj / MLP biases it has no place for, a
    vocabulary that is not the embedding's, an untied head missing: one-line errors (they were tracebacks,
    or silently dropped weights)."""
    src = tiny_dir("llama")
    base = json.loads((src / "config.json").read_text())
    bad = [({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
           ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
           ({"rope_scaling": "linear"}, "object"), ({"rope_theta": None}, "rope_theta"),
           ({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias")]
    for change, why in bad:
        with pytest.raises(ConfigError, match=why):
            ModelConfig.from_hf({**base, **change, "rope_parameters": None})
    qwen2 = json.loads((tiny_dir("qwen2") / "config.json").read_text())
    assert ModelConfig.from_hf({**qwen2, "attention_bias": False}).attention_bias  # as transformers' Qwen2 has
    with pytest.raises(ConfigError, match="embed"):
        load_model(_copy_model(src, tmp_path / "vocab", {"vocab_size": base["vocab_size"] + 8}))
    untied = _copy_model(src, tmp_path / "untied", {"tie_word_embeddings": False},
                         lambda t: t.pop("lm_head.weight", None))
    with pytest.raises(ConfigError, match="lm_head"):
        load_model(untied)


def test_an_index_names_the_shards_read(tiny_dir, tmp_path):
    """A hub snapshot may hold the shards and a consolidated copy: with model.safetensors.index.json only
    its shards are read (the copy's weights were read too, and could override the shards' in file order)."""
    from safetensors.torch import load_file, save_file

    d = _copy_model(tiny_dir("llama"), tmp_path / "m")
    weights = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in weights}}))
    # (sorted after the shard: the old loader's glob read it last, its zeros overriding the shard's weights)
    save_file({k: torch.zeros_like(v) for k, v in weights.items()}, str(d / "zz-consolidated.safetensors"))
    model = load_model(d)
    assert torch.equal(model.embed.weight, weights["model.embed_tokens.weight"])
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(ConfigError, match="not in"):
        load_model(d)


def test_a_conversion_finished_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    """Two processes converting one GGUF at once: the second to finish deleted the first one's directory
    (which that process may be loading) and, had the first replaced it in between, failed on the rename.
    Now a finished conversion stays, and the second's copy goes."""
    import gguf
    import numpy as np

    import specdec.model.gguf as gguf_mod

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "cache" / "m"

    def weights_while_another_process_finishes(reader, cfg, arch, tmp, *a):
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "theirs"):
            (out / name).write_text("{}")
        save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, str(tmp / "model.safetensors"))

    monkeypatch.setattr(gguf_mod, "_hf_config", lambda *a: {"tie_word_embeddings": False})
    monkeypatch.setattr(gguf_mod, "tokenizer_files", lambda *a: ({}, {}))
    monkeypatch.setattr(gguf_mod, "_write_weights", weights_while_another_process_finishes)
    assert gguf_mod.convert_gguf(path, out, progress=False) == out
    assert (out / "theirs").exists()  # the other process's conversion, untouched
    assert [p.name for p in out.parent.iterdir()] == ["m"]  # no temporary directory left


def test_the_model_config_stops_where_the_tokenizer_does(tiny_dir, tmp_path):
    """ModelConfig.eos_token_id (what the trainer keeps in every draft vocabulary) read config.json alone; the
    tokenizer read generation_config.json too, where some models list their end of turn only: one reading now."""
    from specdec.model.loader import read_config

    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg["eos_token_id"], 7, True]}))
    assert read_config(d).eos_token_id == (cfg["eos_token_id"], 7)
    assert set(read_config(d).eos_token_id) <= Tokenizer(d).eos_token_ids


def test_a_model_directory_is_written_whole_over_an_old_one(tiny_dir, tmp_path):
    """save_model_dir wrote into the directory in place (exist_ok): an old directory's files stayed beside
    the new ones, and a crash mid-save left new weights beside an old config.json. Now it is written beside
    and renamed over."""
    from specdec.model.loader import save_model_dir

    src = tiny_dir("llama")
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.safetensors").write_text("old")
    model = load_model(src, torch.float32)
    assert save_model_dir(model, src, out, [0, 1]) == out
    assert not (out / "stale.safetensors").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    import os
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # (a mkdtemp directory stayed 0700: private)
    assert load_model(out, torch.float32).config.num_hidden_layers == 2


def test_config_defaults_and_activations_as_transformers_reads_them():
    """Read as transformers' configs default them: a Mistral config without sliding_window has 4096 (null:
    none), so the context is capped at it (it had no window and attended past it); a Qwen3 config without
    head_dim has 128 (not hidden / heads). A Llama-family hidden_act other than SiLU is refused (it was
    run as SiLU)."""
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=32768)
    mistral = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.sliding_window == 4096 and mistral.context_limit == 4096
    assert ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"]}).head_dim == 128
    assert ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"]}).head_dim == 16
    for act in ("silu", "swish"):
        ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"], "hidden_act": act})
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "hidden_act": "gelu"})


def test_a_large_gguf_converts_in_shards_a_shard_at_a_time(smollm_dir, tmp_path, monkeypatch):
    """Past SHARD_BYTES of fp32 a conversion writes shards and an HF index, holding one shard's tensors at a
    time (it held the whole model in fp32, 28 GB for a 7B GGUF); they load back to the one-file conversion's
    weights, tensor for tensor."""
    import pathlib

    import gguf

    import specdec.model.gguf as gguf_mod
    from specdec.model.loader import read_safetensors_dir

    source = pathlib.Path(json.loads((smollm_dir / "source.json").read_text())["gguf"])
    monkeypatch.setattr(gguf_mod, "SHARD_BYTES", 64 << 20)
    held, save = [], gguf_mod.save_file
    monkeypatch.setattr(gguf_mod, "save_file", lambda t, *a, **k: held.append(sum(x.nbytes for x in t.values()))
                        or save(t, *a, **k))
    out = gguf_mod.convert_gguf(source, tmp_path / "sharded", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) == len(held) >= 3 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards] and gguf_mod.converted(out)
    biggest = 4 * max(int(t.n_elements) for t in gguf.GGUFReader(str(source)).tensors)
    assert max(held) <= max(64 << 20, biggest)  # one shard's tensors at a time (a larger tensor alone)
    whole, sharded = read_safetensors_dir(smollm_dir), read_safetensors_dir(out)
    assert whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k]) for k in whole)
