"""FP8 weights end to end on the CPU: online quantization (--quantization fp8) and FP8 checkpoints written
here in each scale layout (per tensor, per channel, 128x128 blocks, 48x32 blocks that cut the stacked q/k/v
rows), against fp32 twins whose weights are the dequantized FP8 ones."""
from __future__ import annotations

import pytest
import torch
from fp8_checkpoint import LAYOUTS, PROMPTS, prompt_logprobs, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from pressroom import LLM
from pressroom.kernels import fp8
from pressroom.model.layers.linear import LinearBase
from pressroom.model.quantization.fp8 import Fp8LinearMethod

# Prompt logprobs of the tiny random Llama (fp32, logprobs of -8.5 to -14) with FP8 projections, against
# - HF transformers on the dequantized weights with each projection's input rounded to FP8 per token as pressroom
#   does: the same arithmetic summed in another order, so positions agree to fp32 rounding, except where an
#   activation lies on an FP8 rounding boundary and rounds the other way (seen: 1 position of 18, by 0.03):
ORACLE_TOLERANCE, ORACLE_FLIPS = 1e-4, 3
# - its fp32 twin (the same weights, activations not rounded): this random model amplifies the ~3% error of
#   each rounded activation through its layers (its residual stream grows to 15x its input) to up to 0.8 nats.
TWIN_TOLERANCE = 1.0


def hf_fp8_oracle(twin, group: int | None) -> torch.Tensor:
    """HF's prompt logprobs for PROMPTS on the twin's (dequantized) weights, each projection's input quantized
    to FP8 per token (and per `group` inputs; None: the whole row) and dequantized before the matmul."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.endswith("_proj"):
            module.forward = _fake_quant_linear(module, group or module.in_features)
    logprobs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            logits = model(ids).logits[0].log_softmax(-1)
            logprobs += [logits[i - 1, t].item() for i, t in enumerate(ids[0].tolist()) if i]
    return torch.tensor(logprobs)


def _fake_quant_linear(module, group: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return (fp8.dequantize(*fp8.quantize(flat, group), group) @ module.weight.t()).view(*x.shape[:-1], -1)
    return forward


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05, **kw)


def _stacked(dequantized: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The dequantized checkpoint weights in pressroom's stacked layers' row order."""
    p = f"model.layers.{layer}."
    return {"self_attn.qkv_proj": torch.cat([dequantized[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]),
            "self_attn.o_proj": dequantized[f"{p}self_attn.o_proj.weight"],
            "mlp.gate_up_proj": torch.cat([dequantized[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]),
            "mlp.down_proj": dequantized[f"{p}mlp.down_proj.weight"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_fp8_checkpoint_loads_its_weights_in_fp8_as_shipped(layout, tiny_model_dir, tmp_path):
    dequantized = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", layout, tmp_path / "twin")
    llm = _llm(tmp_path / "fp8")
    model = llm.engine.model
    for i, layer in enumerate(model.model.layers):
        for name, expected in _stacked(dequantized, i).items():
            linear: LinearBase = layer.get_submodule(name)
            assert linear.weight.dtype == fp8.FP8 and isinstance(linear.quant_method, Fp8LinearMethod)
            assert torch.equal(linear.quant_method.dequantized(linear), expected), (layout, i, name)
    got = prompt_logprobs(llm)
    oracle = hf_fp8_oracle(tmp_path / "twin", LAYOUTS[layout] and LAYOUTS[layout][1])
    off = (got - oracle).abs()
    assert (off > ORACLE_TOLERANCE).sum() <= ORACLE_FLIPS and off.max() < 0.1, off
    twin = prompt_logprobs(_llm(tmp_path / "twin"))
    assert (got - twin).abs().max() < TWIN_TOLERANCE, (got - twin).abs().max()


def test_online_fp8_against_the_fp32_model(tiny_model_dir):
    model = tiny_model_dir("llama")
    llm = _llm(model, quantization="fp8")
    down = llm.engine.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == fp8.FP8 and down.weight_scale.shape == (64, 1)
    shipped = load_file(f"{model}/model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant_method.dequantized(down), fp8.dequantize(*fp8.quantize(shipped, 128), 128))
    got, want = prompt_logprobs(llm), prompt_logprobs(_llm(model))
    assert (got - want).abs().max() < TWIN_TOLERANCE, (got - want).abs().max()


def test_quantization_none_dequantizes_an_fp8_checkpoint(tiny_model_dir, tmp_path):
    write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", "block_48x32", tmp_path / "twin")
    dense = _llm(tmp_path / "fp8", quantization="none")
    assert all(m.quant_method is None for m in dense.engine.model.modules() if isinstance(m, LinearBase))
    assert torch.equal(prompt_logprobs(dense), prompt_logprobs(_llm(tmp_path / "twin")))


def test_an_fp8_checkpoint_refuses_another_method_and_a_missing_scale(tiny_model_dir, tmp_path):
    write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", "channel")
    with pytest.raises(ValueError, match="quantized with 'fp8'.*Leave --quantization at auto"):
        _llm(tmp_path / "fp8", quantization="quant_plugin:GridMethod")
    weights = load_file(f"{tmp_path}/fp8/model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(weights, f"{tmp_path}/fp8/model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight is stored in FP8 but the checkpoint has no"):
        _llm(tmp_path / "fp8")


def test_block_scales_split_along_inputs_only_at_block_edges():
    from pressroom.model.quantization.fp8 import _ScaleLayout
    layout = _ScaleLayout.of(torch.arange(1.0, 7.0).view(3, 2), 80, 64, (32, 32), "w")
    scale, group = layout.rows(16, 48, 32, 64)  # rows that cut two row blocks, the second column block
    assert group == 32 and torch.equal(scale.flatten(), torch.tensor([2.0] * 16 + [4.0] * 16))
    with pytest.raises(ValueError, match="only be split along its inputs at multiples of 32 .here at 16."):
        layout.rows(0, 80, 16, 48)
