"""Greedy tokens and prompt logprobs equal HF transformers' on the same weights (fp32)."""
from __future__ import annotations

import zlib

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs, random_prompts

from pressroom import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, prompt_logprobs=0)


def _check(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 64)
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        theirs = hf_prompt_logprobs(hf_model, prompt)
        assert out.prompt_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                                  "deepseek_v2", "deepseek_v2_yarn", "deepseek_v3"])
def test_tiny_random_models_match_hf(arch, tiny_model_dir):
    import transformers
    path = tiny_model_dir(arch)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    # a fixed seed per arch (str hash() changes with each process): tiny random models' flat logits can hold a
    # near-tie that fp32 rounding flips, so each run must check the same prompts
    _check(llm, hf_model, random_prompts(3, seed=zlib.crc32(arch.encode()) % 1000))


@pytest.fixture(scope="module")
def embedded_pair(embedded_path):
    """The embedded GGUF read by HF transformers and by pressroom (dequantized, fp32)."""
    import os

    import transformers
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(embedded_path), gguf_file=os.path.basename(embedded_path), dtype=torch.float32)
    return LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1), hf_model


# CI checks the chat-templated request (what the server sends); the raw-text ones run with test-slow.
@pytest.mark.parametrize("text", ["chat", pytest.param("The quick brown fox", marks=pytest.mark.slow),
                                  pytest.param("def fibonacci(n):\n    ", marks=pytest.mark.slow)])
def test_embedded_model_matches_hf(text, embedded_pair, smollm_tokenizer):
    if text == "chat":
        text = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                    add_generation_prompt=True, tokenize=False)
    _check(*embedded_pair, [smollm_tokenizer.encode(text)])


def test_sparse_attention_matches_hf_past_its_top_k(tiny_model_dir):
    """DeepSeek-V3.2's sparse attention with index_topk 32 over 100-160-token prompts: the indexer really
    drops tokens (prefill and every decode), and tokens and prompt logprobs still equal HF's."""
    import transformers
    path = tiny_model_dir("deepseek_v32")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    _check(llm, hf_model, random_prompts(2, low=100, high=160, seed=32))
