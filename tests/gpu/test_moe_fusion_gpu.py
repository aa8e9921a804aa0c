"""The folded MoE launches on CUDA (issue 44): shared experts inside the routed experts' kernels and the token-major
GEMVs, at the real expert shapes of Qwen3-30B-A3B, DeepSeek-V2-Lite and Qwen1.5-MoE-A2.7B, against an fp32
reference; the MoE blocks with no host sync (torch's sync debug mode raises on one) and replayed from a CUDA graph;
tiny Qwen2-MoE and DeepSeek-V2 engines on CUDA with their shared experts folded, against HF."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the MoE kernels at real shapes")]

if torch.cuda.is_available():
    from pressroom.kernels.triton.fused_moe import MoeLaunch, SharedExperts, default_launch, fused_moe, gemv_launch
    from pressroom.model.layers.fused_moe import RouterConfig, with_shared

# name: (routed experts, hidden, intermediate, top_k, shared experts' width or 0, gated shared expert)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8, 0, False), "deepseek-v2-lite": (64, 2048, 1408, 6, 2816, False),
          "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4, 5632, True)}


def _reference(x, w13, w2, weights, ids, shared_w13=None, shared_w2=None, shared_weight=None) -> torch.Tensor:
    """fp32 over the bf16 weights, the intermediate rounded to bf16 as the kernels store it."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        rows, which = (ids == expert).nonzero(as_tuple=True)
        gate, up = (x[rows].float() @ w13[expert].float().T).chunk(2, dim=-1)
        mid = (F.silu(gate) * up).to(x.dtype).float()
        out.index_add_(0, rows, (mid @ w2[expert].float().T) * weights[rows, which, None])
    if shared_w13 is not None:
        gate, up = (x.float() @ shared_w13.float().T).chunk(2, dim=-1)
        out += ((F.silu(gate) * up).to(x.dtype).float() @ shared_w2.float().T) * shared_weight
    return out


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 4, 64, 1024])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_folded_moe_at_real_shapes(name, tokens, path):
    experts, hidden, inter, top_k, width, gated = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    top = torch.randn(tokens, experts, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights, ids = top.values / top.values.sum(-1, keepdim=True), top.indices
    shared, extra = None, {}
    if width:
        shared_w13 = (torch.randn(2 * width, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
        shared_w2 = (torch.randn(hidden, width, device="cuda", generator=gen) * width ** -0.5).bfloat16()
        gate = (x, torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()) if gated else None
        shared = SharedExperts(shared_w13, shared_w2, width // inter)
        shared_weight = torch.sigmoid(x.float() @ gate[1].float().T) if gated else 1.0
        extra = dict(shared_w13=shared_w13, shared_w2=shared_w2, shared_weight=shared_weight)
        expected = _reference(x, w13, w2, weights, ids, **extra)
        weights, ids = with_shared(weights, ids, experts, shared.count, gate)
    else:
        expected = _reference(x, w13, w2, weights, ids)
    launch = gemv_launch() if path == "gemv" else default_launch(tokens, ids.shape[1], experts)
    got = fused_moe(x, w13, w2, weights, ids, launch, all_local=True, shared=shared)
    assert (got.float() - expected).abs().max() <= 2e-2 * expected.abs().max()


def _blocks():
    """A Qwen2-MoE block (Qwen1.5-MoE-A2.7B's shape, its gated shared expert four experts wide) and a DeepSeek-V2
    block (V2-Lite's shape, two shared experts), bf16 on CUDA, random weights."""
    import transformers

    from pressroom.model.models.deepseek import DeepseekMoE
    from pressroom.model.models.moe import SparseMoeBlock
    torch.manual_seed(0)
    with torch.device("cuda"):
        qwen = SparseMoeBlock(2048, 60, 1408, RouterConfig(top_k=4, renormalize=False), shared_intermediate=5632,
                              gated_shared=True).bfloat16()
        cfg = transformers.DeepseekV2Config(hidden_size=2048, moe_intermediate_size=1408, n_shared_experts=2,
                                            n_routed_experts=64, num_experts_per_tok=6)
        deepseek = DeepseekMoE(cfg, 64, RouterConfig(top_k=6, renormalize=False)).bfloat16()
    for block in (qwen, deepseek):
        for p in block.parameters():
            p.data.normal_(0, 0.02)
    return {"qwen2_moe": qwen, "deepseek_v2": deepseek}


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v2"])
def test_blocks_fold_their_shared_experts_and_never_sync_with_the_host(name):
    """Decode (1 token: the GEMVs), a small batch and a prefill large enough for torch's alignment: no host sync
    anywhere in the block (torch raises in sync debug mode "error"); the folded output equals the unfolded one
    (routed experts plus the dense shared MLP) within bf16 rounding."""
    block = _blocks()[name]
    mlp = getattr(block, "shared_expert", None) or block.shared_experts
    shared = block.experts.shared_experts_of(mlp)
    assert shared is not None
    for tokens in (1, 8, 1024):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        block(x)  # compile outside the debug mode
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = block(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        unfolded = _unfolded(block, mlp, x)
        assert (got.float() - unfolded.float()).abs().max() <= 3e-2 * unfolded.float().abs().max()


def _unfolded(block, mlp, x: torch.Tensor) -> torch.Tensor:
    """The block's routed experts then its dense shared MLP, as separate launches (the path before folding)."""
    from pressroom.model.layers.fused_moe import select_experts
    bias = getattr(block.gate, "e_score_correction_bias", None)
    out = block.experts(x, *select_experts(block.gate(x), block.router, bias))
    shared = mlp(x)
    gate = getattr(block, "shared_expert_gate", None)
    return out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v2"])
def test_a_folded_block_replays_from_a_cuda_graph(name):
    block = _blocks()[name]
    static = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    block(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(static)
    for seed in range(3):
        gen = torch.Generator("cuda").manual_seed(seed)
        x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, block(x))


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_tiny_engines_with_folded_shared_experts_equal_hf(arch, tmp_path):
    """The engines on CUDA (decodes from CUDA graphs) with every MoE layer's shared experts folded: 64 greedy tokens
    equal HF's on the CPU, prompt logprobs within 1e-3."""
    import transformers
    from conftest import hf_greedy, hf_prompt_logprobs, random_prompts, tiny_config

    from pressroom import LLM, SamplingParams
    torch.manual_seed(1234)
    transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    llm = LLM(str(tmp_path), device="cuda", skip_tokenizer_init=True, dtype="float32", kv_cache_memory_gib=0.05)
    blocks = [layer.mlp for layer in llm.engine.runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert blocks and all(b.experts.shared_experts_of(getattr(b, "shared_expert", None) or b.shared_experts)
                          for b in blocks)
    prompts = random_prompts(4, low=4, high=80, seed=7)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False, prompt_logprobs=0)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 64)
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(hf, prompt))) < 1e-3


def test_decode_launches_per_moe_layer():
    """Kernels one batch-1 MoE block launches, counted by the profiler: DeepSeek-V2-Lite's with its shared experts
    folded is the router GEMV, the router kernel and the two GEMVs (4; it was 11 before folding), printed with -s."""
    from torch.profiler import ProfilerActivity, profile
    block = _blocks()["deepseek_v2"]
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    block(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        block(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"{len(kernels)} kernels: {kernels}")
    assert len(kernels) <= 5, kernels


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_grouped_router_launch_at_deepseek_v3_shape(tokens):
    """256 experts in 8 groups, 4 kept, top-8, sigmoid with a correction bias, one shared expert appended: the one
    launch against the torch router (the same experts; weights within fp32 rounding)."""
    from pressroom.kernels.triton.fused_moe import route_topk
    from pressroom.model.layers.fused_moe import select_experts_torch
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 256, device="cuda", generator=gen)
    bias = torch.rand(256, device="cuda", generator=gen) * 0.1
    cfg = RouterConfig(top_k=8, scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5)
    expected_w, expected_ids = with_shared(*select_experts_torch(logits, cfg, bias), 256, 1)
    weights, ids = route_topk(logits, 8, True, True, 2.5, bias, 1, groups=(8, 4, True))
    got_ids, order = ids[:, :8].long().sort(dim=-1)
    want_ids, want_order = expected_ids[:, :8].sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(weights[:, :8].gather(1, order), expected_w[:, :8].gather(1, want_order))
    assert torch.equal(ids[:, 8:].long(), expected_ids[:, 8:])


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_fp8_gemvs_at_deepseek_v3_shape(tokens):
    """DeepSeek-V3's FP8 block experts (256, hidden 7168, 2048 intermediate, top-8): the GEMVs against the grouped
    FP8 GEMMs, DeepSeek's recipe (activations quantized per group)."""
    from pressroom.kernels import fp8_moe
    from pressroom.kernels.triton.fused_moe_fp8 import _random_experts as random_experts
    from pressroom.kernels.triton.fused_moe_fp8 import fp8_gemv_launch, fused_moe_fp8
    w13, w2 = random_experts(256, 2 * 2048, 7168, 2), random_experts(256, 7168, 2048, 1)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 7168, device="cuda", generator=gen).bfloat16()
    top = torch.randn(tokens, 256, device="cuda", generator=gen).topk(8, dim=-1)
    weights = torch.softmax(top.values, dim=-1)
    gemv = fused_moe_fp8(x, w13, w2, weights, top.indices, launch=fp8_gemv_launch(), all_local=True)
    grouped = fused_moe_fp8(x, w13, w2, weights, top.indices, launch=MoeLaunch(16, 64, 128, 4, 3), all_local=True)
    want = fp8_moe.reference(x, w13, w2, weights, top.indices)
    scale = want.float().abs().max()
    assert (gemv.float() - grouped.float()).abs().max() <= 2e-2 * scale
    assert (gemv.float() - want.float()).abs().max() <= 2e-2 * scale
