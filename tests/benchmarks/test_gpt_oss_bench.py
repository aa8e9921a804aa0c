"""bench gpu with gpt-oss: pressroom's weights under HF's gpt-oss names and layouts (the router, fused experts as
x @ W with gate and up interleaved, their biases), the committed gpt-oss-20b config's shapes and size."""
from __future__ import annotations

import pytest
import torch
from gpt_oss_checkpoint import save_tiny_gpt_oss

from pressroom.benchmarks import gpu
from pressroom.benchmarks.shapes import SHAPES_DIR as CONFIGS


def test_hf_state_dict_of_gpt_oss_equals_hfs_own_weights(tmp_path):
    from pressroom.config import ModelConfig
    from pressroom.model.loader import load_model
    hf_model = save_tiny_gpt_oss(tmp_path)
    state = gpu.hf_state_dict(load_model(ModelConfig(model=str(tmp_path), dtype=torch.float32), "cpu").model)
    expected = hf_model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    gpu.load_into_hf(hf_model, state)


def test_the_gpt_oss_20b_config_maps_to_hf_and_has_its_published_size():
    from transformers import AutoConfig, AutoModelForCausalLM

    from pressroom.model.loader import load_hf_config
    from pressroom.model.registry import resolve_architecture
    config = AutoConfig.from_pretrained(CONFIGS / "gpt-oss-20b")
    with torch.device("meta"):
        ours, hf = resolve_architecture(config)(config), AutoModelForCausalLM.from_config(config)
    state = gpu.hf_state_dict(ours)
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: tuple(p.shape) for n, p in hf.named_parameters()}
    size = gpu.model_size(load_hf_config(str(CONFIGS / "gpt-oss-20b")), torch.bfloat16)
    assert size.total_params == pytest.approx(20.91e9, rel=0.01)  # the model card's 21B
    active = size.active_non_embedding_params + size.lm_head_params  # the card's 3.6B active counts the LM head
    assert active == pytest.approx(3.61e9, rel=0.01)


def test_the_bench_runs_hf_gpt_oss_on_pressrooms_weights(tmp_path):
    """The whole bench on a tiny gpt-oss (CPU): HF's eager attention (it has no SDPA with sinks) on the weights
    pressroom drew, both producing every token."""
    import json

    from pressroom.entrypoints import cli
    save_tiny_gpt_oss(tmp_path / "m")
    out = tmp_path / "result.json"
    argv = ["bench", "gpu", "--model", str(tmp_path / "m"), "--device", "cpu", "--num-prompts", "4",
            "--input-len", "16", "--output-len", "4", "--decode-input-len", "8", "--decode-output-len", "4",
            "--hf-batch-sizes", "2,4", "--copy-gib", "0.01", "--matmul-size", "128", "--kv-cache-memory-gib", "0.05",
            "--workloads", "decode,throughput", "--output-json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    for section in report["workloads"].values():
        assert section["hf"]["output_tokens"] == section["pressroom"]["output_tokens"] > 0
