"""Interchange: heads round-trip through the vLLM / SGLang checkpoint layouts (upstream key names and
config fields), and `specdec export` prints the matching serve command."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec.config import ConfigError
from specdec.model.loader import read_config
from specdec.train.export import export_head, import_head

from tests.heads import random_head

EAGLE3_KEYS = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
               "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
               "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
EAGLE_KEYS = {"fc.weight", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
              "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"}


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def target(tiny_dir):
    from specdec.model.loader import load_model
    d = tiny_dir("llama")
    return d, load_model(d, torch.float32, 256)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_layouts_round_trip(target, tmp_path, fmt, kind):
    from specdec.proposers.head_io import load_head
    d, model = target
    head_dir = random_head(model, kind, tmp_path / "head", draft_vocab=300 if kind == "eagle3" else 0)
    cmd = export_head(head_dir, fmt, tmp_path / "out", d)
    out = tmp_path / "out"
    sglang_bias = {"fc.bias"} if (kind, fmt) == ("eagle", "sglang") else set()
    assert _keys(out) == (EAGLE3_KEYS if kind == "eagle3" else EAGLE_KEYS) | sglang_bias
    cfg = json.loads((out / "config.json").read_text())
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 300
        # the layers whose outputs the head reads, as each engine counts them: vLLM reads layer inputs
        # (output + 1) at the top level, SGLang layer outputs under eagle_config (it adds the 1 itself)
        aux = list(load_head(head_dir).cfg.aux_layers)
        if fmt == "vllm":
            assert cfg["eagle_aux_hidden_state_layer_ids"] == [l + 1 for l in aux] and "eagle_config" not in cfg
        else:
            assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux
            assert "eagle_aux_hidden_state_layer_ids" not in cfg
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 300
        assert torch.equal(torch.nonzero(t2d)[:, 0], torch.arange(300) + d2t)  # target id = i + d2t[i]
    else:  # vLLM prefixes "Eagle" to the architecture itself; SGLang maps nothing, and its fc has a bias
        assert cfg["architectures"] == ["LlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"]
        assert cfg["num_hidden_layers"] == 1
    assert ("vllm serve" in cmd) == (fmt == "vllm")
    assert ("--speculative-algorithm " + ("EAGLE3" if kind == "eagle3" else "EAGLE") in cmd) == (fmt == "sglang")
    # an upstream loader (no specdec section) gets the same head back
    cfg.pop("specdec")
    (out / "config.json").write_text(json.dumps(cfg))
    back = import_head(out, model.config)
    orig = load_head(head_dir)
    for k, v in orig.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert back.cfg.aux_layers == orig.cfg.aux_layers
    if kind == "eagle3":  # a checkpoint with d2t alone (what the engines read): t2d follows from it
        sd = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in sd.items() if k != "t2d"}, str(out / "model.safetensors"))
        assert torch.equal(import_head(out, model.config).t2d, orig.t2d)
        save_file({k: v for k, v in sd.items() if k != "t2d"} | {"d2t": sd["d2t"] + 10**6}, str(out / "model.safetensors"))
        with pytest.raises(ConfigError, match="does not map"):  # a d2t past the vocabulary
            import_head(out, model.config)
        # a head for another target (here: another draft vocabulary) is a ConfigError, not a RuntimeError
        save_file({**sd, "lm_head.weight": sd["lm_head.weight"][:200]}, str(out / "model.safetensors"))
        with pytest.raises(ConfigError, match="does not match"):
            import_head(out, model.config)


def test_medusa_layout(target, tmp_path):
    from specdec.proposers.head_io import make_head, save_head
    from specdec.proposers.heads import HeadConfig
    d, model = target
    cfg = HeadConfig.for_target("medusa", model.config, 128, 3)
    head = make_head(cfg)
    head.set_vocab(torch.arange(0, 256, 2))
    src = save_head(head, tmp_path / "m", torch.float32)
    cmd = export_head(src, "vllm", tmp_path / "out", d)
    keys = _keys(tmp_path / "out")
    assert keys == {f"blocks.{i}.layers.0.{p}" for i in range(3) for p in ("weight", "bias")} | {"lm_heads.0.weight", "token_map"}
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["num_heads"] == 3 and c["truncated_vocab_size"] == 128 and c["original_lm_head"] is True
    assert '"method": "medusa"' in cmd
    back = import_head(tmp_path / "out", model.config)
    assert torch.equal(back.token_map, head.token_map)
    with pytest.raises(ConfigError):
        export_head(src, "sglang", tmp_path / "out2", d)


def test_read_config_of_exported_target_is_unchanged(target):
    d, model = target
    assert read_config(d).hidden_size == model.config.hidden_size


def test_a_head_config_round_trips_and_refuses_unknown_keys(target, tmp_path):
    """A head directory's `specdec` section: to_dict / from_dict give the same config back; a key this
    version does not know is a clear error, not a TypeError."""
    from specdec.proposers.head_io import load_head
    from specdec.proposers.heads import HeadConfig

    _, model = target
    head_dir = random_head(model, "eagle3", tmp_path / "head", draft_vocab=300)
    cfg = load_head(head_dir).cfg
    assert HeadConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    raw = json.loads((head_dir / "config.json").read_text())
    raw["specdec"]["tree_width"] = 4
    (head_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unknown head config keys: tree_width"):
        load_head(head_dir)


def test_export_writes_a_new_directory_and_never_over_a_head(target, tmp_path):
    """export --out the head's own directory (or any non-empty one) is refused: it overwrote the head with
    the upstream layout, which specdec then could not load; a failing export leaves nothing behind."""
    d, model = target
    head_dir = random_head(model, "eagle", tmp_path / "head")
    before = {p.name: p.read_bytes() for p in head_dir.iterdir()}
    for out in (head_dir, tmp_path):
        with pytest.raises(ConfigError, match="not an empty directory"):
            export_head(head_dir, "vllm", out, d)
    assert {p.name: p.read_bytes() for p in head_dir.iterdir()} == before
    (tmp_path / "empty").mkdir()
    export_head(head_dir, "sglang", tmp_path / "empty", d)
    assert (tmp_path / "empty" / "model.safetensors").exists() and not (tmp_path / "empty.partial").exists()
    with pytest.raises(ConfigError):  # no target to read the Medusa LM head from: nothing is left
        src = random_head(model, "medusa", tmp_path / "medusa")
        export_head(src, "vllm", tmp_path / "m-out", tmp_path / "no-such-target")
    assert not (tmp_path / "m-out").exists() and not (tmp_path / "m-out.partial").exists()


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_an_upstream_layout_head_serves_as_the_speculative_model(target, tmp_path, fmt):
    """A head in vLLM's or SGLang's layout (no specdec section, as upstream tools write them) loads as
    the eagle3 proposer's model, with the same weights and aux layers; greedy output equals plain."""
    from specdec.llm import LLM
    from specdec.proposers.head_io import load_head
    from specdec.sampling_params import SamplingParams

    d, model = target
    head_dir = random_head(model, "eagle3", tmp_path / "head", draft_vocab=300)
    export_head(head_dir, fmt, tmp_path / "out", d)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    cfg.pop("specdec")
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not a specdec head"):
        load_head(tmp_path / "out")
    orig, back = load_head(head_dir), load_head(tmp_path / "out", target_config=model.config)
    assert back.cfg.aux_layers == orig.cfg.aux_layers
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in orig.state_dict().items())
    kw = dict(dtype="float32", max_model_len=256, progress=False, num_threads=1)
    spec = LLM(str(d), speculative_config={"method": "eagle3", "model": str(tmp_path / "out"),
                                           "num_speculative_tokens": 3}, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "the cat sat on the mat the cat sat"
    want = LLM(str(d), **kw).generate(prompt, params)[0].outputs[0].token_ids
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == want


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(v, sb[k]) for k, v in sa.items())


EXPORTS = [("eagle", "vllm", 0), ("eagle", "sglang", 0), ("eagle", "sglang", 300), ("eagle3", "vllm", 300),
           ("eagle3", "sglang", 300), ("medusa", "vllm", 0), ("medusa", "vllm", 128)]


@pytest.mark.parametrize("kind,fmt,draft_vocab", EXPORTS)
def test_every_export_loads_back_as_written(target, tmp_path, kind, fmt, draft_vocab):
    """An export directory, as `specdec export` writes it (config with its specdec section) and as upstream
    tools see it (without), loads back into specdec as the head it came from: same weights, same draft
    vocabulary (EAGLE-1's through SGLang's hot_token_ids.pt). Our EAGLE-1 and Medusa exports once failed
    to load back at all (their upstream keys against our strict loader)."""
    from specdec.proposers.head_io import load_head
    d, model = target
    src = random_head(model, kind, tmp_path / "head", draft_vocab=draft_vocab, seed=3)
    export_head(src, fmt, tmp_path / "out", d)
    orig = load_head(src)
    assert _same_weights(load_head(tmp_path / "out"), orig)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    cfg.pop("specdec")
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    back = load_head(tmp_path / "out", target_config=model.config)
    assert _same_weights(back, orig) and back.cfg.draft_vocab_size == draft_vocab
    if (kind, draft_vocab) == ("eagle", 300):
        assert torch.equal(torch.load(tmp_path / "out" / "hot_token_ids.pt", weights_only=True), orig.draft_ids)


def test_a_reduced_eagle1_exports_to_vllm_as_the_full_vocabulary_head_vllm_runs(target, tmp_path):
    """vLLM's EAGLE-1 drafts over the target's whole LM head: the export says so (config, a comment above
    the serve command) and loads back as that full-vocabulary head; it once claimed the trained 300."""
    from specdec.proposers.head_io import load_head
    d, model = target
    src = random_head(model, "eagle", tmp_path / "head", draft_vocab=300)
    cmd = export_head(src, "vllm", tmp_path / "out", d)
    assert cmd.startswith("# vLLM's EAGLE-1 drafts over the whole vocabulary") and "\nvllm serve " in cmd
    assert not (tmp_path / "out" / "hot_token_ids.pt").exists()
    back, orig = load_head(tmp_path / "out"), load_head(src)
    assert back.cfg.draft_vocab_size == 0 and back.draft_ids.numel() == model.config.vocab_size
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in orig.state_dict().items() if k not in ("d2t", "t2d"))


def test_upstream_checkpoints_specdec_cannot_hold_are_refused(target, tmp_path):
    """A Medusa checkpoint with LM heads of its own, or any reduced vocabulary without the map naming its
    tokens, is a ConfigError (they loaded as the shared LM head / the first ids of the vocabulary)."""
    from specdec.proposers.head_io import load_head
    d, model = target
    src = random_head(model, "medusa", tmp_path / "m", draft_vocab=128)
    export_head(src, "vllm", tmp_path / "out", d)
    out = tmp_path / "out"
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    cfg.pop("specdec")
    for upstream in ({**cfg, "original_lm_head": False}, {k: v for k, v in cfg.items() if k != "original_lm_head"}):
        (out / "config.json").write_text(json.dumps(upstream))  # (vLLM's default: false, a head's own LM head)
        with pytest.raises(ConfigError, match="LM heads of their own"):
            import_head(out, model.config)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in sd.items() if k != "token_map"}, str(out / "model.safetensors"))
    with pytest.raises(ConfigError, match="without the token_map"):
        import_head(out, model.config)
    e3 = random_head(model, "eagle3", tmp_path / "e3", draft_vocab=300)
    export_head(e3, "sglang", tmp_path / "e3-out", d)
    sd = load_file(str(tmp_path / "e3-out" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k not in ("d2t", "t2d")}, str(tmp_path / "e3-out" / "model.safetensors"))
    with pytest.raises(ConfigError, match="without the map"):
        import_head(tmp_path / "e3-out", model.config)
    e1 = random_head(model, "eagle", tmp_path / "e1", draft_vocab=300)
    export_head(e1, "sglang", tmp_path / "e1-out", d)
    hot = tmp_path / "e1-out" / "hot_token_ids.pt"
    ids = torch.load(hot, weights_only=True)
    torch.save(ids.tolist(), hot)  # a list, as SGLang also reads
    assert torch.equal(import_head(tmp_path / "e1-out", model.config).draft_ids, ids)
    for bad, match in ((torch.tensor([0.5, 1.5]), "token ids"), (ids[:10], "names 10 distinct tokens")):
        torch.save(bad, hot)
        with pytest.raises(ConfigError, match=match):
            load_head(tmp_path / "e1-out")  # (as written: the size its config says)
    for raw in (b"", b"abc"):  # empty, garbage: one line, no EOFError / IndexError traceback
        hot.write_bytes(raw)
        with pytest.raises(ConfigError, match="cannot read"):
            import_head(tmp_path / "e1-out", model.config)


def test_an_export_exports_again_in_either_layout(target, tmp_path):
    """An export is itself a head directory: exporting it again (SGLang's EAGLE-1 to vLLM's) writes the
    vLLM layout, not SGLang's zero fc bias carried over from the files."""
    from specdec.proposers.head_io import load_head
    d, model = target
    src = random_head(model, "eagle", tmp_path / "head")
    export_head(src, "sglang", tmp_path / "sg", d)
    export_head(tmp_path / "sg", "vllm", tmp_path / "vl", d)
    assert _keys(tmp_path / "vl") == EAGLE_KEYS
    assert _same_weights(load_head(tmp_path / "vl"), load_head(src))


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_eagle1_and_medusa_exports_serve_as_the_speculative_model(target, tmp_path, kind):
    """Our EAGLE-1 (SGLang layout, draft vocabulary in hot_token_ids.pt) and Medusa (vLLM layout) exports,
    upstream-style (no specdec section), run as the proposer's model; greedy output equals plain."""
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    d, model = target
    src = random_head(model, kind, tmp_path / "head", draft_vocab=300 if kind == "eagle" else 128)
    export_head(src, "sglang" if kind == "eagle" else "vllm", tmp_path / "out", d)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    cfg.pop("specdec")
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    kw = dict(dtype="float32", max_model_len=256, progress=False, num_threads=1)
    spec = LLM(str(d), speculative_config={"method": kind, "model": str(tmp_path / "out"),
                                           "num_speculative_tokens": 3}, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "the cat sat on the mat the cat sat"
    want = LLM(str(d), **kw).generate(prompt, params)[0].outputs[0].token_ids
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == want
