"""Quantization schemes and the int8/int4 kernels: RTN error bounds, packing round trips, qgemv.c
equal to a readable torch reference (F.linear of the block-quantized activations and the dequantized
matrix, in float64) and batch-invariant (the rows of a T-row call are bitwise the rows of T one-row calls)."""
import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.config import ConfigError
from specdec.quant.qlinear import CHUNKED_ROWS, QuantizedWeight, qkernel
from specdec.quant.schemes import (QuantScheme, _grouped, deinterleave_int8, dequantize, interleave_int8,
                                   kernel_reference, pack_int4, quantize, quantize_activations, unpack_int4)

SCHEMES = [QuantScheme(8, 32, True), QuantScheme(8, 64, False), QuantScheme(4, 32, False),
           QuantScheme(4, 128, False), QuantScheme(4, 64, True)]


def bound(w: torch.Tensor, p, scheme: QuantScheme) -> torch.Tensor:
    """|w - deq| <= half a step (+ the fp16 rounding of the zero when asymmetric) + float slack."""
    cols = torch.arange(w.shape[1]) // scheme.group_size
    b = 0.5 * p.scales.float()[:, cols]
    if not scheme.symmetric:
        lo = _grouped(w, scheme.group_size).amin(-1)
        b = b + (lo - p.zeros.float()).abs()[:, cols]
    return b * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("K", [64, 96, 576])  # 96 with G=64/128: a short last group
def test_rtn_error_is_bounded(scheme, K):
    torch.manual_seed(0)
    w = torch.randn(40, K) * torch.rand(40, 1) * 0.2
    w[3, : min(K, 32)] = 0.0  # a constant group
    w[5, 7] = 3.0  # an outlier
    p = quantize(w, scheme)
    err = (w - dequantize(p)).abs()
    assert (err <= bound(w, p, scheme)).all(), float((err - bound(w, p, scheme)).max())
    levels = 2 ** scheme.bits
    ng = -(-K // scheme.group_size)
    assert p.scales.dtype == torch.float16 and p.scales.shape == (40, ng)
    assert p.qweight.shape == (40, K if scheme.bits == 8 else K // 2)
    # every level is used where the range needs it: the relative RMS error is about 1 / levels
    rel = (err.pow(2).mean() / w.pow(2).mean()).sqrt()
    assert rel < 4.0 / levels


def test_int4_recovers_an_int4_grid_exactly():
    """A matrix already on an asymmetric 16-level grid (e.g. a Q4_1 GGUF) quantizes without error."""
    torch.manual_seed(0)
    s = (torch.rand(8, 4, 1) * 0.01 + 1e-3).half().float()
    m = (torch.randn(8, 4, 1) * 0.02).half().float()
    q = torch.randint(0, 16, (8, 4, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (q * s + m).reshape(8, 128)
    assert torch.equal(dequantize(quantize(w, QuantScheme(4, 32, False))), w)


def test_packing_round_trips():
    q4 = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q4)), q4)
    packed = pack_int4(q4)
    assert int(packed[0, 3] & 15) == q4[0, 3] and int(packed[0, 3] >> 4) == q4[0, 19]
    q8 = torch.randint(-127, 128, (5, 96), dtype=torch.int8)
    assert torch.equal(deinterleave_int8(interleave_int8(q8)), q8)
    assert interleave_int8(q8)[0, 4 * 2 + 1] == q8[0, 8 * 1 + 2]  # byte 4i + c = column 8c + i


def test_bad_schemes_are_config_errors():
    with pytest.raises(ConfigError):
        QuantScheme(3, 32)
    with pytest.raises(ConfigError):
        QuantScheme(4, 48)
    with pytest.raises(ConfigError):
        QuantScheme.named("int2")
    with pytest.raises(ConfigError):
        quantize(torch.randn(4, 40), QuantScheme(4, 32))


# ------------------------------------------------------------------------------------------- kernels

@pytest.fixture
def need_kernel():
    if qkernel() is None:
        pytest.skip("qgemv.c unavailable")


def reference(x: torch.Tensor, qw: QuantizedWeight, bias=None) -> torch.Tensor:
    w = dequantize(qw.packed).double()
    return F.linear(x.double(), w, None if bias is None else bias.double())


def test_activation_quantization_error_is_half_a_step():
    torch.manual_seed(3)
    x = torch.randn(5, 96) * torch.rand(5, 96) * 4
    x[1, :32] = 0  # an all-zero block stays zero
    xq = quantize_activations(x)
    step = x.view(5, 3, 32).abs().amax(-1, keepdim=True).expand(5, 3, 32).reshape(5, 96) / 127
    assert torch.all((xq - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    assert torch.all(xq[1, :32] == 0)
    assert not torch.equal(xq, x)  # it does quantize


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("T,K,N", [(1, 576, 960), (3, 96, 37), (9, 1536, 64), (32, 64, 5)])
def test_kernel_matches_reference(need_kernel, scheme, T, K, N):
    torch.manual_seed(T + K + N)
    w, x, b = torch.randn(N, K) * 0.05, torch.randn(T, K), torch.randn(N)
    qw = QuantizedWeight(quantize(w, scheme))
    ref = kernel_reference(x, qw.packed) + b.double()  # the kernel's int8 activations, exactly
    y = kernels.linear(x, qw, b)
    scale = (x.abs().double() @ dequantize(qw.packed).abs().double().T).max()
    assert y.dtype == torch.float32 and y.shape == (T, N)
    assert float((y.double() - ref).abs().max()) <= 1e-6 * float(scale) + 1e-6
    # and within the activations' quantization error of the fp32 product
    assert float((y.double() - reference(x, qw, b)).abs().max()) <= 0.02 * float(scale)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("N", [301, 302, 303])  # every edge tile shape (int4-g32 on AVX512-VNNI: 1-3 of 4 rows)
def test_kernel_is_batch_invariant(need_kernel, scheme, N):
    torch.manual_seed(1)
    x, w = torch.randn(9, 192), torch.randn(N, 192) * 0.05
    qw = QuantizedWeight(quantize(w, scheme))
    block = kernels.linear(x[None], qw)[0]  # [1, 9, K] -> [9, N]
    rows = torch.cat([kernels.linear(x[i:i + 1], qw) for i in range(9)])
    assert torch.equal(block, rows)
    assert torch.equal(kernels.linear(x[2:7], qw), block[2:7])


def test_dequantize_kernel_equals_reference_and_prefill_path(need_kernel):
    torch.manual_seed(2)
    w = torch.randn(70, 160) * 0.1
    for scheme in SCHEMES:
        qw = QuantizedWeight(quantize(w, scheme))
        assert torch.equal(qw.dequantize(), dequantize(qw.packed))  # q * s is exact in fp32
        x = torch.randn(1, CHUNKED_ROWS + 1, 160)  # a long prefill: dequantize + BLAS
        torch.testing.assert_close(kernels.linear(x, qw), reference(x, qw).float(), atol=1e-4, rtol=1e-4)
        # 40 rows > QGEMV_ROWS: the kernel, 32 rows at a time, row for row what it gives alone
        x = x[:, :40]
        rows = torch.cat([kernels.linear(x[:, i], qw) for i in range(40)])
        assert torch.equal(kernels.linear(x, qw)[0], rows)
        ids = torch.tensor([[3, 69, 0]])
        assert torch.equal(qw.rows(ids), dequantize(qw.packed)[ids])


def test_torch_fallback_when_kernel_is_off(monkeypatch):
    import specdec.quant.qlinear as ql
    monkeypatch.setattr(ql, "_lib", None)
    monkeypatch.setattr(ql, "_load_error", "disabled")
    w, x = torch.randn(20, 64), torch.randn(2, 64)
    qw = QuantizedWeight(quantize(w, QuantScheme(4, 32)))
    torch.testing.assert_close(kernels.linear(x, qw), reference(x, qw).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("scheme", [QuantScheme(8, 32, True), QuantScheme(8, 64, False), QuantScheme(4, 32, False)],
                         ids=lambda s: s.name)
def test_a_nan_activation_gives_nan_outputs_as_torch(scheme, rows):
    """Symmetric int8 quantized a NaN activation to 0 (fabsf and > drop NaNs, and the cast of a NaN is
    undefined): a finite y where torch gives NaN. Now the row's NaN block gives NaN, as the group sums did
    for the other schemes; rows without one stay finite."""
    torch.manual_seed(0)
    w = QuantizedWeight(quantize(torch.randn(48, 128), scheme))
    x = torch.randn(rows, 128)
    x[0, 70] = float("nan")
    y = w.linear(x)
    assert y[0].isnan().all() and not y[1:].isnan().any()
    if rows > 1:  # the other rows are what they are without it
        assert torch.equal(y[1:], w.linear(x[1:]))
