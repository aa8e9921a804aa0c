"""LLaVA (CLIP tower, projector, Llama decoder) equals HF transformers' LlavaForConditionalGeneration on tiny
random weights (fp32): greedy tokens for 32 new tokens and prompt logprobs with 1-3 images per prompt beside a
text-only prompt in one batch, and with chunked prefill splitting the 16-token image runs."""
from __future__ import annotations

import pytest
from test_qwen2_5_vl import _check
from tiny_vl import random_image

from pressroom import LLM


def _prompts():
    img = [random_image(30 + i, size) for i, size in enumerate([(100, 80), (60, 150), (40, 40)])]
    return [
        {"prompt": "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n", "multi_modal_data": {"image": img[0]}},
        {"prompt": "Compare <image> and <image> now.", "multi_modal_data": {"image": [img[1], img[2]]}},
        {"prompt": "Text alone in this one, no picture at all."},
        {"prompt": "<image><image> then <image>", "multi_modal_data": {"image": [img[2], img[0], img[1]]}},
    ]


@pytest.mark.slow  # a third family on the runner paths Qwen2.5-VL's default tests cover: ~8 s on two cores
def test_llava_matches_hf(tiny_llava):
    path, hf_model = tiny_llava
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    _check(llm, hf_model, _prompts())
    assert llm.engine.runner.multimodal.cache.encoder_runs == 3


@pytest.mark.slow
def test_llava_chunked_prefill(tiny_llava):
    path, hf_model = tiny_llava
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=False)
    _check(llm, hf_model, [p for p in _prompts() if "multi_modal_data" in p])
