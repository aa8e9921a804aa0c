"""FP8 experts with DeepSeek's 128 x 128 block scales: the torch reference (kernels/fp8_moe.py, also the CPU path)
against a float64 computation written here from the blocks, and the Triton fused MoE (kernels/triton/fused_moe_fp8.py)
against the reference in Triton's interpreter on the CPU at tiny shapes."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import fp8, fp8_moe
from pressroom.kernels import triton as triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")


def _experts(experts: int, hidden: int, inter: int, seed: int) -> tuple[fp8_moe.Fp8Experts, fp8_moe.Fp8Experts]:
    """Random experts whose 128 x 128 blocks differ in scale by up to 100x, so a block read with another's scale
    shows."""
    gen = torch.Generator().manual_seed(seed)

    def stack(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(experts, rows, cols, generator=gen)
        block_scale = torch.logspace(-2, 0, 16)[torch.randint(16, (experts, rows // 128 + 1, cols // 128 + 1),
                                                              generator=gen)]
        return w * block_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :rows, :cols]

    return fp8_moe.quantize(stack(2 * inter, hidden), halves=2), fp8_moe.quantize(stack(hidden, inter))


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1), ids


def _x(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)) * 4


def _blocks64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One grid's FP8 values times their blocks' scales, in float64: each scale spread over its block by kron."""
    rows, cols = q.shape
    return q.double() * torch.kron(scale.double(), torch.ones(128, 128, dtype=torch.float64))[:rows, :cols]


def _oracle(x, w13, w2, weights, ids, quantized: bool, limit: float | None = None) -> torch.Tensor:
    """Token by token in float64 from the FP8 values and scales: gate and up each on its own grid of blocks."""
    inter = w13.shape[1] // 2
    half = w13.scale.shape[1] // 2

    def fed(a: torch.Tensor) -> torch.Tensor:  # DeepSeek's activations: per 128-input group, then back
        return fp8.dequantize(*fp8.quantize(a, 128), 128).double() if quantized else a.double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = _blocks64(w13.weight[e, :inter], w13.scale[e, :half]) @ fed(x[t:t + 1])[0]
            up = _blocks64(w13.weight[e, inter:], w13.scale[e, half:]) @ fed(x[t:t + 1])[0]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            mid = (torch.nn.functional.silu(gate) * up).float()
            out[t] += weights[t, j].double() * (_blocks64(w2.weight[e], w2.scale[e]) @ fed(mid[None])[0])
    return out


def test_block_quantization_keeps_each_block_on_its_own_scale():
    """Blocks of magnitudes 1e-3 to 1e2 side by side, a partial last block each way: every value within FP8's
    rounding of its own block's scale, and each block's largest magnitude on FP8's largest value."""
    gen = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-3, 2, 6).view(2, 3)  # one per block
    w = torch.randn(2, 200, 300, generator=gen) * magnitude.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200,
                                                                                                            :300]
    experts = fp8_moe.quantize(w)
    assert experts.weight.dtype == fp8.FP8 and experts.scale.shape == (2, 2, 3)
    for e in range(2):
        back, step = experts.dequantize(e), _blocks64(torch.ones(200, 300), experts.scale[e]).float()
        assert ((back - w[e]).abs() <= w[e].abs() * 2 ** -4 + step * 2 ** -10).all()
        for r in range(2):
            for c in range(3):
                block = experts.weight[e, 128 * r:128 * (r + 1), 128 * c:128 * (c + 1)].float().abs()
                assert block.max() == fp8.FP8_MAX


def test_scales_of_the_wrong_grid_are_refused():
    w13, _ = _experts(2, 256, 192, seed=1)
    with pytest.raises(ValueError, match=r"block scales of shape \(2, 4, 2\)"):
        # one grid over gate's and up's 384 rows has 3 block rows; a grid each, 2 + 2
        fp8_moe.Fp8Experts(w13.weight, fp8_moe.quantize_blocks(w13.dequantize(0)[None])[1].expand(2, -1, -1), halves=2)


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("hidden, inter", [(256, 256), (200, 192)])  # whole blocks; partial last blocks
def test_reference_equals_a_float64_computation_from_the_blocks(quantized, hidden, inter):
    w13, w2 = _experts(4, hidden, inter, seed=2)
    weights, ids = _routing(5, 4, 2, seed=3)
    x = _x(5, hidden, seed=4)
    want = _oracle(x, w13, w2, weights, ids, quantized)
    got = fp8_moe.reference(x, w13, w2, weights, ids, quantize_activations=quantized)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_reference_applies_deepseek_v4s_clamp():
    w13, w2 = _experts(4, 256, 128, seed=5)
    weights, ids = _routing(4, 4, 2, seed=6)
    x = _x(4, 256, seed=7)
    limit = 0.5 * (x[:1] @ w13.dequantize(int(ids[0, 0])).t()).abs().max().item()  # some gate and up values clamp
    want = _oracle(x, w13, w2, weights, ids, True, limit)
    got = fp8_moe.reference(x, w13, w2, weights, ids, swiglu_limit=limit)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.allclose(got, fp8_moe.reference(x, w13, w2, weights, ids), rtol=1e-3)


def test_fp8_experts_stay_near_the_dense_experts():
    """The quantization's error end to end (weights, input and intermediate in FP8): within 10% of the unquantized
    MLPs."""
    gen = torch.Generator().manual_seed(8)
    dense13, dense2 = torch.randn(4, 512, 256, generator=gen), torch.randn(4, 256, 256, generator=gen)
    weights, ids = _routing(6, 4, 2, seed=9)
    x = _x(6, 256, seed=10)
    want = torch.zeros(6, 256)
    for t in range(6):
        for j in range(2):
            gate, up = (dense13[ids[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (dense2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    got = fp8_moe.reference(x, fp8_moe.quantize(dense13, halves=2), fp8_moe.quantize(dense2), weights, ids)
    assert (got - want).norm() / want.norm() < 0.1  # 6% here; a block read with another's scale: far more


@needs_triton
def test_group_quantization_kernel_equals_torchs():
    """Every magnitude FP8 holds, subnormals and round-ups into the next binade included, and a partial group."""
    from pressroom.kernels.triton.fused_moe_fp8 import quantize_groups
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(11)) * torch.logspace(-4, 1, 300)
    q, scale = quantize_groups(x.to(DEVICE))
    want_q, want_scale = fp8.quantize(x, 128)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(q.cpu().float(), want_q.float())


def _run(x, w13, w2, weights, ids, **kwargs) -> torch.Tensor:
    from pressroom.kernels.triton.fused_moe_fp8 import fused_moe_fp8
    return fused_moe_fp8(x.to(DEVICE), _on(w13), _on(w2), weights.to(DEVICE), ids.to(DEVICE), **kwargs).cpu()


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: the same products summed in another order."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_triton
@pytest.mark.parametrize("tokens, experts, hidden, inter, block_m, block_k, quantized", [
    (3, 4, 256, 256, 16, 128, True), (5, 8, 256, 256, 32, 64, False),  # whole blocks
    (4, 6, 200, 192, 16, 32, True), (2, 4, 200, 192, 16, 64, False)])  # a partial last block each way
def test_triton_fp8_moe_equals_the_reference(tokens, experts, hidden, inter, block_m, block_k, quantized):
    from pressroom.kernels.triton.fused_moe import MoeLaunch
    w13, w2 = _experts(experts, hidden, inter, seed=tokens)
    weights, ids = _routing(tokens, experts, 2, seed=tokens + 1)
    x = _x(tokens, hidden, seed=tokens + 2)
    want = fp8_moe.reference(x, w13, w2, weights, ids, quantize_activations=quantized)
    _assert_close(_run(x, w13, w2, weights, ids, launch=MoeLaunch(block_m, 64, block_k, 4, 2),
                       quantize_activations=quantized), want)


@needs_triton
def test_triton_fp8_moe_over_two_ranks_expert_ranges_sums_to_the_whole():
    """Each rank's experts with local ids (-1: the other rank's): the two partial outputs add up to the reference."""
    from pressroom.kernels.triton.fused_moe_fp8 import fused_moe_fp8
    w13, w2 = _experts(6, 200, 192, seed=15)
    weights, ids = _routing(4, 6, 2, seed=16)
    x = _x(4, 200, seed=17)
    parts = torch.zeros(4, 200)
    for lo, hi in ((0, 3), (3, 6)):
        local = torch.where((ids >= lo) & (ids < hi), ids - lo, -1)
        parts += fused_moe_fp8(x.to(DEVICE), _on(w13, lo, hi), _on(w2, lo, hi), weights.to(DEVICE),
                               local.to(DEVICE)).cpu()
    _assert_close(parts, fp8_moe.reference(x, w13, w2, weights, ids))


@needs_triton
def test_triton_fp8_moe_applies_deepseek_v4s_clamp():
    """fp32 here: Triton's interpreter truncates fp32 to bf16 (torch rounds to nearest); tests/gpu covers bf16."""
    w13, w2 = _experts(4, 256, 128, seed=12)
    weights, ids = _routing(3, 4, 2, seed=13)
    x = _x(3, 256, seed=14)
    limit = 0.5 * (x[:1] @ w13.dequantize(int(ids[0, 0])).t()).abs().max().item()  # some gate and up values clamp
    want = fp8_moe.reference(x, w13, w2, weights, ids, swiglu_limit=limit)
    _assert_close(_run(x, w13, w2, weights, ids, swiglu_limit=limit), want)
    assert not torch.allclose(want, fp8_moe.reference(x, w13, w2, weights, ids), rtol=1e-3)


@needs_triton
def test_triton_fp8_moe_refuses_mismatched_experts_and_tiles_across_groups():
    from pressroom.kernels.triton.fused_moe import MoeLaunch
    from pressroom.kernels.triton.fused_moe_fp8 import fused_moe_fp8
    w13, w2 = _experts(2, 256, 128, seed=18)
    weights, ids = _routing(1, 2, 2, seed=19)
    with pytest.raises(ValueError, match="do not fit 200 hidden features"):
        fused_moe_fp8(_x(1, 200, seed=20), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="gate and up on grids of their own"):
        fused_moe_fp8(_x(1, 256, seed=20), fp8_moe.quantize(w13.dequantize(0)[None].expand(2, -1, -1)), w2, weights,
                      ids)
    with pytest.raises(ValueError, match="a tile lies in one 128-input group"):
        fused_moe_fp8(_x(1, 256, seed=20), w13, w2, weights, ids, launch=MoeLaunch(16, 64, 256, 4, 2))


def _on(w: fp8_moe.Fp8Experts, lo: int = 0, hi: int | None = None) -> fp8_moe.Fp8Experts:
    """Experts [lo, hi) on the kernel's device."""
    return fp8_moe.Fp8Experts(w.weight[lo:hi].to(DEVICE), w.scale[lo:hi].to(DEVICE), w.halves)
