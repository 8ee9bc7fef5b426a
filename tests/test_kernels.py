"""The AVX2 decode kernels equal torch and are batch-invariant (same bits for T=1 and T=k)."""
import pytest
import torch
import torch.nn.functional as F

from specdec import kernels


@pytest.fixture(autouse=True)
def _need_kernel():
    if kernels._load() is None:
        pytest.skip(f"kernel unavailable: {kernels.kernel_status()}")


@pytest.mark.parametrize("T,K,N", [(1, 576, 960), (3, 576, 1537), (8, 1536, 576), (17, 100, 33)])
def test_linear_matches_torch(T, K, N):
    torch.manual_seed(0)
    x, w, b = torch.randn(T, K), torch.randn(N, K), torch.randn(N)
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_is_batch_invariant():
    torch.manual_seed(0)
    x, w = torch.randn(9, 576), torch.randn(300, 576)
    block = kernels.linear(x, w)
    rows = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(9)])
    assert torch.equal(block, rows)


def test_rmsnorm_and_silu_mul_match_torch():
    x, w = torch.randn(4, 576), torch.rand(576)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 2 * 100)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gu[:, :100]) * gu[:, 100:], atol=1e-5, rtol=1e-5)
