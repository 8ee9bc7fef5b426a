"""The quantized self-draft (qdraft): greedy output equals plain fp32 greedy output token for token
(tiny random models and the real default model), seeded sampling is reproducible and returns q,
the drafter can be a `specdec quantize` directory, and the real model's acceptance is high."""
import pytest
import torch

from specdec import SamplingParams
from specdec.config import ConfigError, SpeculativeConfig
from specdec.llm import LLM
from specdec.model.loader import load_model
from specdec.proposers.qdraft import QDraftProposer
from specdec.quant.io import save_quantized
from specdec.quant.qmodel import quantize_model
from specdec.quant.schemes import QuantScheme
from specdec.spec.decoder import SpeculativeDecoder
from specdec.spec.proposer import ProposerContext, RequestState

from conftest import CHAT_PROMPTS

PROMPTS = ["The quick brown fox", "one two three four five six. one two three"]


def greedy(n=64):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def llm(path, spec=None):
    return LLM(str(path), speculative_config=spec, dtype="float32", progress=False)


def test_greedy_equals_plain_tiny(tiny_dir):
    d = tiny_dir("llama")
    plain, spec = llm(d), llm(d, {"method": "qdraft", "num_speculative_tokens": 4})
    accepted = 0
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        ref = plain.generate_one(ids, greedy()).token_ids
        r = spec.generate_one(ids, greedy())
        assert r.token_ids == ref
        accepted += r.metrics.num_accepted_tokens
    assert accepted > 0
    adaptive = llm(d, {"method": "qdraft"})  # k chosen per step from the measured costs
    assert adaptive.generate_one(ids, greedy(32)).token_ids == ref[:32]


@pytest.mark.parametrize("extra", [{"scheme": "int8", "group_size": 64}, {"scheme": "int4", "lm_head": "none"}])
def test_greedy_equals_plain_tiny_other_schemes(tiny_dir, extra):
    d = tiny_dir("qwen2")  # q/k/v biases travel with the packed qkv
    plain, spec = llm(d), llm(d, {"method": "qdraft", "num_speculative_tokens": 3, "extra": extra})
    ids = plain.tokenizer.encode(PROMPTS[0])
    assert spec.generate_one(ids, greedy(16)).token_ids == plain.generate_one(ids, greedy(16)).token_ids


def test_drafter_from_a_quantized_directory(tiny_dir, tmp_path):
    d = tiny_dir("llama")
    scheme = QuantScheme(4, 32)
    qdir = save_quantized(quantize_model(load_model(d), scheme, None), d, tmp_path / "q4", scheme, None, "rtn")
    plain, spec = llm(d), llm(d, {"method": "qdraft", "model": str(qdir), "num_speculative_tokens": 4})
    ids = plain.tokenizer.encode(PROMPTS[1])
    r = spec.generate_one(ids, greedy(16))
    assert r.token_ids == plain.generate_one(ids, greedy(16)).token_ids
    assert r.metrics.num_draft_tokens > 0
    # the quantized directory as the target: its quantized copy would be itself (it crashed on the packed head)
    with pytest.raises(ConfigError, match="int4-g32 already"):
        llm(qdir, {"method": "qdraft"})
    # another model quantized, of the same vocabulary: its layers would read the target's keys/values
    other = tiny_dir("llama", seed=1, num_hidden_layers=1)
    qother = save_quantized(quantize_model(load_model(other), scheme, None), other, tmp_path / "q4-other", scheme,
                            None, "rtn")
    with pytest.raises(ConfigError, match="not the target quantized: its num_hidden_layers differ"):
        llm(d, {"method": "qdraft", "model": str(qother)})


def test_sampling_returns_q_and_is_reproducible(tiny_dir):
    spec = llm(tiny_dir("llama"), {"method": "qdraft", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    ids = spec.tokenizer.encode(PROMPTS[0])
    a, b = spec.generate_one(ids, params), spec.generate_one(ids, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    state = RequestState(ids, params, torch.Generator().manual_seed(0), [ids[-1]])
    spec.proposer.begin(state)
    prop = spec.proposer.propose(state, 3)
    assert len(prop.tokens) == 3 and prop.probs.shape == (3, spec.model.config.vocab_size)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(3))
    assert all(prop.probs[i, t] > 0 for i, t in enumerate(prop.tokens))
    spec.proposer.on_verified(state, prop, 1)
    assert state.draft["cache"].length == len(state.token_ids) + 1  # context + the accepted draft


def test_bad_qdraft_settings_are_config_errors(tiny_dir):
    with pytest.raises(ConfigError, match="unknown extra"):
        llm(tiny_dir("llama"), {"method": "qdraft", "extra": {"bits": 4}})
    with pytest.raises(ConfigError):
        llm(tiny_dir("llama"), {"method": "qdraft", "extra": {"scheme": "int3"}})


@pytest.mark.slow
def test_real_model_greedy_equal_and_high_acceptance(smollm_llm):
    """int4 copy of SmolLM2 drafting for the fp32 model: 64 tokens on two chat prompts."""
    target, tok = smollm_llm.model, smollm_llm.tokenizer
    cfg = SpeculativeConfig("qdraft", num_speculative_tokens=6)
    proposer = QDraftProposer(ProposerContext(target, tok, cfg, None, torch.float32, target.max_len))
    spec = SpeculativeDecoder(target, tok, proposer, cfg)
    drafted = accepted = 0
    for text in CHAT_PROMPTS[:2]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        params = SamplingParams(temperature=0, max_tokens=64)
        ref = smollm_llm.generate_one(ids, params).token_ids
        r = spec.generate(ids, params)
        assert r.token_ids == ref
        drafted += r.metrics.num_draft_tokens
        accepted += r.metrics.num_accepted_tokens
    assert accepted / drafted >= 0.9, (accepted, drafted)
