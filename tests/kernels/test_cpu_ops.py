"""Each C kernel equals its torch reference (HF's rounding order) in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pressroom.kernels import cpu
from pressroom.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: layers use their torch path")
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(((a.float() - b.float()).abs() <= tol * (1 + b.float().abs())).all())


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rms_norm_with_and_without_residual(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(7, 96, generator=gen).to(dtype), torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.rand(96, generator=gen).to(dtype)
    ref = (F.rms_norm(x.float(), (96,), eps=1e-6).to(dtype) * w)
    assert _close(cpu.rms_norm(x, w, 1e-6, None), ref, tol)
    summed = x + res
    ref2 = (F.rms_norm(summed.float(), (96,), eps=1e-6).to(dtype) * w)
    res_c = res.clone()
    out = cpu.rms_norm(x, w, 1e-6, res_c)
    assert torch.equal(res_c, summed) and _close(out, ref2, tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype, tol):
    rope = RotaryEmbedding(32, 32, 64, 10000.0)
    gen = torch.Generator().manual_seed(2)
    stacked = torch.randn(6, 5, 32, generator=gen).to(dtype)  # 3 q/k heads + 2 untouched "v" heads
    positions = torch.tensor([0, 3, 9, 10, 40, 63])
    cos, sin = rope.cos_sin(positions)
    ref = rope.rotate_reference(stacked[:, :3].clone(), cos, sin)
    untouched = stacked[:, 3:].clone()
    cpu.rotary_(stacked[:, :3], cos, sin, 32)
    assert _close(stacked[:, :3], ref, tol)
    assert torch.equal(stacked[:, 3:], untouched)


@pytest.mark.parametrize("rows, cols", [(1, 262144), (3, 1000), (2, 7), (4, 1)])
def test_argmax_rows_equals_torch_argmax(rows, cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols, generator=gen)
    assert torch.equal(cpu.argmax_rows(x), x.argmax(dim=-1))
    ties = torch.randint(0, 3, (rows, cols), generator=gen).float()  # many equal maxima: the first one wins
    assert torch.equal(cpu.argmax_rows(ties), ties.argmax(dim=-1))


def test_argmax_rows_on_nan_infinities_and_a_row_stride():
    x = torch.zeros(3, 40)
    x[0, [5, 33]] = float("nan")  # a NaN counts as the largest value, as in torch
    x[0, 20] = 9.0
    x[1] = -float("inf")  # every value -inf: index 0
    x[2, 37] = float("inf")
    assert cpu.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [5, 0, 37]
    wide = torch.randn(4, 300)
    view = wide[:, 10:260]  # rows 300 apart: the kernel follows the stride
    assert torch.equal(cpu.argmax_rows(view), view.argmax(dim=-1))


def test_torch_ops_alone_lends_torch_threads_to_the_kernels_for_its_block_only():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu.TorchOpsAlone() as hold:
            assert (torch.get_num_threads(), cpu.kernel_threads(), hold.threads) == (1, 2, 2)
            with cpu.TorchOpsAlone() as inner:  # inside a hold: changes nothing, gives nothing back
                assert inner.threads is None and cpu.kernel_threads() == 2
            assert (torch.get_num_threads(), cpu.kernel_threads()) == (1, 2)
        assert (torch.get_num_threads(), cpu.kernel_threads(), hold.threads) == (2, 2, None)
    finally:
        torch.set_num_threads(before)
