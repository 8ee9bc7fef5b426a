"""Prompt logprobs (SamplingParams.prompt_logprobs, the completions API's echo): each prompt token's
logprob equals the log-softmax of a full forward's logits at the position before it, offline and in
the serving engine (chunked prefill, a prefix cache that would otherwise serve the prompt, preemption),
and against transformers on the real model."""
import pytest
import torch

from specdec.engine.engine import Engine, EngineConfig, EngineRequest
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

from test_engine_batching import run

PROMPT = "Once upon a time there was a little robot who loved to count: one, two, three, four, five,"


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", max_model_len=160, progress=False, num_threads=1)


def full_forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(ids) + 1)
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0]
    return torch.log_softmax(logits.float(), -1)  # [N, V]: row i predicts token i + 1


def check(prompt_lps: list, want: torch.Tensor, ids: list[int], top_n: int) -> None:
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    for i, lp in enumerate(prompt_lps[1:]):
        assert lp["token_id"] == ids[i + 1] and lp["logprob"] == float(want[i, ids[i + 1]])
        assert [t for t, _ in lp["top"]] == torch.topk(want[i], top_n).indices.tolist()


def test_offline_prompt_logprobs_equal_a_full_forward(plain):
    ids = plain.tokenizer.encode(PROMPT)
    want = full_forward_logprobs(plain.model, ids)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    first = plain.generate({"prompt_token_ids": ids}, params)[0]
    check(first.prompt_logprobs, want, ids, 3)
    # the same prompt again: the kept prefix would serve it, but its positions are recomputed
    again = plain.generate({"prompt_token_ids": ids}, params)[0]
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == first.prompt_logprobs
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert plain.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_engine_prompt_logprobs_through_chunks_prefix_cache_and_preemption(plain):
    ids = plain.tokenizer.encode(PROMPT)
    want = full_forward_logprobs(plain.model, ids)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2, n=2)
    others = [EngineRequest(f"o{i}", plain.tokenizer.encode(f"{i} apples and {i} pears, " * 3), greedy)
              for i in range(4)]
    eng = Engine(plain, EngineConfig(max_num_seqs=6, max_num_batched_tokens=16, block_size=8, num_kv_blocks=24))
    run(eng, [EngineRequest("warm", ids, greedy)])  # the prompt's blocks are now in the prefix cache
    res = run(eng, [EngineRequest("p", ids, asked)] + others)
    assert eng.scheduler.num_preemptions > 0  # the small pool preempted and recomputed sequences
    reference = plain.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids
    for i in range(2):
        out = res[("p", i)]
        check(out["prompt_lps"], want, ids, 2)
        assert out["out"].num_cached_tokens == 0 and out["ids"] == reference


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(smollm_dir, smollm_llm):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    ids = smollm_llm.tokenizer.encode("The three primary colors are red, yellow and blue.")
    with torch.no_grad():
        hf = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    got = smollm_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    diffs = [abs(lp["logprob"] - float(hf[i, ids[i + 1]])) for i, lp in enumerate(got.prompt_logprobs[1:])]
    assert len(diffs) == len(ids) - 1 and max(diffs) < 1e-3
