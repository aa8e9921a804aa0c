"""A tiny random gpt-oss for the tests (CPU and GPU): HF transformers' GptOssForCausalLM with a sliding window
shorter than the prompts, YaRN rope, a SwiGLU limit the activations cross, and biases and sinks far from HF's zero
start, saved as HF saves it (fused dense experts)."""
from __future__ import annotations

import torch

WINDOW = 8


def tiny_gpt_oss_config(**overrides):
    import transformers
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64}
    values = dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                  max_position_embeddings=512, rope_parameters=yarn, swiglu_limit=1.0, initializer_range=0.1,
                  experts_implementation="eager")
    return transformers.GptOssConfig(**(values | overrides))


def save_tiny_gpt_oss(path, tokenizer=None, seed: int = 0, **overrides):
    """The tiny model saved at `path` (with `tokenizer`, if given); returns HF's model (fp32, eval)."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(tiny_gpt_oss_config(**overrides)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model
