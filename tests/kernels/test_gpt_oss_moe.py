"""gpt-oss's experts: biases on gate/up and down and the clamped SwiGLU, in FusedMoE's torch path (against a loop
written here after HF's GptOssExperts), the FP4 reference, and both Triton kernels (interpreter on the CPU);
each option shown to change the result, and the options left off keep other models' SwiGLU."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import fp4_moe
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.moe_activation import ClampedSwiglu
from pressroom.model.layers.fused_moe import FusedMoE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 4, 2
# A small limit and large weights: many gate and up values land beyond it, so the clamps act.
ACT = ClampedSwiglu(alpha=1.702, limit=1.5)


def _layer(seed: int, bias: bool = True, act: ClampedSwiglu | None = ACT) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, bias=bias, activation=act)
    layer.w13.data = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.4
    layer.w2.data = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    if bias:
        layer.w13_bias.data = torch.randn(EXPERTS, 2 * INTER, generator=gen)
        layer.w2_bias.data = torch.randn(EXPERTS, HIDDEN, generator=gen)
    return layer


def _inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return x, torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1), ids


def _hf_loop(layer: FusedMoE, x, weights, ids, w13=None, w2=None) -> torch.Tensor:
    """HF's GptOssExperts per token, on our de-interleaved layout: gate rows first, then up rows."""
    w13 = layer.w13.data if w13 is None else w13
    w2 = layer.w2.data if w2 is None else w2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t] + layer.w13_bias[e]
            gate, up = gate_up[:INTER].clamp(max=ACT.limit), gate_up[INTER:].clamp(-ACT.limit, ACT.limit)
            glu = gate * torch.sigmoid(gate * ACT.alpha)
            out[t] += (w2[e] @ ((up + 1) * glu) + layer.w2_bias[e]) * weights[t, j]
    return out


def test_fused_moe_torch_path_is_hfs_expert_loop():
    layer = _layer(0)
    x, weights, ids = _inputs(9, 1)
    got = layer(x, weights, ids)
    torch.testing.assert_close(got, _hf_loop(layer, x, weights, ids), atol=1e-5, rtol=1e-5)
    plain = _layer(0, bias=False, act=None)  # the same weights as SwiGLU without biases: a different result
    assert (plain(x, weights, ids) - got).abs().max() > 0.1
    unclamped = _layer(0, act=ClampedSwiglu(alpha=1.702, limit=1e4))
    assert (unclamped(x, weights, ids) - got).abs().max() > 0.1  # the clamps act


def test_bias_loader_splits_gate_up_by_rank_and_adds_down_once():
    """Tensor parallelism over the intermediate features: each rank its slice of gate's and up's biases; down's
    bias on the first rank only, so the ranks' partial sums add it once."""
    gate, up, down = torch.arange(INTER) * 1.0, -torch.arange(INTER) * 1.0, torch.ones(HIDDEN)
    ranks = [FusedMoE(EXPERTS, HIDDEN, INTER, inter_shard=(r, 2), bias=True) for r in range(2)]
    for r, layer in enumerate(ranks):
        for part, value in (("w1", gate), ("w3", up)):
            layer.w13_bias.weight_loader(layer.w13_bias, value, (part, 3))
        layer.w2_bias.weight_loader(layer.w2_bias, down, ("w2", 3))
        half = INTER // 2
        assert torch.equal(layer.w13_bias[3], torch.cat([gate[r * half:(r + 1) * half], up[r * half:(r + 1) * half]]))
    assert torch.equal(ranks[0].w2_bias[3] + ranks[1].w2_bias[3], down)
    with pytest.raises(ValueError, match="bias has shape"):
        ranks[0].w2_bias.weight_loader(ranks[0].w2_bias, torch.ones(HIDDEN + 1), ("w2", 0))


@needs_triton
@pytest.mark.parametrize("tokens", [1, 21])
@pytest.mark.parametrize("bias, act", [(True, ACT), (True, None), (False, ACT)])
def test_triton_fused_moe_with_gpt_oss_options(tokens, bias, act):
    from pressroom.kernels.triton.fused_moe import fused_moe
    layer = _layer(tokens, bias, act)
    x, weights, ids = _inputs(tokens, 2)
    to = dict(device=DEVICE)
    got = fused_moe(x.to(**to), layer.w13.data.to(**to), layer.w2.data.to(**to), weights.to(**to), ids.to(**to),
                    w13_bias=None if not bias else layer.w13_bias.data.to(**to),
                    w2_bias=None if not bias else layer.w2_bias.data.to(**to), activation=act)
    torch.testing.assert_close(got.cpu(), layer(x, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", fp4_moe.FORMATS)
def test_fp4_reference_takes_biases_and_the_clamped_swiglu(fmt):
    layer = _layer(3)
    w13, w2 = fp4_moe.quantize(layer.w13.data, fmt), fp4_moe.quantize(layer.w2.data, fmt)
    x, weights, ids = _inputs(7, 4)
    got = fp4_moe.reference(x, w13, w2, weights, ids, layer.w13_bias.data, layer.w2_bias.data, ACT)
    dense13 = torch.stack([w13.dequantize(e) for e in range(EXPERTS)])
    dense2 = torch.stack([w2.dequantize(e) for e in range(EXPERTS)])
    torch.testing.assert_close(got, _hf_loop(layer, x, weights, ids, dense13, dense2), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("fmt", fp4_moe.FORMATS)
@pytest.mark.parametrize("tokens", [1, 13])
def test_triton_fused_moe_fp4_with_gpt_oss_options(fmt, tokens):
    from pressroom.kernels.triton.fused_moe import fused_moe_fp4
    layer = _layer(5)
    w13, w2 = fp4_moe.quantize(layer.w13.data, fmt), fp4_moe.quantize(layer.w2.data, fmt)
    x, weights, ids = _inputs(tokens, 6)
    options = dict(w13_bias=layer.w13_bias.data, w2_bias=layer.w2_bias.data, activation=ACT)
    want = fp4_moe.reference(x, w13, w2, weights, ids, **options)

    def on(w):
        return fp4_moe.Fp4Experts(*(t.to(DEVICE) if t is not None else None
                                    for t in (w.packed, w.scales, w.global_scale)))
    got = fused_moe_fp4(x.to(DEVICE), on(w13), on(w2), weights.to(DEVICE), ids.to(DEVICE),
                        **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()})
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
