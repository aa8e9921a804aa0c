"""Weight offloading's mechanics on the CPU (--cpu-offload-gb; model/weight_offload.py): which layers go to host
memory, the staging slots' sizes, parameters that are views of the slots, and greedy tokens identical to the same
model without offload. The engine itself never offloads on the CPU (vLLM's rule: a no-op there); the CUDA path,
with its side stream and CUDA graphs, is tests/gpu/test_weight_offload_gpu.py."""
from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch

from pressroom.config import ModelConfig
from pressroom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pressroom.model import loader
from pressroom.model.loader import iter_safetensors, load_hf_config, load_model
from pressroom.model.registry import resolve_architecture
from pressroom.model.weight_offload import ALIGN, WeightOffload, decoder_layers, place_on_host, plan_offload
from pressroom.sampling_params import SamplingParams
from pressroom.worker.model_runner import ModelRunner

LAYERS = 4
PROMPT = [5, 17, 300, 42, 9, 77, 128, 3, 250, 61]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      initializer_range=0.2, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("offload-llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def build(path: str) -> torch.nn.Module:
    """The model as the loader builds and fills it, without the CPU's oneDNN prepacking (it would move the linear
    weights out of their parameters, which is what offloading moves)."""
    hf_config = load_hf_config(path)
    model = resolve_architecture(hf_config)(hf_config)
    model.load_weights(iter_safetensors(path))
    model.model.fused_decode = False  # the same kernels as an offloaded model (which turns the C stack off)
    return model.eval()


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def greedy(model: torch.nn.Module, steps: int = 8) -> list[int]:
    """Greedy tokens of PROMPT through the model runner: one prefill step, then decodes."""
    runner = ModelRunner(model, block_size=16, dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=64)
    runner.initialize_kv_cache(num_blocks=8, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=steps)
    out = runner.execute_model(SchedulerOutput([NewRequestData("r", list(PROMPT), len(PROMPT), params, [1, 2, 3], 0)],
                                               [], {"r": len(PROMPT)}, len(PROMPT)))
    tokens = list(out.sampled_token_ids["r"])
    while len(tokens) < steps:
        computed = len(PROMPT) + len(tokens) - 1
        out = runner.execute_model(SchedulerOutput([], [CachedRequestData("r", [], computed)], {"r": 1}, 1))
        tokens += out.sampled_token_ids["r"]
    return tokens


def test_the_last_decoder_layers_are_planned_whole_until_the_bytes_are_covered(checkpoint):
    model = build(checkpoint)
    layers = model.model.layers
    assert decoder_layers(model) is layers
    one = layer_bytes(layers[0])
    plan = plan_offload(model, one + 1)  # more than one layer: two, from the end
    assert plan.layers == (layers[2], layers[3]) and plan.offloaded_bytes == 2 * one
    assert plan_offload(model, one).layers == (layers[3],)
    everything = plan_offload(model, 100 * one)
    assert everything.layers == tuple(layers) and everything.total_layers == LAYERS


def test_offloaded_parameters_view_two_staging_slots_and_the_host_keeps_them(checkpoint):
    model = build(checkpoint)
    layers = model.model.layers
    resident = [p.data_ptr() for p in layers[0].parameters()]
    plan = plan_offload(model, 2 * layer_bytes(layers[0]) + 1)  # layers 1, 2 and 3
    buffers = place_on_host(plan, pin=False)
    offload = WeightOffload(model, plan, "cpu", buffers)
    per_layer = sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in layers[1].parameters())
    assert [h.numel() for h in offload.hosts] == [per_layer] * 3
    assert all(h is b for h, b in zip(offload.hosts, buffers))  # loaded in place: no second copy
    assert len(offload.slots) == 2 and offload.staging_bytes == 2 * per_layer
    for j, layer in enumerate(plan.layers):
        slot = offload.slots[j % 2]
        for p in layer.parameters():
            assert slot.data_ptr() <= p.data_ptr() < slot.data_ptr() + slot.numel()
    assert [p.data_ptr() for p in layers[0].parameters()] == resident  # layer 0 stays where it was
    assert "3 of 4 decoder layers" in offload.describe()


def test_greedy_tokens_equal_the_model_without_offload(checkpoint):
    plain = greedy(build(checkpoint))
    model = build(checkpoint)
    plan = plan_offload(model, 3 * layer_bytes(model.model.layers[0]))
    offload = WeightOffload(model, plan, "cpu", place_on_host(plan, pin=False))
    assert greedy(model) == plain
    # the slots are refilled from the host every forward: wiping them between runs changes nothing
    for slot in offload.slots:
        slot.zero_()
    assert greedy(model) == plain
    # and the host copies are what the layers compute with
    saved = offload.hosts[1].clone()
    offload.hosts[1].view(torch.float32).mul_(-1.0)
    assert greedy(model) != plain
    offload.hosts[1].copy_(saved)
    assert greedy(model) == plain


def test_the_loaders_flow_fills_the_host_buffers_in_place(checkpoint):
    """As load_model does on CUDA: the layers go to host buffers while their weights are still stand-ins, the
    checkpoint is read straight into them, and the offload reuses them (no second copy)."""
    plain = greedy(build(checkpoint))
    hf_config = load_hf_config(checkpoint)
    config = ModelConfig(model=checkpoint, dtype=torch.float32)
    placed = []

    def keep_on_host(model):
        plan = plan_offload(model, 2 * layer_bytes(model.model.layers[0]))
        assert all(p.dim() == 0 or not any(p.stride()) for p in plan.layers[0].mlp.parameters())  # stand-ins yet
        placed.append((plan, place_on_host(plan, pin=False)))

    model = loader._build_model(resolve_architecture(hf_config), hf_config, config, None, "cpu",
                                before_allocation=keep_on_host)
    model.load_weights(iter_safetensors(checkpoint))
    plan, buffers = placed[0]
    offload = WeightOffload(model, plan, "cpu", buffers)
    assert all(h is b for h, b in zip(offload.hosts, buffers))
    assert greedy(model.eval()) == plain


def test_every_layer_offloaded_and_parameters_repacked_after_loading(checkpoint):
    """All layers (more bytes asked than they hold), and host buffers the parameters no longer view (a quantization
    method replaced them after loading): packed anew, same tokens."""
    plain = greedy(build(checkpoint))
    model = build(checkpoint)
    plan = plan_offload(model, 1 << 40)
    offload = WeightOffload(model, plan, "cpu")
    assert len(offload.hosts) == LAYERS
    assert greedy(model) == plain


def test_a_vision_language_model_offloads_its_language_layers(tmp_path, smollm_tokenizer):
    """Qwen2.5-VL: the decoder stack is the language model's, not the vision tower's blocks (a ModuleList too)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "multimodal"))
    from tiny_vl import build_tiny_qwen2_5_vl
    build_tiny_qwen2_5_vl(tmp_path, copy.deepcopy(smollm_tokenizer))
    hf_config = load_hf_config(str(tmp_path))
    model = resolve_architecture(hf_config)(hf_config)
    assert decoder_layers(model) is model.model.layers
    assert plan_offload(model, 1).layers == (model.model.layers[-1],)


def test_the_engine_ignores_cpu_offload_gb_on_the_cpu(checkpoint, caplog):
    """vLLM's rule: the weights already live in host memory, so the flag changes nothing there (said in a line)."""
    with caplog.at_level(logging.INFO, logger="pressroom"):
        loaded = load_model(ModelConfig(model=checkpoint, dtype=torch.float32, cpu_offload_gb=1), "cpu")
    assert loaded.weight_offload is None
    assert "--cpu-offload-gb 1 has no effect on the CPU" in caplog.text


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError, match="cpu_offload_gb must be at least 0"):
        ModelConfig(model="m", cpu_offload_gb=-1)
