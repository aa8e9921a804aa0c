"""The MoE launches folded together (issue 44): shared experts read as extra experts of the routed experts' kernels,
the shared experts' routing in the router's launch, and the token-major GEMVs (no alignment, the top-k sum in the
down pass), each against the unfused path on the same weights: FusedMoE's per-expert torch loop plus the dense
shared MLP. Run on the CPU by Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.kernels import triton as triton_kernels  # noqa: E402
from pressroom.kernels.moe_activation import ClampedSwiglu  # noqa: E402
from pressroom.kernels.triton.fused_moe import (  # noqa: E402
    GEMV_MAX_TOKENS,
    MoeLaunch,
    SharedExperts,
    choose_launch,
    fused_moe,
    route_topk,
)
from pressroom.model.layers.fused_moe import FusedMoE, RouterConfig, select_experts_torch, with_shared  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GROUPED = MoeLaunch(16, 32, 16, 4, 2)  # K tiles that divide the tiny widths
GROUPED_MASKED = MoeLaunch(16, 32, 64, 4, 2)  # ... and that do not (inputs 32 and 16)
GEMV = MoeLaunch(1, 16, 16, 4, 1, gemv=True)
GEMV_WIDE = MoeLaunch(1, 64, 256, 4, 1, gemv=True)  # one column block, one masked K tile
LAUNCHES = [GROUPED, GROUPED_MASKED, GEMV, GEMV_WIDE]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _experts(experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(experts, hidden, inter)
    layer.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    layer.w2.data = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    return layer


def _shared_mlp(hidden: int, width: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(2 * width, hidden, generator=gen) * 0.2).to(dtype),
            (torch.randn(hidden, width, generator=gen) * 0.2).to(dtype))


def _dense_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down.float())


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), atol=TOL[dtype] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda c: f"{'gemv' if c.gemv else 'grouped'}-k{c.block_k}")
@pytest.mark.parametrize("tokens, gated", [(1, False), (3, True), (7, False)])
def test_folded_shared_experts_equal_the_routed_loop_plus_the_dense_mlp(launch, tokens, gated):
    """DeepSeek's form (shared experts weighted 1) and Qwen2-MoE's (one shared expert three routed experts wide,
    under its sigmoid gate): one fused_moe call over routed + shared equals the unfused sum, in fp32."""
    experts, hidden, inter, top_k, count = 6, 32, 16, 2, 3 if gated else 2
    layer = _experts(experts, hidden, inter, seed=tokens)
    gate_up, down = _shared_mlp(hidden, count * inter, seed=tokens + 1)
    gen = torch.Generator().manual_seed(tokens + 2)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_weight = torch.randn(1, hidden, generator=gen) if gated else None
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    expected = layer(x, weights, ids) + _dense_mlp(x, gate_up, down) * (
        torch.sigmoid(x @ gate_weight.T) if gated else 1.0)
    weights, ids = with_shared(weights, ids, experts, count, None if gate_weight is None else (x, gate_weight))
    got = fused_moe(x.to(DEVICE), layer.w13.data.to(DEVICE), layer.w2.data.to(DEVICE), weights.to(DEVICE),
                    ids.to(DEVICE), launch, shared=SharedExperts(gate_up.to(DEVICE), down.to(DEVICE), count))
    _close(got, expected, torch.float32)


# Triton 3.6's interpreter multiplies bf16 tiles in tl.dot as raw bits (the grouped GEMMs give ~1e10 there, before
# this change too): on the CPU only the GEMVs run in bf16; tests/gpu/test_moe_fusion_gpu.py checks both on CUDA.
@pytest.mark.parametrize("launch", [GEMV] if DEVICE == "cpu" else [GROUPED, GEMV])
def test_folded_shared_experts_in_bf16(launch):
    """bf16 weights and activations: the folded sum stays within bf16 rounding of the fp32 unfused one."""
    experts, hidden, inter, top_k, count, tokens = 8, 64, 32, 2, 2, 4
    layer = _experts(experts, hidden, inter, seed=3, dtype=torch.bfloat16)
    gate_up, down = _shared_mlp(hidden, count * inter, seed=4, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    routed = _experts(experts, hidden, inter, seed=3)
    routed.w13.data, routed.w2.data = layer.w13.data.float(), layer.w2.data.float()
    expected = routed(x.float(), weights, ids) + _dense_mlp(x, gate_up, down)
    weights, ids = with_shared(weights, ids, experts, count)
    got = fused_moe(x.to(DEVICE), layer.w13.data.to(DEVICE), layer.w2.data.to(DEVICE), weights.to(DEVICE),
                    ids.to(DEVICE), launch, shared=SharedExperts(gate_up.to(DEVICE), down.to(DEVICE), count))
    assert got.dtype == torch.bfloat16
    _close(got, expected, torch.bfloat16)


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (4, 6, 3), (2, 8, 8)])
def test_the_gemvs_equal_the_grouped_gemms(tokens, experts, top_k):
    """The token-major GEMVs against the aligned grouped GEMMs and the per-expert loop, with another rank's experts
    (-1) in the routing: they add nothing."""
    layer = _experts(experts, 32, 48, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 32, generator=gen)
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    mine = ids < experts // 2
    expected = layer(x, torch.where(mine, weights, 0.0), ids)
    local = torch.where(mine, ids, -1).to(DEVICE)
    args = (x.to(DEVICE), layer.w13.data[:experts // 2].to(DEVICE), layer.w2.data[:experts // 2].to(DEVICE),
            weights.to(DEVICE), local)
    _close(fused_moe(*args, GEMV), expected, torch.float32)
    _close(fused_moe(*args, GEMV_WIDE), expected, torch.float32)
    _close(fused_moe(*args, GROUPED), expected, torch.float32)


def test_the_gemvs_take_gpt_oss_biases_and_clamped_swiglu():
    """gpt-oss's options through the GEMVs as through the grouped GEMMs: biases before the activation and before
    the top-k weight, the clamped SwiGLU."""
    experts, hidden, inter, tokens = 4, 32, 16, 2
    gen = torch.Generator().manual_seed(11)
    act = ClampedSwiglu(alpha=1.702, limit=7.0)
    layer = FusedMoE(experts, hidden, inter, bias=True, activation=act)
    layer.w13.data = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    layer.w2.data = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    layer.w13_bias.data = torch.randn(experts, 2 * inter, generator=gen)
    layer.w2_bias.data = torch.randn(experts, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=2))
    expected = layer(x, weights, ids)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = fused_moe(to(x), to(layer.w13.data), to(layer.w2.data), to(weights), to(ids), GEMV,
                    w13_bias=to(layer.w13_bias.data), w2_bias=to(layer.w2_bias.data), activation=act)
    _close(got, expected, torch.float32)


@pytest.mark.parametrize("scoring, bias, gated", [("softmax", False, True), ("sigmoid", True, False),
                                                  ("softmax", False, False)])
def test_the_router_launch_appends_the_shared_experts(scoring, bias, gated):
    """route_topk with shared experts: the routed top-k as before, then the shared ids (experts ..) weighted 1 or by
    the shared expert's sigmoid gate over the token, as the torch router plus with_shared gives them."""
    experts, top_k, count, tokens, hidden = 10, 3, 2, 5, 40
    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(tokens, experts, generator=gen)
    x, gate = torch.randn(tokens, hidden, generator=gen), torch.randn(1, hidden, generator=gen)
    correction = torch.rand(experts, generator=gen) if bias else None
    cfg = RouterConfig(top_k=top_k, scoring=scoring, renormalize=True, routed_scaling_factor=1.5)
    shared_gate = (x, gate) if gated else None
    expected_w, expected_ids = with_shared(*select_experts_torch(logits, cfg, correction), experts, count, shared_gate)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    weights, ids = route_topk(to(logits), top_k, scoring == "sigmoid", True, 1.5, to(correction), count,
                              None if not gated else (to(x), to(gate)))
    assert ids.shape == (tokens, top_k + count)
    assert torch.equal(ids[:, top_k:].cpu().long(), expected_ids[:, top_k:])
    torch.testing.assert_close(weights[:, top_k:].cpu(), expected_w[:, top_k:], atol=1e-6, rtol=1e-5)
    routed, order = ids[:, :top_k].cpu().long().sort(dim=-1)
    expected_routed, expected_order = expected_ids[:, :top_k].sort(dim=-1)
    assert torch.equal(routed, expected_routed)
    torch.testing.assert_close(weights[:, :top_k].cpu().gather(1, order),
                               expected_w[:, :top_k].gather(1, expected_order))


def test_without_a_sweep_small_steps_take_the_gemvs():
    w13 = torch.empty(8, 32, 16)
    assert choose_launch(1, w13, 2).gemv and choose_launch(GEMV_MAX_TOKENS, w13, 2, shared=1).gemv
    assert not choose_launch(GEMV_MAX_TOKENS + 1, w13, 2).gemv


def _qwen2_moe_block(tokens_seed: int = 0):
    from pressroom.model.models.moe import SparseMoeBlock
    torch.manual_seed(tokens_seed)
    block = SparseMoeBlock(32, 6, 16, RouterConfig(top_k=2, renormalize=False), shared_intermediate=48,
                           gated_shared=True)
    for p in block.parameters():
        p.data = torch.randn_like(p) * 0.3
    return block


def _deepseek_block():
    import transformers

    from pressroom.model.models.deepseek import DeepseekMoE
    cfg = transformers.DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_shared_experts=2,
                                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                        norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(1)
    block = DeepseekMoE(cfg, 8, RouterConfig(top_k=2, scoring="sigmoid", num_groups=4, topk_groups=2,
                                             routed_scaling_factor=2.5))
    for p in block.parameters():
        p.data = torch.randn_like(p) * 0.3
    return block


@pytest.mark.parametrize("make", [_qwen2_moe_block, _deepseek_block], ids=["qwen2_moe", "deepseek_v3"])
def test_a_block_folded_equals_the_block_unfused(make):
    """The MoE blocks' CUDA path (shared experts folded, one reduction) against their CPU path (routed loop plus the
    dense shared MLP) on the same weights, in fp32: Qwen2-MoE's gated shared expert (three experts wide) and
    DeepSeek-V3's two shared experts behind a grouped sigmoid router."""
    block = make()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    expected = block(x)  # the CPU keeps the shared MLP unfolded
    block.to(DEVICE)  # in place: the folded path reads the weights where the kernels run
    shared_mlp = getattr(block, "shared_expert", None) or block.shared_experts
    shared = block.experts.shared_experts_of(shared_mlp)
    assert shared is not None and shared.count == shared_mlp.down_proj.weight.shape[1] // 16
    _close(block.forward_folded(x.to(DEVICE), shared), expected, torch.float32)


def test_shared_experts_stay_unfolded_where_the_kernels_cannot_take_them():
    """A hooked (LoRA) or biased shared MLP, a width that is not whole experts, quantized or biased experts: None."""
    from pressroom.model.models.llama import LlamaMLP
    block = _qwen2_moe_block()
    experts, mlp = block.experts, block.shared_expert
    assert experts.shared_experts_of(mlp) is not None
    handle = mlp.down_proj.register_forward_hook(lambda *args: None)
    assert experts.shared_experts_of(mlp) is None
    handle.remove()
    assert experts.shared_experts_of(LlamaMLP(32, 40)) is None  # 40 is not a multiple of the experts' 16
    assert experts.shared_experts_of(None) is None
    biased = FusedMoE(6, 32, 16, bias=True)
    assert biased.shared_experts_of(mlp) is None


@pytest.mark.parametrize("fmt, top_k", [("mxfp4", 2), ("nvfp4", 3)])
def test_fp4_experts_take_the_same_gemvs(fmt, top_k):
    """FP4 experts (packed, dequantized in registers) through the GEMVs: equal to the grouped FP4 GEMMs and to the
    torch reference, with another rank's experts (-1), gpt-oss's biases, a partial last tile of inputs and a top-k
    that is not a power of two."""
    from pressroom.kernels import fp4_moe
    from pressroom.kernels.triton.fused_moe import fused_moe_fp4
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens = 4, 96, 32, 3
    w13 = fp4_moe.quantize(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2, fmt)
    w2 = fp4_moe.quantize(torch.randn(experts, hidden, inter, generator=gen) * 0.2, fmt)
    biases = dict(w13_bias=torch.randn(experts, 2 * inter, generator=gen), w2_bias=torch.randn(experts, hidden,
                                                                                               generator=gen))
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    ids = torch.where(ids == 3, -1, ids)
    expected = fp4_moe.reference(x, w13, w2, torch.where(ids < 0, 0.0, weights), ids.clamp(min=0), **biases)
    on = lambda w: fp4_moe.Fp4Experts(*(None if t is None else t.to(DEVICE)  # noqa: E731
                                        for t in (w.packed, w.scales, w.global_scale)))
    args = (x.to(DEVICE), on(w13), on(w2), weights.to(DEVICE), ids.to(DEVICE))
    biases = {name: b.to(DEVICE) for name, b in biases.items()}
    gemv = fused_moe_fp4(*args, MoeLaunch(1, 16, 64, 4, 1, gemv=True), **biases)  # whole blocks of 32 inputs a tile
    grouped = fused_moe_fp4(*args, MoeLaunch(16, 32, 64, 4, 2), **biases)
    _close(gemv, grouped, torch.float32)
    _close(gemv, expected, torch.float32)


@pytest.mark.parametrize("quantized, pow2, top_k", [(True, True, 3), (False, False, 2)])
def test_fp8_block_experts_take_the_same_gemvs(quantized, pow2, top_k):
    """DeepSeek's FP8 block experts through the GEMVs (activations quantized per 128-input group in registers, or
    weight-only), whole and partial last blocks, power-of-two scales, a top-k that is not a power of two: equal to
    the grouped FP8 GEMMs and to the reference; another rank's experts (-1) add nothing."""
    from pressroom.kernels import fp8_moe
    from pressroom.kernels.triton.fused_moe_fp8 import fp8_gemv_launch, fused_moe_fp8
    gen = torch.Generator().manual_seed(7)
    experts, tokens, hidden, inter = 4, 2, 200, 192  # a partial last block each way
    w13 = fp8_moe.quantize(torch.randn(experts, 2 * inter, hidden, generator=gen), halves=2)
    w2 = fp8_moe.quantize(torch.randn(experts, hidden, inter, generator=gen))
    x = torch.randn(tokens, hidden, generator=gen) * 4
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    ids = torch.where(ids == 3, -1, ids)
    options = dict(quantize_activations=quantized, pow2_scales=pow2)
    want = fp8_moe.reference(x, w13, w2, torch.where(ids < 0, 0.0, weights), ids.clamp(min=0), **options)
    on = lambda w: fp8_moe.Fp8Experts(w.weight.to(DEVICE), w.scale.to(DEVICE), w.halves)  # noqa: E731
    args = (x.to(DEVICE), on(w13), on(w2), weights.to(DEVICE), ids.to(DEVICE))
    gemv = fused_moe_fp8(*args, launch=fp8_gemv_launch(), **options).cpu()
    grouped = fused_moe_fp8(*args, launch=MoeLaunch(16, 64, 128, 4, 2), **options).cpu()
    tol = dict(rtol=1e-4, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(gemv, grouped, **tol)
    torch.testing.assert_close(gemv, want, **tol)


@pytest.mark.parametrize("launch", [GROUPED, GEMV], ids=["grouped", "gemv"])
def test_expert_parallel_ranks_with_folded_shared_experts_sum_to_the_whole(launch):
    """Two expert-parallel ranks, each with half the routed experts and half the shared MLP's width (as its
    column/row-parallel layers hold it), the shared ids mapped after each rank's own experts (local_ids): the two
    partial sums (what the one all-reduce adds) equal the whole layer unfused."""
    experts, hidden, inter, top_k, width, tokens = 6, 32, 16, 2, 64, 3
    whole = _experts(experts, hidden, inter, seed=21)
    gate_up, down = _shared_mlp(hidden, width, seed=22)
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = select_experts_torch(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    expected = whole(x, weights, ids) + _dense_mlp(x, gate_up, down)
    half, part = width // 2, experts // 2
    weights, ids = with_shared(weights, ids, experts, half // inter)
    total = torch.zeros(tokens, hidden)
    for rank in range(2):
        layer = FusedMoE(experts, hidden, inter, expert_range=(rank * part, (rank + 1) * part))
        layer.w13.data, layer.w2.data = whole.w13.data[rank * part:(rank + 1) * part], \
            whole.w2.data[rank * part:(rank + 1) * part]
        cols = slice(rank * half, (rank + 1) * half)
        shared = SharedExperts(torch.cat((gate_up[:width][cols], gate_up[width:][cols])).to(DEVICE),
                               down[:, cols].contiguous().to(DEVICE), half // inter)
        local = layer.local_ids(ids.to(DEVICE))
        total += fused_moe(x.to(DEVICE), layer.w13.data.to(DEVICE), layer.w2.data.to(DEVICE), weights.to(DEVICE),
                           local, launch, shared=shared).cpu()
    _close(total, expected, torch.float32)


@pytest.mark.parametrize("experts, groups, topk_groups, top_k, scoring, top2, shared", [
    (8, 4, 2, 2, "sigmoid", True, 1),  # the tiny DeepSeek-V3 of the parity tests
    (64, 8, 4, 8, "sigmoid", True, 0),  # V3's form: 8 groups, 4 kept, top-8
    (60, 6, 3, 6, "softmax", False, 2),  # V2's group_limited_greedy (by group max), members not a power of two
    (6, 2, 1, 2, "softmax", False, 0)])  # the tiny V2's
def test_the_grouped_router_launch_equals_select_experts(experts, groups, topk_groups, top_k, scoring, top2, shared):
    """DeepSeek's grouped routers (a group's best or two best choices score it; only the best groups compete) in
    the router's one launch: the same experts and weights as the torch router, the shared experts appended."""
    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(7, experts, generator=gen)
    correction = torch.rand(experts, generator=gen) if scoring == "sigmoid" else None
    cfg = RouterConfig(top_k=top_k, scoring=scoring, renormalize=scoring == "sigmoid", num_groups=groups,
                       topk_groups=topk_groups, group_score="top2_sum" if top2 else "max",
                       routed_scaling_factor=2.5)
    expected_w, expected_ids = with_shared(*select_experts_torch(logits, cfg, correction), experts, shared)
    weights, ids = route_topk(logits.to(DEVICE), top_k, scoring == "sigmoid", cfg.renormalize, 2.5,
                              None if correction is None else correction.to(DEVICE), shared,
                              groups=(groups, topk_groups, top2))
    routed, order = ids[:, :top_k].cpu().long().sort(dim=-1)
    expected_routed, expected_order = expected_ids[:, :top_k].sort(dim=-1)
    assert torch.equal(routed, expected_routed)
    torch.testing.assert_close(weights[:, :top_k].cpu().gather(1, order),
                               expected_w[:, :top_k].gather(1, expected_order))
    assert torch.equal(ids[:, top_k:].cpu().long(), expected_ids[:, top_k:])
    assert torch.equal(weights[:, top_k:].cpu(), expected_w[:, top_k:])
