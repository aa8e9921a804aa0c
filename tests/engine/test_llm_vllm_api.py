"""The offline `LLM`'s calls as vLLM has them, beyond generate: reset_prefix_cache, and sleep refused clearly without
enable_sleep_mode (tests/engine/test_sleep_mode.py has sleep mode itself)."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams


def test_llm_reset_prefix_cache_forgets_cached_prefixes(tiny_model_dir):
    base = tiny_model_dir("llama")
    llm = LLM(base, dtype="float32", kv_cache_memory_gib=0.05)
    prompt = {"prompt_token_ids": random_prompts(1, low=40, high=41, seed=13)[0]}
    params = SamplingParams(max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="Sleep mode is not enabled"):
        llm.sleep()
    llm.shutdown()
