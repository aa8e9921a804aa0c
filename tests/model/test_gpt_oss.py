"""gpt-oss equals HF transformers' GptOssForCausalLM on tiny random weights (fp32): greedy tokens (generated past
EOS) and prompt logprobs, with a sliding window shorter than the prompts (prefill, chunked prefill after a cached
prefix, and decodes all cross it), attention sinks, q/k/v/o, router and expert biases far from zero, a SwiGLU limit
the activations cross, and YaRN rope. Dense fused experts (HF's own checkpoint) and an MXFP4 checkpoint in
OpenAI's form (against HF on the weights HF's dequantizer decodes)."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs, random_prompts
from fp4_checkpoint import write_mxfp4_checkpoint, write_twin
from gpt_oss_checkpoint import WINDOW, save_tiny_gpt_oss

from pressroom import LLM, SamplingParams
from pressroom.model.models.gpt_oss import GptOssForCausalLM
from pressroom.model.quantization.fp4 import Fp4MoeMethod

TOKENS = 20
TOLERANCE = 1e-3  # fp32 both; different kernels (attention, sums)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory, smollm_tokenizer):
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    return str(path), save_tiny_gpt_oss(path, smollm_tokenizer)


def _check(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, TOKENS)
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(hf_model, prompt))) < TOLERANCE


def test_tiny_gpt_oss_matches_hf(tiny_gpt_oss):
    path, hf_model = tiny_gpt_oss
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    model = llm.engine.model
    assert isinstance(model, GptOssForCausalLM) and llm.engine.max_model_len == 512  # the window caps nothing
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [WINDOW, None, WINDOW, None]
    experts = model.model.layers[1].mlp.experts  # HF's interleaved gate/up columns, de-interleaved
    hf_experts = hf_model.model.layers[1].mlp.experts
    assert torch.equal(experts.w13.data[2, :64], hf_experts.gate_up_proj.data[2, :, 0::2].t())
    assert torch.equal(experts.w13_bias.data[2, 64:], hf_experts.gate_up_proj_bias.data[2, 1::2])
    assert torch.equal(experts.w2.data[2], hf_experts.down_proj.data[2].t())
    prompts = random_prompts(3, low=WINDOW + 4, high=40, seed=3)
    _check(llm, hf_model, prompts + [prompts[0][:-3] + [7, 8, 9]])  # the last shares a cached prefix


def test_tiny_gpt_oss_chunked_prefill_matches_hf(tiny_gpt_oss):
    path, hf_model = tiny_gpt_oss
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=16, max_num_seqs=4)
    _check(llm, hf_model, random_prompts(2, low=30, high=40, seed=4))


def test_the_sinks_and_biases_matter(tiny_gpt_oss, tmp_path):
    """The oracle is not blind to them: zeroing the sinks or the experts' biases moves HF's logprobs past the
    tolerance the comparisons use."""
    path, hf_model = tiny_gpt_oss
    prompt = random_prompts(1, low=30, high=31, seed=5)[0]
    base = torch.tensor(hf_prompt_logprobs(hf_model, prompt))
    for suffix in ("sinks", "experts.down_proj_bias"):
        saved = {n: p.detach().clone() for n, p in hf_model.named_parameters() if n.endswith(suffix)}
        with torch.no_grad():
            for n, p in hf_model.named_parameters():
                if n in saved:
                    p.zero_()
        moved = (torch.tensor(hf_prompt_logprobs(hf_model, prompt)) - base).abs().max()
        with torch.no_grad():
            for n, p in hf_model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
        assert moved > 20 * TOLERANCE, (suffix, moved)


def test_mxfp4_gpt_oss_checkpoint_matches_hf_on_the_decoded_weights(tiny_gpt_oss, tmp_path):
    """OpenAI's form: experts as `*_blocks` / `*_scales` of the transposed fused matrices, biases dense beside them,
    attention and router unconverted. The experts stay packed; pressroom equals HF on the decoded weights."""
    import transformers
    src, _ = tiny_gpt_oss
    decoded = write_mxfp4_checkpoint(src, tmp_path / "q", unconverted=("self_attn",))
    write_twin(src, tmp_path / "twin", decoded)
    llm = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=16)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, Fp4MoeMethod) and experts.w13.dtype == torch.uint8
    gate_up = decoded["model.layers.0.mlp.experts.gate_up_proj"][1]  # [hidden, 2 * inter], interleaved
    want = torch.cat([gate_up[:, 0::2].t(), gate_up[:, 1::2].t()])
    assert torch.equal(experts.quant_method.experts(experts, "w13").dequantize(1), want)  # bit for bit
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    _check(llm, hf, random_prompts(2, low=WINDOW + 4, high=40, seed=6))
    dense = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_memory_gib=0.05, quantization="none")
    assert dense.engine.model.model.layers[0].mlp.experts.w13.dtype == torch.float32
    assert torch.equal(dense.engine.model.model.layers[0].mlp.experts.w13.data[1], want)


def test_batch_invariant_mode_refuses_gpt_oss(tiny_gpt_oss):
    with pytest.raises(ValueError, match="batch-invariant"):
        LLM(tiny_gpt_oss[0], dtype="float32", kv_cache_memory_gib=0.05, batch_invariant=True)
