"""FP4 experts: the Triton fused MoE over MXFP4 / NVFP4 experts (E2M1 and block scales unpacked in registers) against
the torch reference (dequantize, then the per-expert SwiGLU MLPs), in Triton's interpreter on the CPU at tiny
shapes; and the stacked quantization against the per-matrix one."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import fp4_moe, mxfp4, nvfp4
from pressroom.kernels import triton as triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")


def _experts(experts: int, hidden: int, inter: int, fmt: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * torch.logspace(-2, 0, inter)  # blocks of unlike scale
    return fp4_moe.quantize(w13, fmt), fp4_moe.quantize(w2, fmt)


def _on(w: fp4_moe.Fp4Experts, lo: int = 0, hi: int | None = None) -> fp4_moe.Fp4Experts:
    """Experts [lo, hi) on the kernel's device."""
    return fp4_moe.Fp4Experts(*(t[lo:hi].to(DEVICE) if t is not None else None
                                for t in (w.packed, w.scales, w.global_scale)))


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1), ids


@pytest.mark.parametrize("fmt", fp4_moe.FORMATS)
def test_stacked_quantization_is_each_experts_own(fmt):
    w = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))
    stacked = fp4_moe.quantize(w, fmt)
    kernels = mxfp4 if fmt == "mxfp4" else nvfp4
    for e in range(3):
        assert torch.equal(stacked.dequantize(e), kernels.dequantize(*kernels.quantize(w[e])))
    assert stacked.packed.shape == (3, 16, 32) and stacked.scales.shape == (3, 16, 64 // stacked.block)
    assert (stacked.global_scale is None) == (fmt == "mxfp4")


def test_reference_is_the_dense_mlp_over_dequantized_experts():
    """The reference against a plain loop written here: each token's experts, SiLU(gate) * up, down, weighted."""
    w13, w2 = _experts(4, 32, 32, "nvfp4", seed=1)
    weights, ids = _routing(5, 4, 2, seed=2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    want = torch.zeros(5, 32)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            h = w13.dequantize(e) @ x[t]
            want[t] += weights[t, j] * (w2.dequantize(e) @ (torch.nn.functional.silu(h[:32]) * h[32:]))
    assert torch.allclose(fp4_moe.reference(x, w13, w2, weights, ids), want, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("fmt", fp4_moe.FORMATS)
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [(1, 4, 2, 64, 32), (9, 6, 2, 96, 64),
                                                                   (20, 8, 3, 64, 96)])
def test_triton_fp4_moe_equals_the_reference(fmt, tokens, experts, top_k, hidden, inter):
    from pressroom.kernels.triton.fused_moe import fused_moe_fp4
    w13, w2 = _experts(experts, hidden, inter, fmt, seed=tokens)
    weights, ids = _routing(tokens, experts, top_k, seed=tokens + 1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + 2))
    want = fp4_moe.reference(x, w13, w2, weights, ids)
    got = fused_moe_fp4(x.to(DEVICE), _on(w13), _on(w2), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    half = experts // 2  # two ranks' expert ranges: local ids, -1 for the other's; the parts sum to the whole
    parts = []
    for lo, hi in ((0, half), (half, experts)):
        local = torch.where((ids >= lo) & (ids < hi), ids - lo, -1)
        parts.append(fused_moe_fp4(x.to(DEVICE), _on(w13, lo, hi), _on(w2, lo, hi), weights.to(DEVICE),
                                   local.to(DEVICE)).cpu())
    assert torch.allclose(parts[0] + parts[1], want, atol=1e-4, rtol=1e-4)


@needs_triton
def test_triton_fp4_moe_reads_per_row_global_scales():
    """NVFP4 experts whose gate and up rows carry different global scales (a checkpoint's, quantized apart): the
    kernel must scale each row by its own."""
    from pressroom.kernels.triton.fused_moe import fused_moe_fp4
    w13, w2 = _experts(2, 32, 32, "nvfp4", seed=5)
    w13.global_scale[:, 32:] *= 4.0  # the up rows only
    weights, ids = _routing(3, 2, 2, seed=6)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(7))
    want = fp4_moe.reference(x, w13, w2, weights, ids)
    got = fused_moe_fp4(x.to(DEVICE), _on(w13), _on(w2), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
