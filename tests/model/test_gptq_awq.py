"""GPTQ (with and without act-order) and AWQ int4 checkpoints end to end on the CPU, picked by --quantization auto
from quantization_config: each layer holds the packed form and dequantizes to exactly the weights the writer
rounded to, and prompt logprobs equal those of an fp32 twin built from those weights."""
from __future__ import annotations

import pytest
import torch
from fp8_checkpoint import prompt_logprobs
from int4_checkpoint import write_int4_checkpoint, write_twin

from pressroom import LLM
from pressroom.model.quantization.int4 import Int4LinearMethod

# Weight-only, and the reference dequantizes exactly: the model and its twin do the same fp32 arithmetic on the same
# weights; only the summation order of the stacked q/k/v and gate/up matmuls differs.
TWIN_TOLERANCE = 1e-4
_STACKS = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
           ("self_attn.o_proj", ("self_attn.o_proj",)),
           ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
           ("mlp.down_proj", ("mlp.down_proj",)))


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05, **kw)


def _assert_layers_hold(llm: LLM, dequantized: dict[str, torch.Tensor], act_order: bool) -> None:
    for i, layer in enumerate(llm.engine.model.model.layers):
        for stacked, parts in _STACKS:
            linear = layer.get_submodule(stacked)
            assert isinstance(linear.quant_method, Int4LinearMethod) and linear.weight.dtype == torch.int32
            assert (linear.g_idx is not None) == act_order
            want = torch.cat([dequantized[f"model.layers.{i}.{p}.weight"] for p in parts])
            assert linear.weight.shape == (want.shape[1] // 8, want.shape[0])  # 4 bits a weight, nothing dense
            assert torch.equal(linear.quant_method.dequantized(linear), want), (i, stacked)


@pytest.mark.parametrize("fmt, group, act_order", [("gptq", 128, False), ("gptq", 32, True), ("awq", 32, False)])
def test_int4_checkpoint_matches_its_dequantized_fp32_twin(tiny_model_dir, tmp_path, fmt, group, act_order):
    model = tiny_model_dir("llama")
    dequantized = write_int4_checkpoint(model, tmp_path / fmt, fmt, group, act_order)
    llm = _llm(tmp_path / fmt)  # --quantization auto: the checkpoint's quant_method
    _assert_layers_hold(llm, dequantized, act_order)
    write_twin(model, tmp_path / "twin", dequantized)
    got, twin = prompt_logprobs(llm), prompt_logprobs(_llm(tmp_path / "twin"))
    assert (got - twin).abs().max() < TWIN_TOLERANCE, (got - twin).abs().max()
    dense = prompt_logprobs(_llm(model))  # and 4-bit weights do move this random model: the test sees them
    assert (got - dense).abs().max() > 10 * TWIN_TOLERANCE


def test_quantization_none_dequantizes_an_int4_checkpoint(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    dequantized = write_int4_checkpoint(model, tmp_path / "gptq", "gptq", 32, act_order=True)
    llm = _llm(tmp_path / "gptq", quantization="none")
    assert llm.engine.model.model.layers[0].mlp.down_proj.quant_method is None  # dense
    write_twin(model, tmp_path / "twin", dequantized)
    got, twin = prompt_logprobs(llm), prompt_logprobs(_llm(tmp_path / "twin"))
    assert (got - twin).abs().max() < TWIN_TOLERANCE, (got - twin).abs().max()


def test_int4_refuses_tensor_parallelism(monkeypatch):
    from pressroom.distributed import parallel_state
    from pressroom.model.layers.linear import LinearBase
    from pressroom.model.quantization.int4 import GptqMethod
    monkeypatch.setattr(parallel_state, "get_tp_size", lambda: 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        GptqMethod({"quant_method": "gptq", "bits": 4}).layer_method(LinearBase(64, 64, bias=False), "x")


def test_int4_refuses_other_bit_widths_awq_layouts_and_plain_checkpoints(tiny_model_dir):
    from pressroom.model.quantization.int4 import AwqMethod, GptqMethod
    with pytest.raises(ValueError, match="reads GPTQ checkpoints"):
        _llm(tiny_model_dir("llama"), quantization="gptq")
    with pytest.raises(ValueError, match="4 bits"):
        GptqMethod({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ValueError, match="GEMM layout"):
        AwqMethod({"quant_method": "awq", "version": "gemv", "w_bit": 4})
