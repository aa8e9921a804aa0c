"""gpt-oss on CUDA: the Triton attention with sinks and a 128-token window and the fused MoE with expert biases and
the clamped SwiGLU (bf16 and MXFP4 experts) at gpt-oss-20b's shapes against fp32 torch references; a tiny gpt-oss
(dense fused experts and OpenAI's MXFP4 form) on CUDA, CUDA graphs and eager, against the CPU's path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, scattered_paged_layout
from fp4_checkpoint import write_mxfp4_checkpoint
from gpt_oss_checkpoint import save_tiny_gpt_oss

from pressroom import LLM, SamplingParams
from pressroom.kernels import fp4_moe
from pressroom.kernels.moe_activation import ClampedSwiglu, gated

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128  # gpt-oss-20b's attention
EXPERTS, HIDDEN, INTER, TOP_K = 32, 2880, 2880, 4  # and its experts
ACT = ClampedSwiglu(1.702, 7.0)


@pytest.mark.parametrize("specs, splits", [
    ([(1000, 1), (5000, 1), (130, 1), (7, 1)], 1),
    ([(1000, 1), (5000, 1), (130, 1), (7, 1)], 8),
    ([(300, 1), (700, 200), (256, 256)], 1),  # chunks after a cached prefix and a fresh prompt, both past the window
])
@pytest.mark.parametrize("window", [WINDOW, None])
def test_attention_with_sinks_at_gpt_oss_20b_shapes(specs, splits, window):
    from pressroom.kernels.triton.attention import paged_attention, paged_attention_reference
    gen = torch.Generator().manual_seed(len(specs) + splits)
    tables, lens, loc, blocks = scattered_paged_layout(specs, 16, gen)
    cache = torch.randn(2, blocks, 16, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(int(loc[-1]), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
    sinks = (torch.randn(HEADS, generator=gen) * 2).cuda()
    tables, lens, loc = tables.cuda(), lens.cuda(), loc.cuda()
    got = paged_attention(q, cache, tables, lens, loc, max(n for _, n in specs), HEAD_DIM ** -0.5, torch.empty_like(q),
                          splits, window=window, sinks=sinks)
    want = paged_attention_reference(q, cache, tables, lens, loc, HEAD_DIM ** -0.5,
                                     torch.empty(q.shape, device="cuda"), window, sinks)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def _dense_reference(x, w13, w2, b13, b2, weights, ids) -> torch.Tensor:
    """fp32 per-expert loop: gate/up with bias, the clamped SwiGLU, down with bias, weighted by top-k."""
    out = torch.zeros(x.shape, device=x.device)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[token].float(), w13[e].float(), b13[e].float()).chunk(2, dim=-1)
        y = F.linear(gated(gate, up, ACT), w2[e].float(), b2[e].float())
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def _routing(tokens: int, gen: torch.Generator):
    top = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1)
    return torch.softmax(top.values, dim=-1), top.indices


def test_fused_moe_with_biases_and_clamped_swiglu_at_gpt_oss_20b_shapes():
    from pressroom.kernels.triton.fused_moe import fused_moe
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    b13 = torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=gen).to(torch.bfloat16)
    b2 = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    for tokens in (1, 16, 300):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = _routing(tokens, gen)
        want = _dense_reference(x, w13, w2, b13, b2, weights, ids)
        got = fused_moe(x, w13, w2, weights, ids, all_local=True, w13_bias=b13, w2_bias=b2, activation=ACT)
        assert (got.float() - want).abs().max() <= 2 ** -6 * want.abs().max(), tokens


def test_fused_moe_fp4_with_biases_and_clamped_swiglu_at_gpt_oss_20b_shapes():
    from pressroom.kernels.triton.fused_moe import fused_moe_fp4
    gen = torch.Generator(device="cuda").manual_seed(1)
    w13 = fp4_moe.quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * 0.05, "mxfp4")
    w2 = fp4_moe.quantize(torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * 0.02, "mxfp4")
    b13 = torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=gen).to(torch.bfloat16)
    b2 = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    for tokens in (1, 16, 300):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = _routing(tokens, gen)
        want = fp4_moe.reference(x.float(), w13, w2, weights, ids, b13, b2, ACT)
        got = fused_moe_fp4(x, w13, w2, weights, ids, all_local=True, w13_bias=b13, w2_bias=b2, activation=ACT)
        assert (got.float() - want).abs().max() <= 2 ** -6 * want.abs().max(), tokens


LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
# past the window, and one long enough for split-KV decodes on the full-attention layers
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(3, low=12, high=40, seed=1) + random_prompts(1, 300, 301)]


def _run(path, device: str, **kw) -> tuple[torch.Tensor, list[list[int]]]:
    llm = LLM(str(path), device=device, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.25, **kw)
    outs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    logprobs = torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return logprobs, tokens


@pytest.mark.parametrize("form", ["dense", "mxfp4_checkpoint"])
def test_a_tiny_gpt_oss_on_cuda_matches_the_cpu(tmp_path, form):
    path = tmp_path / "m"
    save_tiny_gpt_oss(path)
    if form == "mxfp4_checkpoint":
        write_mxfp4_checkpoint(str(path), tmp_path / "q", unconverted=("self_attn",))
        path = tmp_path / "q"
    cuda, cuda_tokens = _run(path, "cuda")  # decode steps replay CUDA graphs
    eager, eager_tokens = _run(path, "cuda", enforce_eager=True)
    cpu, cpu_tokens = _run(path, "cpu")
    assert cuda_tokens == eager_tokens == cpu_tokens
    assert (cuda - cpu).abs().max() < 1e-3, (cuda - cpu).abs().max()
    assert (eager - cpu).abs().max() < 1e-3, (eager - cpu).abs().max()
