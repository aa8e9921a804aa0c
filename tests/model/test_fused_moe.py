"""The mixture-of-experts layer: router variants against HF's own routers, and the expert range."""
from __future__ import annotations

import pytest
import torch

from pressroom.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE, RouterConfig, select_experts


def _same_choice(ours: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Equal per-token expert sets and weights (top-k order is not part of the contract)."""
    w, i = ours
    order, ref_order = i.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(i.gather(1, order), ids.gather(1, ref_order))
    assert torch.allclose(w.gather(1, order), weights.float().gather(1, ref_order), atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_top_k_matches_qwen2_moe_router(norm):
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    cfg = transformers.Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    router = Qwen2MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(40, 16)
    logits, weights, ids = router(x)
    _same_choice(select_experts(logits, RouterConfig(top_k=3, renormalize=norm)), ids, weights)


def test_grouped_sigmoid_with_bias_matches_deepseek_v3_router():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.uniform_(0, 0.5)  # steers the choice (groups included), not the weights
    x = torch.randn(64, 16)
    logits, weights, ids = router(x)
    rc = RouterConfig(top_k=4, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2,
                      routed_scaling_factor=2.5)
    ours = select_experts(logits, rc, router.e_score_correction_bias)
    _same_choice(ours, ids, weights)
    assert not torch.equal(ours[1].sort().values, select_experts(logits, rc)[1].sort().values)  # the bias mattered


def test_grouped_softmax_by_group_max_matches_deepseek_v2_router():
    """DeepSeek-V2's group_limited_greedy: softmax scores, groups ranked by their best expert, top-k
    weights scaled and never renormalised."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    cfg = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, n_group=4,
                                        num_experts_per_tok=3,
                                        topk_group=2, routed_scaling_factor=1.5, topk_method="group_limited_greedy")
    router = DeepseekV2TopkRouter(cfg)
    gen = torch.Generator().manual_seed(2)
    router.weight.data = torch.randn(16, 16, generator=gen)
    logits, weights, ids = router(torch.randn(512, 16, generator=gen))  # enough tokens for the rules to differ
    rc = RouterConfig(top_k=3, scoring="softmax", renormalize=False, num_groups=4, topk_groups=2, group_score="max",
                      routed_scaling_factor=1.5)
    _same_choice(select_experts(logits, rc), ids, weights)
    by_top2 = RouterConfig(top_k=3, scoring="softmax", renormalize=False, num_groups=4, topk_groups=2,
                           routed_scaling_factor=1.5)
    assert not torch.equal(select_experts(logits, by_top2)[1].sort().values, ids.sort().values)  # the rule mattered


def _experts(num: int, hidden: int, inter: int, expert_range=None, seed: int = 0) -> FusedMoE:
    layer = FusedMoE(num, hidden, inter, expert_range)
    gen = torch.Generator().manual_seed(seed)
    for e in range(num):
        for part in (GATE, UP, DOWN):
            shape = (hidden, inter) if part == DOWN else (inter, hidden)
            layer.weight_loader(layer.w2 if part == DOWN else layer.w13, torch.randn(shape, generator=gen), (part, e))
    return layer


def test_expert_ranges_sum_to_the_whole_layer_and_only_chosen_experts_run():
    whole = _experts(6, 16, 8)
    halves = [_experts(6, 16, 8, (0, 2)), _experts(6, 16, 8, (2, 6))]
    x = torch.randn(10, 16)
    weights, ids = select_experts(torch.randn(10, 6), RouterConfig(top_k=2))
    expected = whole(x, weights, ids)
    assert torch.allclose(halves[0](x, weights, ids) + halves[1](x, weights, ids), expected, atol=1e-5)
    # Reference: each token's experts, one by one.
    ref = torch.zeros_like(x)
    for t in range(10):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (whole.w13[e] @ x[t]).chunk(2)
            ref[t] += w * (whole.w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(expected, ref, atol=1e-4)
    # An expert nobody chose is never read: poison it.
    unused = sorted(set(range(6)) - set(ids.flatten().tolist()))
    if unused:
        whole.w13.data[unused[0]] = float("nan")
        assert torch.isfinite(whole(x, weights, ids)).all()


def test_a_wrong_expert_shape_or_index_is_a_clear_error():
    layer = FusedMoE(4, 16, 8)
    with pytest.raises(ValueError, match="expert 1's w1 has shape"):
        layer.weight_loader(layer.w13, torch.zeros(16, 8), (GATE, 1))
    with pytest.raises(ValueError, match="expert 9 does not exist"):
        layer.weight_loader(layer.w13, torch.zeros(8, 16), (GATE, 9))
    with pytest.raises(ValueError, match="expert range"):
        FusedMoE(4, 16, 8, (2, 6))


@pytest.mark.parametrize("config, billions", [("qwen3-30b-a3b", 30.53), ("mixtral-8x7b", 46.70)])
def test_committed_moe_configs_build_their_published_size(config, billions):
    """The shipped model shapes (pressroom/benchmarks/configs/) are the published ones; built on the meta device
    (no memory), the parameter count is the published one."""
    import transformers

    from pressroom.benchmarks.shapes import resolve_shape
    from pressroom.model.registry import resolve_architecture
    cfg = transformers.AutoConfig.from_pretrained(resolve_shape(config))
    with torch.device("meta"):
        model = resolve_architecture(cfg)(cfg)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert sum(isinstance(m, FusedMoE) for m in model.modules()) == cfg.num_hidden_layers


def test_a_moe_model_runs_in_bf16_on_the_cpu(tiny_model_dir):
    """The bf16 CPU path (the default on AVX-512-BF16 CPUs) against HF in fp32 on the same weights."""
    import transformers
    from conftest import hf_prompt_logprobs, random_prompts

    from pressroom import LLM, SamplingParams
    path = tiny_model_dir("qwen3_moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_gib=0.05)
    prompt = random_prompts(1, low=40, high=41, seed=3)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
    errors = sorted(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(hf, prompt)))
    assert errors[len(errors) // 2] < 0.05 and errors[-1] < 0.2
