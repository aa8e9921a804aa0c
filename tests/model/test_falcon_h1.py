"""Falcon-H1 against HF transformers (fp32, tiny random weights): its Mamba2 mixer (the shared
layers/mamba2_mixer.py, with Falcon-H1's multipliers and each of its output gates) over a packed batch of prefills,
chunked prefills and decodes, and the whole model from a save_pretrained checkpoint over the same kind of steps,
directly and through `LLM` (greedy tokens and prompt logprobs)."""
from __future__ import annotations

import pytest
import torch
from test_nemotron_h import (
    PROMPT_LENS,
    check_cached_prefixes,
    check_llm,
    check_model_schedule,
    copy_hf_weights,
    engine_prompts,
    load_ours,
    randomize,
    run_hf,
    run_schedule,
    save_tiny,
    sequences,
    tiny_llm,
    use_triton_kernels,
)

from pressroom.model.layers.mamba2_mixer import Mamba2Mixer
from pressroom.model.models.falcon_h1 import mixer_config

transformers = pytest.importorskip("transformers")
from transformers import FalconH1Config  # noqa: E402
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector  # noqa: E402

MULTIPLIERS = dict(ssm_in_multiplier=0.7, ssm_multipliers=[1.3, 0.6, 1.8, 0.4, 1.5])


def falcon_config(**overrides) -> FalconH1Config:
    args = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=24, mamba_d_ssm=24, mamba_n_heads=4, mamba_d_state=4, mamba_n_groups=2,
                mamba_chunk_size=4, mamba_d_conv=4, mamba_proj_bias=True, projectors_bias=True)
    return FalconH1Config(**(args | overrides))


@pytest.mark.parametrize("overrides,kernels", [
    (MULTIPLIERS, "torch"),  # no norm: y * silu(z)
    (MULTIPLIERS | dict(mamba_rms_norm=True), "torch"),  # norm, then the gate
    (MULTIPLIERS | dict(mamba_rms_norm=True), "triton"),
    (dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=1, mamba_chunk_size=256), "torch"),
])
def test_mixer_matches_hf_over_packed_prefill_and_decode_steps(overrides, kernels, monkeypatch):
    if kernels == "triton":
        use_triton_kernels(monkeypatch)
    config = falcon_config(**overrides)
    theirs = FalconH1Mixer(config, 0).eval()
    theirs.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)  # the model's job in HF
    randomize(theirs)
    ours = Mamba2Mixer(mixer_config(config))
    copy_hf_weights(ours, theirs)
    seqs = sequences(16)
    for seq, actual, prompt_len in zip(seqs, run_schedule(ours, seqs), PROMPT_LENS):
        torch.testing.assert_close(actual, run_hf(theirs, config, seq, prompt_len), atol=1e-5, rtol=1e-4)


# every muP multiplier away from 1, a head_dim other than hidden // heads, biases and the mixer's norm
MODEL_SHAPE = dict(vocab_size=49152, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=48, mamba_d_ssm=48, mamba_n_heads=8, mamba_d_state=8,
                   mamba_n_groups=2, mamba_chunk_size=16, mamba_rms_norm=True, attention_bias=True, mlp_bias=True,
                   mamba_proj_bias=True, projectors_bias=True, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)
MODEL_MULTIPLIERS = MULTIPLIERS | dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, mlp_multipliers=[1.4, 0.8],
                                       key_multiplier=0.9, attention_in_multiplier=1.2, attention_out_multiplier=0.7,
                                       ssm_out_multiplier=1.3)


@pytest.mark.parametrize("overrides", [{}, dict(tie_word_embeddings=True, mamba_rms_norm=False, vocab_size=256)])
def test_whole_model_logits_match_hf_over_packed_steps(overrides, tmp_path):
    """The checkpoint loads (a tied head too); logits of chunked prefills and decodes."""
    from pressroom.model.models.falcon_h1 import FalconH1ForCausalLM
    config = FalconH1Config(**(MODEL_SHAPE | MODEL_MULTIPLIERS | overrides))
    hf_model = save_tiny(config, tmp_path)
    check_model_schedule(hf_model, load_ours(FalconH1ForCausalLM, tmp_path, config), config.vocab_size)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm_tokenizer):
    path = tmp_path_factory.mktemp("tiny-falcon-h1")
    hf_model = save_tiny(FalconH1Config(**MODEL_SHAPE, **MODEL_MULTIPLIERS), path)
    smollm_tokenizer.save_pretrained(path)
    return path, hf_model


# 16 greedy tokens in the default suite (HF's reference runs its torch fallbacks a token per forward), 64 when slow
@pytest.mark.parametrize("max_tokens", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_llm_matches_hf_greedy_and_prompt_logprobs(tiny_checkpoint, max_tokens: int):
    path, hf_model = tiny_checkpoint
    check_llm(tiny_llm(path), hf_model, engine_prompts(seed=72), max_tokens)


@pytest.mark.slow
def test_llm_matches_hf_from_cached_prefixes(tiny_checkpoint):
    check_cached_prefixes(*tiny_checkpoint, max_tokens=16)
