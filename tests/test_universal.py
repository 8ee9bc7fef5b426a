"""A draft model with a different tokenizer (universal assisted generation, drafting through text):
greedy output equals plain decoding, a relabelled copy of the target (same model, token ids
permuted) is accepted almost always, sampling stays reproducible, the tail re-tokenization rule."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import SamplingParams
from specdec.config import ConfigError
from specdec.llm import LLM

from conftest import make_tiny

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "Numbers: 12345, 67890 and 3.14"]


def greedy(n=48):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def llm(path, spec=None):
    return LLM(str(path), speculative_config=spec, dtype="float32", progress=False)


def universal(draft, k=4):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "extra": {"universal_tokenizer": True}}


@pytest.fixture(scope="module")
def relabelled(tiny_dir, tmp_path_factory):
    """The tiny target with every non-special token id moved: same model on text, another vocabulary."""
    src = tiny_dir("llama")
    out = tmp_path_factory.mktemp("relabelled")
    shutil.copytree(src, out, dirs_exist_ok=True)
    tok = json.loads((src / "tokenizer.json").read_text())
    special = {a["id"] for a in tok["added_tokens"]}
    ids = sorted(i for i in tok["model"]["vocab"].values() if i not in special)
    perm = dict(zip(ids, ids[1:] + ids[:1]))  # old id -> new id, a rotation
    tok["model"]["vocab"] = {t: perm.get(i, i) for t, i in tok["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (f,) = out.glob("*.safetensors")
    w = load_file(str(f))
    emb = w["model.embed_tokens.weight"]
    new = emb.clone()
    old_idx = torch.tensor(ids)
    new[torch.tensor([perm[i] for i in ids])] = emb[old_idx]
    w["model.embed_tokens.weight"] = new
    w.pop("lm_head.weight", None)  # tied
    save_file(w, str(f), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def other_tokenizer_draft(smollm_dir, tmp_path_factory):
    """A tiny random model with its own small byte-level BPE vocabulary (trained here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out = tmp_path_factory.mktemp("other-tok")
    make_tiny("llama", out, smollm_dir, seed=5, vocab_size=400)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PROMPTS * 20 + ["the cat sat on the mat while the dog ran"] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return out


def test_different_vocabulary_needs_the_option(tiny_dir, relabelled):
    with pytest.raises(ConfigError, match="universal_tokenizer"):
        llm(tiny_dir("llama"), {"method": "draft_model", "model": str(relabelled)})
    with pytest.raises(ConfigError, match="unknown draft_model option"):
        llm(tiny_dir("llama"), {"method": "draft_model", "model": str(relabelled), "extra": {"typo": 1}})


def test_relabelled_copy_is_accepted(tiny_dir, relabelled):
    d = tiny_dir("llama")
    plain, spec = llm(d), llm(d, universal(relabelled))
    assert spec.proposer.universal is not None
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        a, b = plain.generate_one(ids, greedy()), spec.generate_one(ids, greedy())
        assert b.token_ids == a.token_ids
        assert b.metrics.acceptance_rate >= 0.9 and b.metrics.mean_acceptance_length >= 3.5


@pytest.mark.parametrize("k", [3, None])
def test_other_tokenizer_greedy_equals_plain(tiny_dir, other_tokenizer_draft, k):
    d = tiny_dir("llama")
    plain, spec = llm(d), llm(d, universal(other_tokenizer_draft, k))
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        r = spec.generate_one(ids, greedy())
        assert r.token_ids == plain.generate_one(ids, greedy()).token_ids
        assert k is None or r.metrics.num_drafts > 0


def test_other_tokenizer_sampling_reproducible(tiny_dir, other_tokenizer_draft):
    d = tiny_dir("llama")
    cfg = universal(other_tokenizer_draft, 3)
    first, second = llm(d, cfg), llm(d, cfg)
    ids = first.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=32, ignore_eos=True)
    assert first.generate_one(ids, params).token_ids == second.generate_one(ids, params).token_ids


def test_to_target_keeps_the_context_tokenization(smollm_dir):
    from specdec.model.tokenizer import Tokenizer
    from specdec.proposers.universal import UniversalDrafter
    tok = Tokenizer(smollm_dir)
    bridge = UniversalDrafter(None, tok, tok)
    ctx = tok.encode("The quick brown fox jumps over the lazy")
    drafted = tok.encode(" dog and the cat")
    assert bridge.to_target(ctx, ctx, drafted) == drafted
    # a context that ends mid-word: the proposal continues the text without re-tokenizing the context
    mid = tok.encode("The quick brown fox ju")
    cand = bridge.to_target(mid, mid, tok.encode("mps over"))
    assert tok.decode(mid + cand) == "The quick brown fox jumps over"
