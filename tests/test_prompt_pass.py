"""A prompt's pass does not depend on how it was cut: prefilled in one pass or in pieces of any size,
its keys, values and logits are bitwise the same (RMSNorm, SwiGLU, the linears and attention run our
kernels at any row count, attention MAX_ROWS rows a call). In fp32 a decoded token's row equals its
prompt-pass row too. This is what makes a reused prefix (the offline prefix cache) exact."""
import pytest
import torch

import specdec.kernels as kernels
from specdec.kernels import MAX_ROWS
from specdec.model.loader import cpu_has_amx, cpu_has_bf16, load_model

from conftest import use_row_count_dependent_linear


@pytest.fixture(autouse=True)
def _need_kernels():
    if kernels._load() is None:
        pytest.skip("kernels unavailable")


def _prefill(model, ids, cuts, cap=400):
    """ids [1, N] prefilled in passes ending at each of `cuts` (then the rest): every pass's logits
    rows concatenated [N, V], and the cache."""
    cache = model.new_cache(cap)
    rows, start = [], 0
    for end in list(cuts) + [ids.shape[1]]:
        out = model(ids[:, start:end], torch.arange(start, end)[None], cache, prefill=True)
        rows.append(out.logits[0])
        start = end
    return torch.cat(rows), cache


def _same(a, b) -> bool:
    (la, ca), (lb, cb) = a, b
    n = ca.length
    return (cb.length == n and torch.equal(la, lb) and torch.equal(ca.k[..., :n, :], cb.k[..., :n, :])
            and torch.equal(ca.v[..., :n, :], cb.v[..., :n, :]))


CUTS = [(37,), (MAX_ROWS,), (MAX_ROWS + 1,), (10, 75, 140), (150,), (1, 2, 3, 100)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_prompt_pass_is_the_same_in_any_pieces(tiny_dir, arch):
    model = load_model(tiny_dir(arch), torch.float32)
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(0))
    whole = _prefill(model, ids, ())
    for cuts in CUTS:
        assert _same(_prefill(model, ids, cuts), whole), cuts


def test_fp32_decoded_rows_equal_prompt_pass_rows(tiny_dir):
    model = load_model(tiny_dir("llama"), torch.float32)
    ids = torch.randint(0, 1000, (1, MAX_ROWS + 40), generator=torch.Generator().manual_seed(1))
    N, P = ids.shape[1], MAX_ROWS + 20
    logits, cache = _prefill(model, ids, ())
    decoded = model.new_cache(400)
    model(ids[:, :P], torch.arange(P)[None], decoded, prefill=True)
    for i in range(P, N):
        last = model(ids[:, i:i + 1], torch.tensor([[i]]), decoded).logits[0, -1]
    assert torch.equal(decoded.k[..., :N, :], cache.k[..., :N, :]) and torch.equal(last, logits[-1])


def test_the_pieces_test_catches_a_row_count_dependent_linear(tiny_dir, monkeypatch):
    """Negative control: the linear as it was (torch's GEMM past MAX_ROWS rows, the kernel below)
    makes a prompt cut at 37 rows differ from one pass."""
    model = load_model(tiny_dir("llama"), torch.float32)
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(0))
    use_row_count_dependent_linear(monkeypatch)
    assert not _same(_prefill(model, ids, (37,)), _prefill(model, ids, ()))


# oneDNN's bf16 GEMM is row-invariant where the CPU has bf16 dot products but no AMX (AMD Zen 4); with AMX
# it sums a row one way at 1-32 rows and another at more (kept_prefix.py: no reuse there)
BF16_ROW_INVARIANT = cpu_has_bf16() and not cpu_has_amx()


@pytest.mark.skipif(not BF16_ROW_INVARIANT, reason="bf16 prompt passes are row-invariant only on bf16 CPUs without AMX")
def test_bf16_prompt_pass_is_the_same_in_any_pieces(tiny_dir):
    model = load_model(tiny_dir("llama"), torch.bfloat16)
    assert model.prefill_matmul_dtype is torch.bfloat16
    ids = torch.randint(0, 1000, (1, 2 * MAX_ROWS + 30), generator=torch.Generator().manual_seed(2))
    whole = _prefill(model, ids, ())
    for cuts in CUTS:
        assert _same(_prefill(model, ids, cuts), whole), cuts


def test_real_model_prompt_in_pieces(smollm_dir):
    """SmolLM2-135M, a 300-token prompt: fp32 and (where oneDNN's bf16 GEMM is row-invariant) bf16, cut in two."""
    ids = torch.randint(0, 49000, (1, 300), generator=torch.Generator().manual_seed(3))
    for dtype in [torch.float32] + ([torch.bfloat16] if BF16_ROW_INVARIANT else []):
        model = load_model(smollm_dir, dtype, max_len=512)
        whole = _prefill(model, ids, (), cap=512)
        for cuts in ((37,), (200,)):
            assert _same(_prefill(model, ids, cuts, cap=512), whole), (dtype, cuts)
