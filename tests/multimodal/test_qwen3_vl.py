"""Qwen3-VL equals HF transformers' Qwen3VLForConditionalGeneration on tiny random weights (fp32): greedy tokens
for 32 new tokens and prompt logprobs with 1-3 images per prompt beside a text-only prompt, and with chunked
prefill splitting the image runs (DeepStack's features ride with the embeddings in the encoder cache)."""
from __future__ import annotations

import pytest
from test_qwen2_5_vl import _check, _prompts

from pressroom import LLM


# A second family on the runner paths Qwen2.5-VL's default tests cover, plus DeepStack: its own tiny model and HF
# references cost ~10 s on two cores.
@pytest.mark.slow
def test_qwen3_vl_matches_hf(tiny_qwen3_vl):
    path, hf_model = tiny_qwen3_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    _check(llm, hf_model, _prompts())
    assert llm.engine.runner.multimodal.cache.encoder_runs == 4


@pytest.mark.slow  # ~4 s beside the test above
def test_qwen3_vl_chunked_prefill(tiny_qwen3_vl):
    path, hf_model = tiny_qwen3_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=False)
    _check(llm, hf_model, [p for p in _prompts() if "multi_modal_data" in p])
