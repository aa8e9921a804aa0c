"""MXFP4 (gpt-oss's `*_blocks` / `*_scales`) and NVFP4 (ModelOpt's) checkpoints, dense layers and MoE experts, and
online MXFP4 / NVFP4 experts, end to end on the CPU: layers hold the packed form as shipped, and prompt logprobs
equal those of an fp32 twin holding the decoded weights (decoded outside pressroom: tests/fp4_checkpoint.py)."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_prompt_logprobs, tiny_config
from fp4_checkpoint import write_mxfp4_checkpoint, write_nvfp4_checkpoint, write_twin
from fp8_checkpoint import PROMPTS, prompt_logprobs

from pressroom import LLM
from pressroom.kernels import fp4_moe
from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.quantization.fp4 import Fp4LinearMethod, Fp4MoeMethod

# Weight-only: the quantized model and its twin multiply by the same fp32 weights (the references dequantize
# exactly); only the summation order of stacked matmuls differs (fp32 rounding, ~1e-6 here).
TWIN_TOLERANCE = 1e-4
# pressroom against HF transformers on the twin's weights: fp32 both, different kernels (attention, SiLU, sums)
HF_TOLERANCE = 2e-4


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05, **kw)


def _model(llm: LLM):
    return llm.engine.model


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in _model(llm).modules() if isinstance(m, FusedMoE)]


@pytest.fixture(scope="module")
def qwen3_moe_mxfp4_shape(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny Qwen3-MoE whose experts' intermediate features (64) are whole MXFP4 blocks (the shared fixture's 48
    are not)."""
    import transformers
    cfg = tiny_config("qwen3_moe")
    cfg.moe_intermediate_size = 64
    torch.manual_seed(99)
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe-64"))
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return path


def _assert_matches_twin(llm: LLM, twin, dense_src: str) -> torch.Tensor:
    got, want = prompt_logprobs(llm), prompt_logprobs(_llm(twin))
    assert (got - want).abs().max() < TWIN_TOLERANCE, (got - want).abs().max()
    dense = prompt_logprobs(_llm(dense_src))  # 4-bit weights move this random model: the comparison sees them
    assert (got - dense).abs().max() > 10 * TWIN_TOLERANCE
    return got


def test_mxfp4_checkpoint_dense_layers_load_packed_and_match_their_twin(tiny_model_dir, tmp_path):
    """A Llama in gpt-oss's tensor form, attention left unconverted (as gpt-oss's config does): the MLP's
    `*.weight_blocks` load packed without a dense copy, attention stays dense."""
    src = tiny_model_dir("llama")
    decoded = write_mxfp4_checkpoint(src, tmp_path / "q", unconverted=("self_attn",))
    write_twin(src, tmp_path / "twin", decoded)
    llm = _llm(tmp_path / "q")
    layer = _model(llm).model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method is None and layer.self_attn.qkv_proj.weight.dtype == torch.float32
    gate_up = layer.mlp.gate_up_proj
    assert isinstance(gate_up.quant_method, Fp4LinearMethod) and gate_up.weight.dtype == torch.uint8
    assert gate_up.weight.shape == (256, 32) and gate_up.weight_scale.shape == (256, 2)
    want = torch.cat([decoded["model.layers.0.mlp.gate_proj.weight"], decoded["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(gate_up.quant_method.dequantized(gate_up), want)  # the shipped values, bit for bit
    _assert_matches_twin(llm, tmp_path / "twin", src)


@pytest.mark.parametrize("fused", [True, False])
def test_mxfp4_checkpoint_experts_match_hf_on_the_decoded_weights(qwen3_moe_mxfp4_shape, tmp_path, fused):
    """Qwen3-MoE with every projection and expert in MXFP4: experts fused as gpt-oss stores them (gate and up rows
    interleaved) or one matrix each. Oracle: HF transformers in fp32 on the decoded weights."""
    import transformers
    src = qwen3_moe_mxfp4_shape
    decoded = write_mxfp4_checkpoint(src, tmp_path / "q", fused_experts=fused)
    write_twin(src, tmp_path / "twin", decoded)
    llm = _llm(tmp_path / "q")
    experts = _experts(llm)[0]
    assert isinstance(experts.quant_method, Fp4MoeMethod) and experts.w13.dtype == torch.uint8
    assert experts.w13.shape == (8, 128, 32) and experts.w2.shape == (8, 64, 32) and experts.w13_global_scale is None
    gate = decoded["model.layers.0.mlp.experts.3.gate_proj.weight"]
    up = decoded["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(experts.quant_method.experts(experts, "w13").dequantize(3), torch.cat([gate, up]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32)
    want = torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(hf, p["prompt_token_ids"])])
    got = prompt_logprobs(llm)
    assert (got - want).abs().max() < HF_TOLERANCE, (got - want).abs().max()


def test_mxfp4_checkpoint_read_with_quantization_none_is_dequantized(qwen3_moe_mxfp4_shape, tmp_path):
    """--quantization none reads the same checkpoint into dense fp32 experts: the decoded weights exactly."""
    src = qwen3_moe_mxfp4_shape
    decoded = write_mxfp4_checkpoint(src, tmp_path / "q", fused_experts=True)
    experts = _experts(_llm(tmp_path / "q", quantization="none"))[0]
    assert experts.quant_method is None and experts.w13.dtype == torch.float32
    assert torch.equal(experts.w2.data[5], decoded["model.layers.0.mlp.experts.5.down_proj.weight"])


@pytest.mark.parametrize("hf_quant_config", [False, True])
def test_nvfp4_modelopt_checkpoint_matches_its_twin(tiny_model_dir, tmp_path, hf_quant_config):
    """Mixtral in ModelOpt's NVFP4, attention excluded or not; the config in config.json or hf_quant_config.json.
    q, k and v carry global scales of their own (each its own amax): the stacked layer keeps one per row."""
    src = tiny_model_dir("mixtral")
    excluded = ("self_attn",) if hf_quant_config else ()
    decoded = write_nvfp4_checkpoint(src, tmp_path / "q", excluded=excluded, hf_quant_config=hf_quant_config)
    write_twin(src, tmp_path / "twin", decoded)
    llm = _llm(tmp_path / "q")
    layer = _model(llm).model.layers[1]
    qkv = layer.self_attn.qkv_proj
    if hf_quant_config:
        assert qkv.quant_method is None
    else:
        assert qkv.weight.dtype == torch.uint8 and qkv.weight_global_scale.unique().numel() == 3  # q, k, v's
    experts = layer.mlp.experts
    assert isinstance(experts.quant_method, Fp4MoeMethod) and experts.w13.dtype == torch.uint8
    assert experts.w13_scale.dtype == torch.float8_e4m3fn and experts.w13_global_scale.shape == (4, 256)
    w1 = decoded["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    w3 = decoded["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert torch.equal(experts.quant_method.experts(experts, "w13").dequantize(2), torch.cat([w1, w3]))
    _assert_matches_twin(llm, tmp_path / "twin", src)


def test_nvfp4_checkpoint_experts_of_qwen3_moe(tiny_model_dir, tmp_path):
    """Qwen3-MoE's experts (48 intermediate features: three NVFP4 blocks) against HF on the decoded weights."""
    import transformers
    src = tiny_model_dir("qwen3_moe")
    decoded = write_nvfp4_checkpoint(src, tmp_path / "q")
    write_twin(src, tmp_path / "twin", decoded)
    llm = _llm(tmp_path / "q")
    assert all(isinstance(m.quant_method, Fp4MoeMethod) for m in _experts(llm))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32)
    want = torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(hf, p["prompt_token_ids"])])
    got = prompt_logprobs(llm)
    assert (got - want).abs().max() < HF_TOLERANCE, (got - want).abs().max()


@pytest.mark.parametrize("fmt", fp4_moe.FORMATS)
def test_online_fp4_quantizes_experts_too(tiny_model_dir, tmp_path, fmt):
    """--quantization mxfp4 / nvfp4 on a plain Mixtral: the experts are quantized as they load (each expert with its
    own scales), and the model equals a twin built from what the layers multiply by."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny_model_dir("mixtral")
    llm = _llm(src, quantization=fmt)
    shutil.copytree(src, tmp_path / "twin")
    weights = load_file(f"{src}/model.safetensors")
    for i, layer in enumerate(_model(llm).model.layers):
        p = f"model.layers.{i}."
        experts = layer.mlp.experts
        assert experts.w13.dtype == experts.w2.dtype == torch.uint8
        w13, w2 = (experts.quant_method.experts(experts, n) for n in ("w13", "w2"))
        for e in range(4):
            w1, w3 = w13.dequantize(e).chunk(2)
            expert = f"{p}block_sparse_moe.experts.{e}"
            weights |= {f"{expert}.w1.weight": w1, f"{expert}.w3.weight": w3, f"{expert}.w2.weight": w2.dequantize(e)}
        for stacked, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",))):
            linear = layer.self_attn.get_submodule(stacked)
            names = [f"{p}self_attn.{part}.weight" for part in parts]
            rows = [weights[n].shape[0] for n in names]
            weights |= dict(zip(names, (w.contiguous() for w in linear.quant_method.dequantized(linear).split(rows))))
    save_file(weights, f"{tmp_path}/twin/model.safetensors")
    _assert_matches_twin(llm, tmp_path / "twin", src)


def test_online_mxfp4_refuses_experts_that_are_not_whole_blocks(tiny_model_dir):
    """The shared tiny Qwen3-MoE's experts have 48 intermediate features: not whole blocks of 32."""
    with pytest.raises(ValueError, match="blocks of 32"):
        _llm(tiny_model_dir("qwen3_moe"), quantization="mxfp4")


def test_a_modelopt_checkpoint_in_another_algorithm_is_refused(tiny_model_dir, tmp_path):
    import json
    import shutil
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NVFP4 only"):
        _llm(tmp_path / "m")


@pytest.mark.parametrize("prefix, patterns, expected", [
    ("model.layers.3.self_attn.qkv_proj", ["model.layers.*.self_attn"], True),  # gpt-oss: HF's regex, a parent
    ("model.layers.3.self_attn.qkv_proj", ["*self_attn*"], True),  # ModelOpt's glob
    ("model.layers.3.self_attn.qkv_proj", ["model.layers.3.self_attn.k_proj"], True),  # a stacked part
    ("model.layers.3.mlp.gate_up_proj", ["up_proj"], True),  # a suffix
    ("model.layers.13.mlp.gate_up_proj", ["model.layers.1"], False),  # a prefix stops at a module boundary
    ("model.layers.3.mlp.gate_up_proj", ["mlp.gate"], False),  # a router's name is not its neighbours'
    ("model.layers.3.mlp.down_proj", ["lm_head", "*self_attn*"], False),
])
def test_excluded_modules_match_as_hf_and_modelopt_name_them(prefix, patterns, expected):
    from pressroom.model.quantization.base import excluded
    assert excluded(prefix, patterns) is expected


def test_an_fp4_weight_splits_only_at_block_edges():
    """A rank's share of the inputs must be whole scale blocks: reading inside one is a clear error."""
    from pressroom.model.quantization.fp4 import Fp4Weight, lazy_fp4
    reads = []

    def read(r0, r1, b0, b1):
        reads.append((r0, r1, b0, b1))
        return Fp4Weight(torch.zeros(r1 - r0, (b1 - b0) * 16, dtype=torch.uint8),
                         torch.full((r1 - r0, b1 - b0), 127, dtype=torch.uint8), None)

    weight = lazy_fp4((8, 128), 32, read, keep=True, name="x")
    part = weight.narrow(0, 2, 4).narrow(1, 64, 64).load()
    assert reads == [(2, 6, 2, 4)] and part.shape == (4, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        weight.narrow(1, 48, 32).load()
    assert torch.equal(lazy_fp4((8, 128), 32, read, keep=False, name="x").load(), torch.zeros(8, 128))
