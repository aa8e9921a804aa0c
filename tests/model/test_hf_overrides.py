"""--hf-overrides (vLLM's): config.json values replaced at load, in the engine and in the model it builds."""
from __future__ import annotations

import pytest
import transformers

from pressroom import LLM
from pressroom.model.loader import apply_hf_overrides


def test_an_override_past_the_checkpoints_position_limit_lets_a_longer_max_model_len_start(tiny_model_dir):
    path = tiny_model_dir("llama")  # max_position_embeddings 2048
    with pytest.raises(ValueError, match="exceeds the model's limit of 2048"):
        LLM(model=path, max_model_len=4096, kv_cache_memory_gib=0.05, enforce_eager=True)
    llm = LLM(model=path, max_model_len=4096, kv_cache_memory_gib=0.05, enforce_eager=True,
              hf_overrides='{"max_position_embeddings": 8192}')
    try:
        assert llm.engine.max_model_len == 4096
        assert llm.engine.hf_config.max_position_embeddings == 8192
    finally:
        llm.shutdown()


def test_an_object_for_a_sub_config_updates_it_key_by_key():
    config = transformers.LlavaConfig(text_config={"model_type": "llama", "hidden_size": 64, "vocab_size": 100})
    apply_hf_overrides(config, {"text_config": {"max_position_embeddings": 131072}, "projector_hidden_act": "relu"})
    assert config.text_config.max_position_embeddings == 131072
    assert config.text_config.hidden_size == 64  # kept: the sub-config is updated, not replaced
    assert config.projector_hidden_act == "relu"


def test_overrides_that_are_not_a_json_object_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        LLM(model=tiny_model_dir("llama"), hf_overrides="{max_position_embeddings: 1}")
