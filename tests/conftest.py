"""Shared fixtures: the real default model (SmolLM2-135M GGUF) and tiny random Llama-family models.

Tiny models are built with `transformers` configs and random weights, saved as HF directories with
the real SmolLM2 tokenizer, so every code path (loader, tokenizer, chat template) is the real one.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    from specdec.model.loader import resolve_model
    return resolve_model("smollm2-135m", progress=False).directory


def make_tiny(arch: str, out: Path, tokenizer_src: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight model of `arch` (llama | qwen2 | qwen3 | llama3 | mistral) saved as a HF directory."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if arch == "llama":
        cfg = tf.LlamaConfig(**kw)
        cls = tf.LlamaForCausalLM
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**kw, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":  # every layer within a sliding window (Mistral 7B v0.1)
        cfg = tf.MistralConfig(**{"sliding_window": 32, **kw})
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**kw)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**kw, head_dim=16)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger-than-default weights make logits less flat (fewer near-ties)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm_dir):
    """Factory: tiny_dir("llama") -> Path to a cached random model of that architecture."""
    made: dict[tuple, Path] = {}

    def get(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}")
            made[key] = make_tiny(arch, d, smollm_dir, seed, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def smollm_llm():
    """The real default model, plain decoding, fp32 (loaded once per session)."""
    from specdec.llm import LLM
    return LLM("smollm2-135m", dtype="float32", progress=False)


CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize: The mat was red. The cat sat on the red mat. The dog sat next to the cat on the red mat.",
]


def drain_engine(engine) -> tuple[dict[str, list[int]], int]:
    """Step an engine until its requests finish: each request's token ids and the tokens drafted in
    all; asserts that no KV block is left in use."""
    got: dict[str, list[int]] = {}
    drafted = 0
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                drafted += o.metrics.num_draft_tokens
    assert engine.blocks.num_used == 0
    return got, drafted


def substring_counts(seqs, n: int) -> dict[tuple, int]:
    """Occurrences of every length-n substring of the sequences (brute force, for drafter tests)."""
    counts: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s) - n + 1):
            counts[tuple(s[i:i + n])] = counts.get(tuple(s[i:i + n]), 0) + 1
    return counts


def use_row_count_dependent_linear(monkeypatch) -> None:
    """Negative controls of the prompt pass's row invariance: the model's linear as it was before session
    28, torch's GEMM past MAX_ROWS rows and our kernel below, so a row's sums depend on its pass's size."""
    import torch

    import specdec.kernels as kernels
    import specdec.model.layers as layers
    import specdec.model.llama as llama
    kernel_linear = kernels.linear

    def old_linear(x, weight, bias=None):
        if isinstance(weight, torch.Tensor) and x.numel() // x.shape[-1] > kernels.MAX_ROWS:
            return torch.nn.functional.linear(x, weight, bias)
        return kernel_linear(x, weight, bias)

    monkeypatch.setattr(layers, "linear", old_linear)
    monkeypatch.setattr(llama, "linear", old_linear)


@pytest.fixture(scope="module")
def dataset(tiny_dir, tmp_path_factory):
    """A tiny model's training data (`train data`: 6 train and 3 held-out prompts, 10 answer tokens each)."""
    from specdec.train.data import DataSpec, build_dataset

    d = tiny_dir("llama")
    out = tmp_path_factory.mktemp("data")
    build_dataset(str(d), out, DataSpec(num_prompts=6, num_heldout=3, max_new_tokens=10, batch_size=3, scan=300),
                  progress=False)
    return d, out


def one_step_eagle3_head(dataset, tmp_path: Path):
    """An EAGLE-3 head of 40 draft tokens trained one step on `dataset`: (target, its TrainSpec, its
    Trainer, its directory)."""
    from specdec.model.loader import load_model
    from specdec.train.trainer import TrainSpec, Trainer

    d, data = dataset
    target = load_model(d, torch.float32, 512)
    spec = TrainSpec(kind="eagle3", data=(str(data),), out=str(tmp_path / "base"), epochs=1, batch_size=2,
                     warmup=1, draft_vocab_size=40, eval_every=100, save_dtype="float32")
    base = Trainer(spec, target, progress=False)
    base.total_steps = 1
    base.run()
    return target, spec, base, base.export({})
