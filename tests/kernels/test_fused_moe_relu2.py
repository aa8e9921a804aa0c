"""Experts with no gate half and a ReLU² activation (Nemotron-H): FusedMoE's torch path against a plain per-expert
loop written here, its loader (up matrices alone in w13, a gate refused), and the Triton kernel (interpreter on the
CPU) against FusedMoE's torch path, with and without biases, with experts of another rank dropped."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.moe_activation import Relu2
from pressroom.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
HIDDEN, INTER, EXPERTS, TOP_K = 48, 40, 5, 2  # neither a multiple of the kernels' 64-wide tiles


def _layer(seed: int, bias: bool = False, expert_range: tuple[int, int] | None = None) -> FusedMoE:
    """Random experts, loaded one matrix at a time as a checkpoint would."""
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, expert_range=expert_range, bias=bias, activation=Relu2())
    for e in range(EXPERTS):
        layer.w13.weight_loader(layer.w13, torch.randn(INTER, HIDDEN, generator=gen) * 0.3, (UP, e))
        layer.w2.weight_loader(layer.w2, torch.randn(HIDDEN, INTER, generator=gen) * 0.3, (DOWN, e))
        if bias:
            layer.w13_bias.weight_loader(layer.w13_bias, torch.randn(INTER, generator=gen), (UP, e))
            layer.w2_bias.weight_loader(layer.w2_bias, torch.randn(HIDDEN, generator=gen), (DOWN, e))
    return layer


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return x, torch.rand(tokens, TOP_K, generator=gen), ids


def _loop(up: list[torch.Tensor], down: list[torch.Tensor], x, weights, ids, up_bias=None, down_bias=None,
          owned: range = range(EXPERTS)) -> torch.Tensor:
    """Each token through each expert it chose (of those in `owned`): down(relu(up x)²) times its weight."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            if e not in owned:
                continue
            h = up[e] @ x[t] + (0 if up_bias is None else up_bias[e])
            y = down[e] @ torch.relu(h) ** 2 + (0 if down_bias is None else down_bias[e])
            out[t] += y * weights[t, j]
    return out


def test_loader_stacks_the_up_matrices_alone_and_refuses_a_gate():
    layer = _layer(0)
    assert layer.w13.shape == (EXPERTS, INTER, HIDDEN) and not layer.gated
    up = torch.randn(INTER, HIDDEN)
    layer.w13.weight_loader(layer.w13, up, (UP, 3))
    assert torch.equal(layer.w13[3], up)
    with pytest.raises(ValueError, match="no gate half"):
        layer.w13.weight_loader(layer.w13, up, (GATE, 3))
    with pytest.raises(ValueError, match="has shape"):
        layer.w13.weight_loader(layer.w13, torch.randn(2 * INTER, HIDDEN), (UP, 3))


@pytest.mark.parametrize("bias", [False, True])
def test_torch_path_is_a_per_expert_loop(bias):
    layer = _layer(1, bias)
    x, weights, ids = _inputs(11, 2)
    got = layer(x, weights, ids)
    b13, b2 = (layer.w13_bias, layer.w2_bias) if bias else (None, None)
    torch.testing.assert_close(got, _loop(layer.w13, layer.w2, x, weights, ids, b13, b2), atol=1e-5, rtol=1e-5)
    # ReLU² is what runs: the same up matrices as SwiGLU's would give something else
    swiglu = FusedMoE(EXPERTS, HIDDEN, INTER // 2)
    swiglu.w13.data, swiglu.w2.data = layer.w13.data.clone(), layer.w2.data[..., :INTER // 2].clone()
    assert (swiglu(x, weights, ids) - got).abs().max() > 0.1


def test_torch_path_of_an_expert_range_skips_other_ranks_experts():
    layer = _layer(3, expert_range=(1, 4))
    x, weights, ids = _inputs(9, 4)
    full = _layer(3)
    want = _loop(full.w13, full.w2, x, weights, ids, owned=range(1, 4))
    torch.testing.assert_close(layer(x, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_quantization_methods_are_refused():
    with pytest.raises(ValueError, match="no gate half"):
        _layer(0).set_quant_method(object())


@needs_triton
@pytest.mark.parametrize("tokens, bias", [(1, False), (13, True)])
def test_triton_kernel_matches_the_torch_path(tokens, bias):
    from pressroom.kernels.triton.fused_moe import fused_moe_relu2
    layer = _layer(5, bias)
    x, weights, ids = _inputs(tokens, 6)
    on = dict(device=DEVICE)
    got = fused_moe_relu2(x.to(**on), layer.w13.data.to(**on), layer.w2.data.to(**on), weights.to(**on),
                          ids.to(**on), w1_bias=layer.w13_bias.data.to(**on) if bias else None,
                          w2_bias=layer.w2_bias.data.to(**on) if bias else None)
    torch.testing.assert_close(got.cpu(), layer(x, weights, ids), atol=1e-4, rtol=1e-4)


@needs_triton
def test_triton_kernel_drops_other_ranks_pairs():
    """ids local to this rank's experts, -1 for another rank's: those pairs add nothing."""
    from pressroom.kernels.triton.fused_moe import fused_moe_relu2
    layer = _layer(7, expert_range=(2, 5))
    x, weights, ids = _inputs(8, 8)
    on = dict(device=DEVICE)
    got = fused_moe_relu2(x.to(**on), layer.w13.data.to(**on), layer.w2.data.to(**on), weights.to(**on),
                          layer.local_ids(ids).to(**on))
    torch.testing.assert_close(got.cpu(), layer(x, weights, ids), atol=1e-4, rtol=1e-4)
