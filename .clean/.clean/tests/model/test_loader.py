"""HF-directory loading: sharded safetensors, dummy weights, and errors."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import random_prompts

from pressroom import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir, tmp_path):
    import transformers
    single = tiny_model_dir("qwen2")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{single}/{name}", sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, seed=4)]
    a = LLM(single, dtype="float32", kv_cache_memory_gib=0.05).generate(prompts, GREEDY, use_tqdm=False)
    b = LLM(str(sharded), dtype="float32", kv_cache_memory_gib=0.05).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_dummy_weights_need_no_checkpoint(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory_gib=0.05)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    assert llm.engine.model.model.embed_tokens.weight.abs().max() > 0


def test_the_cpu_default_dtype_follows_the_cpu(tiny_model_dir):
    from pressroom.platforms.cpu import cpu_info
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory_gib=0.05)
    expected = torch.bfloat16 if cpu_info().native_bf16 else torch.float32
    assert llm.engine.model.lm_head.weight.dtype == expected


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tiny_model_dir("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    tensors = load_file(f"{src}/model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        LLM(str(tmp_path), kv_cache_memory_gib=0.05)


def test_unsupported_architecture_is_named(tmp_path):
    import transformers
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path), load_format="dummy")


def test_fp32_linear_is_prepacked_and_gives_a_row_the_same_bits_in_any_batch():
    """fp32 CPU weights go to oneDNN's blocked layout (faster than torch's BLAS at decode-sized batches on an
    AVX2 EPYC); a row's output does not depend on the rows beside it, which keeps batched greedy output equal
    to the same request alone."""
    from pressroom.model.layers.linear import MergedColumnParallelLinear
    gen = torch.Generator().manual_seed(0)
    layer = MergedColumnParallelLinear(96, [64, 64])
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)
    x = torch.randn(33, 96, generator=gen)
    plain = x.double() @ layer.weight.data.double().t()
    if not layer.prepack_onednn():
        pytest.skip("this torch build has no oneDNN prepacking")
    assert layer.onednn is not None and layer.weight.numel() == 0
    batched = layer(x)
    assert torch.allclose(batched.double(), plain, atol=1e-5)
    for rows in (1, 3, 8, 17):
        assert torch.equal(layer(x[:rows]), batched[:rows])


def test_onednn_prepacked_linear_matches_plain_with_bias():
    from pressroom.model.layers.linear import QKVParallelLinear
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True)
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
    layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    plain = layer(x)
    if not layer.prepack_onednn():
        pytest.skip("this torch build has no oneDNN prepacking")
    assert layer.weight.numel() == 0  # the plain copy is dropped
    assert torch.allclose(layer(x).float(), plain.float(), atol=0.05, rtol=0.02)
