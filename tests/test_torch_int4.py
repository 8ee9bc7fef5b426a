"""int4 weights through torch's own int4 kernel (the GPU path): the layout conversion, checked with
torch's CPU variant of the same kernel (the CUDA calls need a GPU)."""
import pytest
import torch

from specdec.quant.schemes import QuantScheme, dequantize, quantize, unpack_int4
from specdec.quant.torch_int4 import (
    CudaInt4,
    int4pack_applies,
    pack_for_cpu,
    scales_and_zeros,
)


@pytest.mark.parametrize("G", [32, 64, 128])
def test_cpu_kernel_on_the_converted_weight_equals_the_dequantized_matmul(G):
    torch.manual_seed(0)
    p = quantize(torch.randn(48, 256) * 0.05, QuantScheme(4, G, False))
    assert int4pack_applies(p)
    packed, sz = pack_for_cpu(p)
    x = torch.randn(5, 256)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz)
    torch.testing.assert_close(got, x @ dequantize(p).t(), rtol=1e-4, atol=1e-4)


def test_scales_and_zeros_layout():
    p = quantize(torch.randn(16, 64), QuantScheme(4, 32, False))
    sz = scales_and_zeros(p, torch.float32)
    assert sz.shape == (2, 16, 2)  # [K / G, N, (scale, zero)]
    q = unpack_int4(p.qweight).float()
    w = (q[:, :32] - 8) * sz[0, :, 0:1] + sz[0, :, 1:2]  # torch's formula, first group
    torch.testing.assert_close(w, dequantize(p)[:, :32], rtol=1e-6, atol=1e-6)


def test_where_the_kernel_does_not_apply():
    assert not int4pack_applies(quantize(torch.randn(16, 96), QuantScheme(4, 64, False)))  # K % G
    assert not int4pack_applies(quantize(torch.randn(12, 64), QuantScheme(4, 32, False)))  # N % 8
    assert not int4pack_applies(quantize(torch.randn(16, 64), QuantScheme(8, 32, True)))  # int8
    assert CudaInt4.build(quantize(torch.randn(12, 64), QuantScheme(4, 32, False))) is None
