"""The sampling filters (temperature, top-k, top-p, min-p) against transformers' logits warpers, the
reference every user compares with; speculative sampling applies the same `warp` to p and q."""
import pytest
import torch

from specdec.sampler import make_generator, sample, warp
from specdec.sampling_params import SamplingParams


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    chain = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        chain.append(MinPLogitsWarper(p.min_p))
    scores = logits.clone()
    for w in chain:
        scores = w(None, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("params", [
    dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1), dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.05),  # only the top token survives
])
def test_warp_matches_transformers(params):
    torch.manual_seed(0)
    logits = torch.randn(6, 64) * 3
    p = SamplingParams(**params)
    ours = warp(logits, p)
    torch.testing.assert_close(ours, _reference(logits, p), atol=1e-6, rtol=1e-5)
    assert torch.allclose(ours.sum(-1), torch.ones(6))


def test_filters_keep_what_they_should():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (warp(logits, SamplingParams(top_k=2)) > 0).tolist() == [[True, True, False, False]]
    assert (warp(logits, SamplingParams(top_p=0.8)) > 0).tolist() == [[True, True, False, False]]
    assert (warp(logits, SamplingParams(top_p=0.81)) > 0).tolist() == [[True, True, True, False]]
    assert (warp(logits, SamplingParams(min_p=0.29)) > 0).tolist() == [[True, True, True, False]]  # 0.15 >= 0.145
    assert (warp(logits, SamplingParams(min_p=0.31)) > 0).tolist() == [[True, True, False, False]]
    torch.testing.assert_close(warp(logits, SamplingParams(temperature=0)), torch.tensor([[1.0, 0, 0, 0]]))


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    draws = [sample(probs, make_generator(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    gen = make_generator(0)
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(4000)]), minlength=4).float() / 4000
    assert counts[3] == 0 and (counts - probs).abs().max() < 0.03  # 4 sigma at n = 4000


def test_sample_inverts_the_running_sum_exactly_at_its_edges(monkeypatch):
    """Unnormalised rows are fine; a token of probability 0 is never drawn, not even where the uniform
    draw reaches the top of the running sum; rows without mass are an error, not a token."""
    probs = torch.tensor([0.0, 2.0, 0.0, 6.0, 0.0])  # sums to 8
    gen = make_generator(1)
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(8000)]), minlength=5).float() / 8000
    assert counts[[0, 2, 4]].sum() == 0 and abs(counts[1] - 0.25) < 0.02  # 4 sigma at n = 8000
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")])):
        with pytest.raises(ValueError, match="cannot sample"):
            sample(bad, make_generator(0))
    # u as close to 1 as a float64 gets: the last token with mass, never the zero-probability ones after it
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.tensor(1.0 - 2.0 ** -53, dtype=torch.float64))
    assert sample(probs, None) == 3
    assert sample(torch.tensor([0.1, 0.2, 0.3]), None) == 2


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 5.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": None}, "temperature"), ({"top_k": 2.5}, "top_k"),
    ({"stop": 123}, "stop"), ({"stop": ["a", 3]}, "stop"), ({"seed": "x"}, "seed"), ({"n": "2"}, "n"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_sampling_params_of_the_wrong_type_are_value_errors(kwargs, field):
    """A wrong type is a ValueError naming the field: it was a TypeError from a comparison, or taken
    silently (max_tokens 5.5, a seed of 'x', stop ['a', 3])."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_take_their_usual_forms():
    p = SamplingParams(temperature=0, stop="x", stop_token_ids=None, seed=None, logit_bias={5: 1}, allowed_token_ids=[2, 1])
    assert p.greedy and p.stop == ("x",) and p.stop_token_ids == () and p.logit_bias == ((5, 1.0),)
    assert p.allowed_token_ids == (1, 2) and SamplingParams(logit_bias=[(5, 1.0)]).logit_bias == ((5, 1.0),)


def test_sampling_params_bound_what_would_overflow_or_hold_text_back():
    """A temperature below 1e-5 is greedy (logits / 1e-40 overflowed to NaN, and sampling raised); a
    repetition penalty below 0.01 could overflow a logit it divides; stop token ids are non-negative
    (-1 masked the vocabulary's last token under min_tokens) and stop strings bounded (streaming holds
    back one character less than the longest)."""
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-5).greedy is False
    logits = torch.tensor([[3.0, 1.0, 2.0]])
    assert warp(logits, SamplingParams(temperature=1e-40)).tolist() == [[1.0, 0.0, 0.0]]
    for kwargs, field in (({"repetition_penalty": 1e-38}, "repetition_penalty"),
                          ({"stop_token_ids": [-1]}, "stop_token_ids"),
                          ({"stop_token_ids": list(range(2000))}, "stop_token_ids"), ({"stop": ["x" * 1025]}, "stop")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert SamplingParams(repetition_penalty=0.01, stop=["x" * 1024]).stop == ("x" * 1024,)


def test_a_seed_outside_the_generators_64_bits_is_refused_up_front():
    """seed 2**64 was taken, then failed in torch's generator after earlier prompts had run; with n samples
    sample i draws with seed + i, so the last one must fit too. A logit_bias that is a number was a TypeError."""
    for kwargs in ({"seed": 2**64}, {"seed": 2**63}, {"seed": 2**63 - 1, "n": 2}, {"seed": -(2**63) - 1},
                   {"seed": True}):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(**kwargs)
    assert SamplingParams(seed=2**63 - 2, n=2).seed == 2**63 - 2 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    from specdec.llm import _with_seed  # sample i's own params (seed + i) pass the same check (they kept n = 2)
    assert _with_seed(SamplingParams(seed=2**63 - 2, n=2), 2**63 - 1).seed == 2**63 - 1
    for bias in (5, 1.5, "x"):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bias)
