"""DeepSeek's multi-head latent attention: one latent vector per token and layer in the cache, and the
engine's log line saying so; HF parity of the whole model is in tests/engine/test_hf_parity.py."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from pressroom import LLM, SamplingParams


def test_the_cache_holds_one_latent_per_token_and_layer(tiny_model_dir, caplog):
    from conftest import tiny_config
    cfg = tiny_config("deepseek_v2")
    with caplog.at_level(logging.INFO, logger="pressroom"):
        llm = LLM(tiny_model_dir("deepseek_v2"), dtype="float32", kv_cache_memory_gib=0.01)
    caches = [layer.self_attn.attn.kv_cache for layer in llm.engine.model.model.layers]
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert all(c.shape[0] == 1 and c.shape[3:] == (1, latent) for c in caches)  # one plane, one head
    per_token = cfg.num_hidden_layers * latent * 4
    per_head = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                  + cfg.v_head_dim) * 4
    assert f"{per_token} bytes per token" in caplog.text and per_token < per_head / 2
    out = llm.generate([{"prompt_token_ids": list(range(5, 40))}],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_per_head_caching_gives_the_same_tokens_at_many_times_the_bytes(arch, tiny_model_dir, caplog, monkeypatch):
    """PRESSROOM_MLA_DISABLE=1 (vLLM's VLLM_MLA_DISABLE): keys and values expanded from the latent and cached
    per head. Greedy tokens equal the latent cache's; the log line's bytes per token grow by
    heads x 2 x (nope + rope) / (rank + rope)."""
    from conftest import tiny_config
    cfg = tiny_config(arch)
    prompts = [{"prompt_token_ids": list(range(5, 60))}, {"prompt_token_ids": list(range(300, 320))}]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    per_token, tokens = {}, {}
    for mode in ("latent", "per-head"):
        monkeypatch.setenv("PRESSROOM_MLA_DISABLE", "1" if mode == "per-head" else "0")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pressroom"):
            llm = LLM(tiny_model_dir(arch), dtype="float32", kv_cache_memory_gib=0.01)
        per_token[mode] = int(re.search(r"(\d+) bytes per token", caplog.text).group(1))
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm
    assert tokens["per-head"] == tokens["latent"]
    head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert per_token["per-head"] == cfg.num_hidden_layers * cfg.num_attention_heads * 2 * head_dim * 4
    assert per_token["latent"] == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_deepseek_runs_in_bf16_on_the_cpu(tiny_model_dir):
    llm = LLM(tiny_model_dir("deepseek_v3"), dtype="bfloat16", kv_cache_memory_gib=0.01)
    assert llm.engine.model.model.layers[0].self_attn.attn.kv_cache.dtype == torch.bfloat16
    out = llm.generate([{"prompt_token_ids": list(range(5, 30))}] * 2,
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_yarn_tables_match_hf():
    """YaRN's frequencies and cos/sin magnitude against transformers' own computation."""
    from conftest import tiny_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pressroom.model.layers.rotary import RotaryEmbedding
    cfg = tiny_config("deepseek_v2_yarn")
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    rope = RotaryEmbedding(8, 8, 2048, 10000.0, cfg.rope_parameters)
    positions = torch.arange(2048, dtype=torch.float32)
    assert factor != 1.0
    torch.testing.assert_close(rope.cos, torch.outer(positions, inv).cos() * factor)
    torch.testing.assert_close(rope.sin, torch.outer(positions, inv).sin() * factor)


def test_mtp_layers_are_skipped_and_fp8_checkpoints_refused(tiny_model_dir, tmp_path):
    """A DeepSeek-V3 checkpoint carries its multi-token-prediction layer after the decoder layers: the
    model loads without it; an FP8 checkpoint's scale tensors get a sentence that says what to do."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from pressroom.config import ModelConfig
    from pressroom.model.loader import load_model
    source = tiny_model_dir("deepseek_v3")
    for name in ("with-mtp", "fp8"):
        shutil.copytree(source, tmp_path / name)
    weights = load_file(f"{source}/model.safetensors")
    extra = {"model.layers.2.eh_proj.weight": torch.randn(64, 128),
             "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": torch.randn(40, 64)}
    save_file({**weights, **extra}, str(tmp_path / "with-mtp" / "model.safetensors"))
    loaded = load_model(ModelConfig(model=str(tmp_path / "with-mtp"), dtype=torch.float32), "cpu").model
    assert len(loaded.model.layers) == 2
    scales = {"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}
    save_file({**weights, **scales}, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="FP8 block-quantized"):
        load_model(ModelConfig(model=str(tmp_path / "fp8"), dtype=torch.float32), "cpu")
