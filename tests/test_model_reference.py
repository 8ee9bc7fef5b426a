"""Our decoder against HF transformers (the reference implementation), in fp32."""
import pytest
import torch

from specdec.model.loader import load_model

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2365, 30, 9690, 198, 2683, 359]


def _hf_logits(directory, ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0], ref


def _our_logits(model, ids):
    cache = model.new_cache(64)
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0]


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_tiny_logits_match_transformers(tiny_dir, arch):
    d = tiny_dir(arch)
    ref, _ = _hf_logits(d, PROMPT_IDS)
    ours = _our_logits(load_model(d), PROMPT_IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_sliding_window_model_runs_within_its_window(tiny_dir):
    """Mistral v0.1's window on every layer: the context is capped at the window, where it hides
    nothing (the logits test above runs inside it); asking for more is a clear error, not wrong logits."""
    from specdec.config import ConfigError
    d = tiny_dir("mistral")
    assert load_model(d).max_len == 32
    with pytest.raises(ConfigError, match="sliding window"):
        load_model(d, max_len=64)
    assert load_model(tiny_dir("qwen2")).max_len > 32  # qwen2's sliding_window is off (use_sliding_window)


def test_tiny_incremental_decode_matches_full_pass(tiny_dir):
    """Feeding tokens one at a time through the KV cache equals one pass over all of them."""
    model = load_model(tiny_dir("qwen3"))
    full = _our_logits(model, PROMPT_IDS)
    cache = model.new_cache(64)
    rows = [model(torch.tensor([[t]]), torch.tensor([[i]]), cache).logits[0, 0] for i, t in enumerate(PROMPT_IDS)]
    torch.testing.assert_close(torch.stack(rows), full, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm_logits_match_transformers(smollm_dir):
    """Logits are O(30) here, and two fp32 computations that sum in different orders (our kernels, MKL)
    differ by up to ~1.4e-4 on a Zen 4 build (each is ~0.5-0.9e-4 off the float64 values there). So
    ours must be within 1e-4 of transformers in float64, and within the two fp32 errors of its fp32."""
    ref64, _ = _hf_logits(smollm_dir, PROMPT_IDS, torch.float64)
    ref32, _ = _hf_logits(smollm_dir, PROMPT_IDS)
    ours = _our_logits(load_model(smollm_dir), PROMPT_IDS)
    torch.testing.assert_close(ours.double(), ref64, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, ref32, atol=2e-4, rtol=0)


@pytest.mark.slow
def test_smollm_greedy_equals_transformers_generate(smollm_dir, smollm_llm):
    from transformers import AutoModelForCausalLM
    from specdec import SamplingParams

    ref = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    tok = smollm_llm.tokenizer
    prompts = ["The three primary colors are",
               tok.apply_chat_template([{"role": "user", "content": "Give me two tips for sleeping well."}])]
    for prompt in prompts:
        ids = tok.encode(prompt)
        with torch.no_grad():
            hf = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        ours = smollm_llm.generate({"prompt_token_ids": ids},
                                   SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
        assert ours.outputs[0].token_ids == hf


def test_norms_round_bf16_activations_as_transformers():
    """Llama's RMSNorm (Qwen's, Mistral's) rounds the normalized x to bf16 before the weight; ours rounded
    once, as Gemma's does (1 ulp off on 9,475 of 64 x 576 outputs). Gemma's keeps its single rounding."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specdec.model.gemma3 import GemmaRMSNorm
    from specdec.model.layers import RMSNorm

    torch.manual_seed(0)
    x = (3 * torch.randn(64, 576)).bfloat16()
    w = (1 + 0.1 * torch.randn(576)).bfloat16()
    ref, ours = LlamaRMSNorm(576, eps=1e-5), RMSNorm(576, 1e-5)
    ref.weight.data, ours.weight.data = w.clone(), w.clone()
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        g = 0.1 * torch.randn(576)  # Gemma's w, stored as 1 + w, in fp32 here: the rounding rule alone
        gref, gours = Gemma3RMSNorm(576, eps=1e-6), GemmaRMSNorm(576, 1e-6)
        gref.weight.data, gours.weight.data = g.clone(), 1 + g
        assert torch.equal(gours(x), gref(x)) and gours(x).dtype is torch.bfloat16
