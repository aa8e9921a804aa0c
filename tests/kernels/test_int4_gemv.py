"""Int4 (GPTQ/AWQ) packing against hand-made words, and the Triton weight-only kernel against dequantize-then-matmul
in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where CUDA is absent), with and without act-order."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import int4
from pressroom.kernels import triton as triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32 activations, another summation order than the reference's matmul


def test_gptq_packs_input_8r_plus_j_in_nibble_j():
    values = torch.zeros(16, 2, dtype=torch.int32)
    values[:8, 0] = torch.arange(8)  # word [0, 0] = 0x76543210
    values[15, 1] = 0xF  # the top nibble of word [1, 1]: the int32's sign bit
    packed = int4.pack_inputs(values)
    assert packed.dtype == torch.int32 and packed.shape == (2, 2)
    assert packed[0, 0].item() == 0x76543210 and packed[1, 1].item() == 0xF0000000 - (1 << 32)
    assert torch.equal(int4.unpack_inputs(packed), values)


def test_awq_packs_columns_in_its_interleaved_order():
    values = torch.arange(8, dtype=torch.int32).view(1, 8)  # column j holds j
    packed = int4.pack_outputs(values, int4.AWQ_ORDER)
    assert packed.item() == 0x75316420  # nibble i holds column AWQ_ORDER[i]
    assert torch.equal(int4.unpack_outputs(packed, int4.AWQ_ORDER), values)
    assert int4.pack_outputs(values).item() == 0x76543210


def _weight(k: int, n: int, group: int, act_order: bool, seed: int) -> int4.Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 17, (groups, n), generator=gen).to(torch.uint8)  # 16: GPTQ v1's reading of zero 0
    scales = (torch.rand(groups, n, generator=gen) * 0.1 + 0.01).to(torch.float16)
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32) if act_order else None
    return int4.Int4Weight(int4.pack_inputs(q), scales, zeros, g_idx, group)


def test_dequantize_is_q_minus_zero_times_the_groups_scale():
    w = _weight(64, 16, 32, act_order=True, seed=1)
    q = int4.unpack_inputs(w.qweight)
    k, n = 37, 5
    g = w.g_idx[k].item()
    want = (q[k, n].item() - w.zeros[g, n].item()) * w.scales[g, n].float().item()
    assert w.dequantize()[n, k].item() == want


def _config(tokens: int):
    from pressroom.kernels.triton.quant_gemv import GemvConfig
    return GemvConfig(1 if tokens == 1 else 16, 16, 64, 4)  # small tiles: several programs and tiles per run


@needs_triton
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("tokens, out_features, in_features, group", [(1, 40, 128, 32), (3, 24, 96, 32),
                                                                      (17, 16, 64, 64)])
def test_int4_weight_only_kernel_is_dequantize_then_matmul(tokens, out_features, in_features, group, act_order):
    from pressroom.kernels.triton import quant_gemv
    w = _weight(in_features, out_features, group, act_order, seed=2)
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(4))
    want = x @ w.dequantize().t() + bias
    on = [t.to(DEVICE) if t is not None else None for t in (w.qweight, w.scales, w.zeros, w.g_idx)]
    got = quant_gemv.int4_linear(x.to(DEVICE), *on, group, bias.to(DEVICE), config=_config(tokens))
    torch.testing.assert_close(got.cpu(), want, **TOL)


def test_int4_kernel_refuses_groups_no_tile_divides():
    from pressroom.kernels.triton import quant_gemv
    with pytest.raises(ValueError, match="tile width"):
        quant_gemv.int4_block_k(24, 96, act_order=False, block_k=64)
