"""FP8 GEMMs on the CPU: quantization's rounding bound, torch._scaled_mm (per-token x per-channel scales) and
the linear layer's apply path against dequantize-then-matmul."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import fp8
from pressroom.model.layers.linear import MergedColumnParallelLinear
from pressroom.model.quantization.fp8 import Fp8LinearMethod


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group", [64, 32, 48])  # per row; whole groups; a partial last group
def test_quantize_rounds_each_value_to_three_mantissa_bits(group):
    x = _randn(7, 64, seed=1) * torch.logspace(-3, 2, 64)  # magnitudes over five decades within a row
    q, scale = fp8.quantize(x, group)
    assert q.dtype == fp8.FP8 and scale.shape == (7, -(-64 // group))
    back = fp8.dequantize(q, scale, group)
    step = scale.repeat_interleave(group, dim=1)[:, :64]
    # e4m3 normals: half an ulp is 2^-4 of the value; subnormals: half of 2^-9 of the scale
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + step * 2 ** -10).all()
    # each group's largest magnitude lands on FP8's largest value
    assert torch.equal(q.float().abs().view(7, -1).amax(dim=1) if group == 64 else q.float().abs()[:, :group].amax(1),
                       torch.full((7,), fp8.FP8_MAX))


def test_reference_is_dequantize_then_matmul():
    x, w = _randn(5, 96, seed=2), _randn(40, 96, seed=3)
    w_q, w_scale = fp8.quantize(w, 32)
    x_q, x_scale = fp8.quantize(x, 32)
    # by hand: per output, the sum over groups of (integer-valued FP8 dot product) x both groups' scales
    by_hand = torch.zeros(5, 40, dtype=torch.float64)
    for g in range(3):
        part = x_q.double()[:, 32 * g:32 * (g + 1)] @ w_q.double()[:, 32 * g:32 * (g + 1)].t()
        by_hand += part * x_scale.double()[:, g:g + 1] * w_scale.double()[:, g].view(1, -1)
    torch.testing.assert_close(fp8.reference(x, w_q, w_scale, 32).double(), by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not fp8.scaled_mm_supported(torch.empty(1, 16), torch.empty(16, 16, dtype=fp8.FP8)),
                    reason="this torch has no _scaled_mm")
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_scaled_mm_matches_the_reference(tokens):
    x, w = _randn(tokens, 128, seed=4), _randn(48, 128, seed=5)
    bias = _randn(48, seed=6)
    w_q, w_scale = fp8.quantize(w, 128)
    torch.testing.assert_close(fp8.scaled_mm(x, w_q, w_scale, bias), fp8.reference(x, w_q, w_scale, 128, bias),
                               rtol=1e-5, atol=1e-5)


def test_an_online_fp8_layer_multiplies_by_its_quantized_weight():
    layer = MergedColumnParallelLinear(64, [48, 48], bias=True)
    layer.set_quant_method(Fp8LinearMethod(serialized=False))
    gate, up = _randn(48, 64, seed=7), _randn(48, 64, seed=8)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    layer.bias.data.copy_(_randn(96, seed=9))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == fp8.FP8 and layer.weight_scale.shape == (96, 1)
    w_q, w_scale = fp8.quantize(torch.cat([gate, up]), 64)  # one scale per output channel
    assert torch.equal(layer.weight.float(), w_q.float()) and torch.equal(layer.weight_scale, w_scale)
    x = _randn(2, 3, 64, seed=10)
    expected = fp8.reference(x.view(6, 64), w_q, w_scale, 64, layer.bias).view(2, 3, 96)
    assert torch.equal(layer(x), expected)
    # still the layer: each product off by about 2^-5 of itself (both factors rounded), summed at random
    dense = x @ torch.cat([gate, up]).t()
    assert (layer(x) - layer.bias - dense).norm() < 0.06 * dense.norm()
