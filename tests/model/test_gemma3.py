"""Gemma 3's text model equals HF transformers' Gemma3ForCausalLM on tiny random weights (fp32): greedy tokens
and prompt logprobs, with a sliding window shorter than the prompts (prefill, chunked prefill after a cached
prefix, and decodes all cross it), per-type rope (linear scaling on the global layers), a query scale that is
not head_dim's, final logit softcapping and norms far from 1."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs, random_prompts

from pressroom import LLM, SamplingParams

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, smollm_tokenizer):
    import transformers
    config = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, initializer_range=0.05, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF starts Gemma's norm weights (w of 1 + w) at 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return str(path), model


def _check(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(hf_model, prompt))) < 1e-3


def test_tiny_gemma3_matches_hf(tiny_gemma3):
    path, hf_model = tiny_gemma3
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    assert llm.engine.max_model_len == 512  # the window no longer caps the context
    prompts = random_prompts(3, low=WINDOW + 4, high=40, seed=3)
    _check(llm, hf_model, prompts + [prompts[0][:-3] + [7, 8, 9]])  # the last shares a cached prefix


def test_tiny_gemma3_chunked_prefill_matches_hf(tiny_gemma3):
    path, hf_model = tiny_gemma3
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=16, max_num_seqs=4)
    _check(llm, hf_model, random_prompts(2, low=30, high=40, seed=4))
