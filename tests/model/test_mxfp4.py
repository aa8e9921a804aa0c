"""MXFP4 and NVFP4 weights end to end on the CPU (--quantization mxfp4 / nvfp4, quantized at load): the layers hold
the packed form, and prompt logprobs equal those of an fp32 twin whose projections are the dequantized weights."""
from __future__ import annotations

import shutil

import pytest
import torch
from fp8_checkpoint import prompt_logprobs
from safetensors.torch import load_file, save_file

from pressroom import LLM
from pressroom.kernels import mxfp4
from pressroom.model.layers.linear import LinearBase
from pressroom.model.quantization.mxfp4 import Mxfp4LinearMethod

# Weight-only: the quantized model and its twin do the same fp32 arithmetic on the same weights (the reference
# dequantizes exactly); only the summation order of the stacked q/k/v and gate/up matmuls differs.
TWIN_TOLERANCE = 1e-4


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05, **kw)


def _write_twin(src: str, dst) -> None:
    """The checkpoint with every projection replaced by its MXFP4 round trip (blocks lie along a row's inputs, so
    quantizing q, k and v apart equals quantizing the stacked qkv)."""
    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = mxfp4.dequantize(*mxfp4.quantize(w))
    save_file(weights, f"{dst}/model.safetensors")


def test_online_mxfp4_matches_its_dequantized_fp32_twin(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    llm = _llm(model, quantization="mxfp4")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, LinearBase) and m.quant_method is not None]
    assert layers and all(isinstance(m.quant_method, Mxfp4LinearMethod) for m in layers)
    down = llm.engine.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.uint8 and down.weight.shape == (64, 64) and down.weight_scale.shape == (64, 4)
    shipped = load_file(f"{model}/model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant_method.dequantized(down), mxfp4.dequantize(*mxfp4.quantize(shipped)))
    _write_twin(model, tmp_path / "twin")
    got, twin = prompt_logprobs(llm), prompt_logprobs(_llm(tmp_path / "twin"))
    assert (got - twin).abs().max() < TWIN_TOLERANCE, (got - twin).abs().max()
    dense = prompt_logprobs(_llm(model))  # and 4-bit weights do move this random model: the test sees them
    assert (got - dense).abs().max() > 10 * TWIN_TOLERANCE


def test_mxfp4_refuses_layers_that_are_not_whole_blocks():
    from pressroom.model.quantization.mxfp4 import Mxfp4Method
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        Mxfp4Method().layer_method(LinearBase(48, 16, bias=False), "x")


def _twin_from_layers(llm: LLM, src: str, dst) -> None:
    """The checkpoint with each projection replaced by what the quantized model multiplies by (its stacked q/k/v
    and gate/up split back: NVFP4's global scale is the stacked tensor's, so quantizing the parts apart differs)."""
    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    for i, layer in enumerate(llm.engine.model.model.layers):
        p = f"model.layers.{i}."
        for stacked, parts in (("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                               ("self_attn.o_proj", ["self_attn.o_proj"]),
                               ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
                               ("mlp.down_proj", ["mlp.down_proj"])):
            linear = layer.get_submodule(stacked)
            rows = [weights[f"{p}{part}.weight"].shape[0] for part in parts]
            for part, w in zip(parts, linear.quant_method.dequantized(linear).split(rows)):
                weights[f"{p}{part}.weight"] = w.contiguous()
    save_file(weights, f"{dst}/model.safetensors")


def test_online_nvfp4_matches_its_dequantized_fp32_twin(tiny_model_dir, tmp_path):
    from pressroom.kernels import nvfp4
    from pressroom.model.quantization.nvfp4 import Nvfp4LinearMethod
    model = tiny_model_dir("llama")
    llm = _llm(model, quantization="nvfp4")
    down = llm.engine.model.model.layers[0].mlp.down_proj
    assert isinstance(down.quant_method, Nvfp4LinearMethod) and down.weight.shape == (64, 64)
    assert down.weight_scale.shape == (64, 8) and down.weight_global_scale.shape == (64,)  # one per row
    shipped = load_file(f"{model}/model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant_method.dequantized(down), nvfp4.dequantize(*nvfp4.quantize(shipped)))
    _twin_from_layers(llm, model, tmp_path / "twin")
    got, twin = prompt_logprobs(llm), prompt_logprobs(_llm(tmp_path / "twin"))
    assert (got - twin).abs().max() < TWIN_TOLERANCE, (got - twin).abs().max()
    dense = prompt_logprobs(_llm(model))
    assert (got - dense).abs().max() > 10 * TWIN_TOLERANCE
