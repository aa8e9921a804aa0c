"""DeepSeek-V4 checkpoints in DeepSeek's FP8 block form (float8_e4m3fn weights, a float32 `weight_scale_inv` per
128 x 128 block; model/quantization/fp8.py): test_deepseek_v4.py's tiny model with every projection in FP8 (partial
blocks: its dims are under 128), loaded with its linear layers and routed experts kept in FP8 and o_a_proj
dequantized, against its twin (the dequantized weights in a plain checkpoint): through pressroom in bf16, and
weight-only (activations not quantized) against HF transformers on the twin in fp32."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import hf_prompt_logprobs
from safetensors.torch import load_file, save_file
from test_deepseek_fp8_blocks import CONFIG, _block_dequantize, _block_quantize, _llm
from test_deepseek_v4 import TINY, prompts_of, save_tiny
from test_fp8_experts import activations_unquantized

from pressroom import SamplingParams
from pressroom.config import ModelConfig
from pressroom.kernels import fp8
from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.layers.linear import LinearBase
from pressroom.model.loader import load_model
from pressroom.model.models.deepseek_v4 import canonical_name
from pressroom.model.quantization.fp8 import Fp8LinearMethod, Fp8MoeMethod

# what DeepSeek's converter leaves dense among the 2-D weights: embeddings, LM head, routers, the indexer's head
# weights (norms, hyper-connections, sinks, position biases and tid2eid are no `.weight` matrices)
_DENSE = ("embed_tokens.weight", "head.weight", ".gate.weight", "weights_proj.weight")
# test_deepseek_v4.py's projections (0.2 * randn) scaled down: a random model amplifies each FP8-rounded activation
# through its layers far more than a trained one (measured, FP8 against the fp32 twin: 0.23 at 0.25, 5e-3 at 0.05)
SHRINK = 0.05
# and its LM head: smaller logits, which the bf16 twin rounds less (measured, the bf16 twin against the fp32 one:
# 2e-2 at 1, 1e-2 at 0.5; FP8 against the bf16 twin 1.1e-2 at 0.5)
HEAD_SHRINK = 0.5
PROMPTS = [{"prompt_token_ids": p} for p in prompts_of([40, 23], seed=3)]  # CSA and HCA windows close
LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
TWIN_BF16_TOLERANCE = 2e-2  # the bar: the FP8 model (fp32 compute) against the twin in bf16
WEIGHT_ONLY_TOLERANCE = 1e-4  # activations as they are against HF on the twin in fp32: the same products


@dataclass(frozen=True)
class Checkpoints:
    src: Path
    fp8: Path
    twin: Path


def _is_fp8(name: str, w: torch.Tensor) -> bool:
    return name.endswith(".weight") and w.dim() == 2 and w.is_floating_point() and not name.endswith(_DENSE)


def write_v4_fp8(src: Path, dst: Path, twin: Path, scale_shapes: dict[str, tuple[int, ...]] | None = None,
                 not_converted: tuple[str, ...] = ()) -> None:
    """`src` with every projection (routed and shared experts included) in DeepSeek's FP8 block form at `dst`, and
    at `twin` the dequantized weights in fp32. `scale_shapes`: scales of these weights reshaped (to be refused).
    `not_converted`: (checkpoint name part, module) of projections shipped dense, the modules listed in
    quantization_config's modules_to_not_convert."""
    weights, shipped, dequantized = load_file(f"{src}/model.safetensors"), {}, {}
    for name, w in weights.items():
        if not _is_fp8(name, w) or any(part in name for part, _ in not_converted):
            scale = HEAD_SHRINK if name == "head.weight" else SHRINK if _is_fp8(name, w) else 1
            shipped[name] = dequantized[name] = w * scale
            continue
        q, scale = _block_quantize(w * SHRINK, pow2=False)
        dequantized[name] = _block_dequantize(q, scale)
        shipped |= {name: q, name.removesuffix("weight") + "weight_scale_inv":
                    scale.expand((scale_shapes or {}).get(name, scale.shape)).contiguous()}
    config = json.loads((src / "config.json").read_text())
    quantization = CONFIG | ({"modules_to_not_convert": [m for _, m in not_converted]} if not_converted else {})
    for path, tensors, extra in ((dst, shipped, {"quantization_config": quantization}), (twin, dequantized, {})):
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config | extra))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    root = tmp_path_factory.mktemp("deepseek-v4-fp8")
    found = Checkpoints(root / "src", root / "fp8", root / "twin")
    save_tiny(found.src, None)
    write_v4_fp8(found.src, found.fp8, found.twin)
    return found


@pytest.fixture(scope="module")
def fp8_llm(checkpoints):
    return _llm(checkpoints.fp8)


def prompt_logprobs(llm) -> torch.Tensor:
    outs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    return torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])


def test_canonical_names_are_fixed_points():
    """checkpoint_target canonicalises the names the FP8 method asks with; names already canonical stay."""
    for raw in ("model.layers.1.attn.indexer.compressor.wkv.weight", "model.layers.2.ffn.experts.3.w2.weight",
                "model.layers.1.attn.compressor.norm.weight", "model.layers.0.hc_attn_scale", "head.weight",
                "model.layers.1.attn.indexer.weights_proj.weight", "model.layers.3.ffn.gate.bias"):
        name = canonical_name(raw)
        assert canonical_name(name) == name


def test_linears_and_routed_experts_stay_in_fp8(fp8_llm, checkpoints):
    model, twin = fp8_llm.engine.model, load_file(f"{checkpoints.twin}/model.safetensors")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    layer = "model.layers.1"  # a CSA layer: q_a, q_b, kv, o_b, the compressor's, the indexer's, the shared expert
    for part in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
                 "self_attn.compressor.kv_proj", "self_attn.compressor.gate_proj",
                 "self_attn.compressor.indexer.kv_proj", "self_attn.compressor.indexer.gate_proj",
                 "self_attn.compressor.indexer.q_b_proj", "mlp.shared_experts.gate_up_proj",
                 "mlp.shared_experts.down_proj"):
        assert f"{layer}.{part}" in linears
    for name, m in linears.items():
        assert isinstance(m.quant_method, Fp8LinearMethod) and m.weight.dtype == fp8.FP8, name
        assert m.weight_scale.shape[1] == 1  # every input dim < 128: one partial block column
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.q_b_proj.quant_method.dequantized(attn.q_b_proj), twin[f"{layer}.attn.wq_b.weight"])
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == TINY["num_hidden_layers"]
    for moe in experts:
        assert isinstance(moe.quant_method, Fp8MoeMethod) and moe.w13.dtype == moe.w2.dtype == fp8.FP8
    moe = experts[1]
    assert torch.equal(moe.quant_method.dequantized(moe, "w2", 3), twin[f"{layer}.ffn.experts.3.w2.weight"])
    # o_a_proj (grouped, no linear layer) dequantized at load; what DeepSeek leaves dense stays as shipped
    assert attn.o_a_proj.weight.dtype == torch.float32
    assert torch.equal(attn.o_a_proj.weight, twin[f"{layer}.attn.wo_a.weight"])
    shipped = load_file(f"{checkpoints.fp8}/model.safetensors")
    dense = {"model.embed_tokens.weight": model.model.embed_tokens.weight, "head.weight": model.lm_head.weight,
             f"{layer}.ffn.gate.weight": model.model.layers[1].mlp.gate.weight,
             f"{layer}.attn.indexer.weights_proj.weight": attn.compressor.indexer.weights_proj.weight,
             f"{layer}.hc_attn_fn": model.model.layers[1].attn_hc.fn,
             f"{layer}.attn.compressor.ape": attn.compressor.position_bias, f"{layer}.attn.attn_sink": attn.sinks}
    for name, param in dense.items():
        assert param.dtype == torch.float32 and torch.equal(param, shipped[name]), name
    assert torch.equal(model.model.layers[1].mlp.gate.tid2eid, shipped[f"{layer}.ffn.gate.tid2eid"])


def test_fp8_matches_the_bf16_twin(fp8_llm, checkpoints):
    twin = _llm(checkpoints.twin, "bfloat16")
    try:
        off = (prompt_logprobs(fp8_llm) - prompt_logprobs(twin)).abs()
    finally:
        twin.shutdown()
    assert off.max() < TWIN_BF16_TOLERANCE, off


def _hf_on_twin(twin: Path) -> torch.Tensor:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    with torch.no_grad():
        return torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(hf, p["prompt_token_ids"])])


def test_weight_only_matches_hf_on_the_fp32_twin(fp8_llm, checkpoints):
    """Every FP8 layer and expert with activations as they are (`quantize_activations` off): the dequantized
    weights' model, which HF runs on the twin."""
    with activations_unquantized(fp8_llm):
        off = (prompt_logprobs(fp8_llm) - _hf_on_twin(checkpoints.twin)).abs()
    assert off.max() < WEIGHT_ONLY_TOLERANCE, off


# as DeepSeek-V4-Flash ships them (HF's _keep_in_fp32_modules for deepseek_v4): the compressors' and the indexer's
# kv and gate projections in BF16, no scales
_FLASH_DENSE = ((".compressor.wkv.", "self_attn.compressor.kv_proj"),
                (".compressor.wgate.", "self_attn.compressor.gate_proj"),
                (".indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj"),
                (".indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj"))


def test_projections_listed_as_not_converted_stay_dense(checkpoints, tmp_path):
    """modules_to_not_convert keeps the compressors' dense projections dense (exactly as shipped), the rest in FP8;
    weight-only, the model is HF's on the twin."""
    write_v4_fp8(checkpoints.src, tmp_path / "fp8", tmp_path / "twin", not_converted=_FLASH_DENSE)
    llm = _llm(tmp_path / "fp8")
    shipped = load_file(f"{tmp_path / 'fp8'}/model.safetensors")
    compressor = llm.engine.model.model.layers[1].self_attn.compressor
    for layer, name in ((compressor.kv_proj, "attn.compressor.wkv"), (compressor.indexer.gate_proj,
                                                                      "attn.indexer.compressor.wgate")):
        x = torch.randn(3, TINY["hidden_size"])
        want = x @ shipped[f"model.layers.1.{name}.weight"].t()
        assert layer.quant_method is None and torch.allclose(layer(x), want, atol=1e-6)
    assert isinstance(compressor.indexer.q_b_proj.quant_method, Fp8LinearMethod)
    for module in llm.engine.model.modules():
        if isinstance(getattr(module, "quant_method", None), (Fp8LinearMethod, Fp8MoeMethod)):
            module.quant_method.quantize_activations = False
    off = (prompt_logprobs(llm) - _hf_on_twin(tmp_path / "twin")).abs()
    llm.shutdown()
    assert off.max() < WEIGHT_ONLY_TOLERANCE, off


@pytest.mark.parametrize("weight", ["model.layers.1.attn.wo_a.weight", "model.layers.2.attn.compressor.wkv.weight",
                                    "model.layers.1.ffn.experts.2.w1.weight"])
def test_a_misshaped_scale_is_refused_naming_it(checkpoints, tmp_path, weight):
    """o_a_proj (dequantized at load), a compressor's linear and a routed expert: a scale of two block rows for
    a weight of one."""
    write_v4_fp8(checkpoints.src, tmp_path / "bad", tmp_path / "twin", scale_shapes={weight: (2, 1)})
    scale = weight.removesuffix("weight") + "weight_scale_inv"
    with pytest.raises(ValueError, match=scale.replace(".", r"\.") + r" has shape \(2, 1\)"):
        load_model(ModelConfig(model=str(tmp_path / "bad"), dtype=torch.float32), "cpu")


def test_scales_without_quantization_config_are_refused(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(load_file(f"{checkpoints.fp8}/model.safetensors"), str(bad / "model.safetensors"))
    config = json.loads((checkpoints.fp8 / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match="weight_scale_inv: this checkpoint stores FP8 block-quantized weights"):
        load_model(ModelConfig(model=str(bad), dtype=torch.float32), "cpu")


def test_scales_named_as_deepseeks_inference_code_names_them_are_refused(checkpoints, tmp_path):
    """`X.scale` beside `X.weight` (DeepSeek's inference code's names) is not read: refused, naming a tensor."""
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(f"{checkpoints.fp8}/model.safetensors")
    save_file({k.replace(".weight_scale_inv", ".scale"): v for k, v in tensors.items()}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((checkpoints.fp8 / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn\.\w+\.(scale|weight)\b"):
        load_model(ModelConfig(model=str(bad), dtype=torch.float32), "cpu")
