"""A tiny DeepSeek-V3 checkpoint written in DeepSeek's FP8 block form (each linear weight float8_e4m3fn with a
float32 `weight_scale_inv` per 128x128 block; quantization_config fmt e4m3, weight_block_size [128, 128],
dynamic activations), loaded kept in FP8 and loaded dequantized (--quantization none), against its twin (the
dequantized weights in a plain checkpoint) and HF transformers on that twin.

Its shapes make blocks full and partial (hidden 256, q_lora_rank 160, intermediate 320), and kv_lora_rank 124
puts the shared key's rope rows (124..131) across the edge between the first two row blocks, so the rope
reorder moves rows between blocks of different scales."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import hf_prompt_logprobs, tiny_config
from safetensors.torch import load_file, save_file
from torch import nn

from pressroom import LLM, SamplingParams
from pressroom.kernels import fp8
from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.layers.linear import LinearBase
from pressroom.model.quantization.fp8 import Fp8LinearMethod

BLOCK = 128
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}
VOCAB = 2048
# DeepSeek's own init scale, halved: a random model amplifies each FP8-rounded activation (~2% error) through its
# layers, and with larger weights its logprobs move by far more than a trained model's (measured against the fp32
# twin: 0.005 at 0.01, 0.03 at 0.02, 1 nat at 0.1). The logprobs here span 0.75 nats.
INIT = 0.01
PROMPTS = [{"prompt_token_ids": [11, 402, 9, 1071, 77, 1500, 23, 8, 640, 5, 2010, 37]},
           {"prompt_token_ids": [300, 2, 1800, 17, 921, 333, 64, 1]}]
LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
# The FP8 model (fp32 compute) against the twin in bf16: the bar (measured: under 7e-3).
TWIN_BF16_TOLERANCE = 2e-2
# Against HF on the twin with each FP8 layer's input rounded to FP8 per token and 128 inputs, as pressroom does:
# the same arithmetic in another order (measured: 1e-6), except where an activation sits on an FP8 rounding
# boundary and rounds the other way.
FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS = 1e-4, 2
# --quantization none (dequantized, fp32) against HF on the twin
DEQUANTIZED_TOLERANCE = 1e-4
# what DeepSeek leaves unquantized: embeddings, LM head, router, V3.2's indexer head weights
_DENSE = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "weights_proj.weight")


def _block_quantize(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> FP8 values and float32 scales [ceil(out / 128), ceil(in / 128)] (dequant: w * scale per
    block); `pow2`: scales rounded up to powers of two (ue8m0)."""
    rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    padded = nn.functional.pad(w, (0, cols * BLOCK - w.shape[1], 0, rows * BLOCK - w.shape[0]))
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fp8.FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return q.view(rows * BLOCK, cols * BLOCK)[:w.shape[0], :w.shape[1]].contiguous(), scale


def _block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    grid = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.float() * grid[:q.shape[0], :q.shape[1]]


def _write(path: Path, weights: dict[str, torch.Tensor], config: dict) -> None:
    path.mkdir()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def write_deepseek_fp8(src: Path, dst: Path, twin: Path, scale_fmt: str | None = None) -> None:
    """`src`'s every linear weight (not the router, embeddings or LM head) in DeepSeek's FP8 block form at `dst`,
    and at `twin` a plain fp32 checkpoint of the dequantized weights. scale_fmt "ue8m0": power-of-two scales
    stored as exponent bytes (float8_e8m0fnu)."""
    weights, shipped, dequantized = load_file(f"{src}/model.safetensors"), {}, {}
    for name, w in weights.items():
        if w.dim() != 2 or name.endswith(_DENSE):
            shipped[name] = dequantized[name] = w
            continue
        q, scale = _block_quantize(w, pow2=scale_fmt == "ue8m0")
        dequantized[name] = _block_dequantize(q, scale)
        stored = scale.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else scale
        shipped |= {name: q, name.removesuffix("weight") + "weight_scale_inv": stored}
    config = json.loads((src / "config.json").read_text())
    quantization = {**CONFIG, **({"scale_fmt": scale_fmt} if scale_fmt else {})}
    _write(dst, shipped, {**config, "quantization_config": quantization})
    _write(twin, dequantized, config)


@dataclass(frozen=True)
class Checkpoints:
    fp8: Path
    twin: Path
    ue8m0: Path
    ue8m0_twin: Path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    """A tiny DeepSeek-V3 in DeepSeek's FP8 form (float32 scales, and ue8m0 exponent bytes) with fp32 twins;
    no tokenizer (prompts are token ids)."""
    import transformers
    cfg = tiny_config("deepseek_v3")
    cfg.update(dict(vocab_size=VOCAB, hidden_size=256, q_lora_rank=160, intermediate_size=320, kv_lora_rank=124,
                    initializer_range=INIT))
    torch.manual_seed(43)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zero at init: make it steer the choice
            buffer.copy_(torch.rand(buffer.shape) * 0.5)
    root = tmp_path_factory.mktemp("deepseek-fp8")
    model.save_pretrained(root / "src")
    found = Checkpoints(root / "fp8", root / "twin", root / "ue8m0", root / "ue8m0-twin")
    write_deepseek_fp8(root / "src", found.fp8, found.twin)
    write_deepseek_fp8(root / "src", found.ue8m0, found.ue8m0_twin, scale_fmt="ue8m0")
    return found


def _llm(path: Path, dtype: str = "float32", **kw) -> LLM:
    # short limits: the engine's first step profiles a batch of max_num_batched_tokens
    return LLM(str(path), dtype=dtype, kv_cache_memory_gib=0.02, skip_tokenizer_init=True, max_model_len=64,
               max_num_batched_tokens=64, **kw)


def _dequantized_llm(path: Path) -> LLM:
    """--quantization none, its dense weights left in their plain layout (not oneDNN's) for comparing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LinearBase, "prepack_onednn", lambda self: False)
        return _llm(path, quantization="none")


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """The logprob of each prompt token after the first, both prompts in a row."""
    outs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    return torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])


def _hf_logprobs(twin: Path, fake_quant: bool = False, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's prompt logprobs on the twin, as it is and with each linear layer pressroom keeps in FP8 (all but
    kv_b_proj, the router, the indexer's head weights and the LM head) and each routed expert (HF's stacked
    experts) taking its inputs rounded to FP8 per token and 128 inputs (`pow2`: by power-of-two scales)."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    with torch.no_grad():
        plain = torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(hf, p["prompt_token_ids"])])
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith(_NOT_KEPT_IN_FP8):
                module.forward = _fake_quant(module, pow2)
            elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):  # HF's stacked routed experts
                module.forward = _fake_quant_experts(module, pow2)
        rounded = torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(hf, p["prompt_token_ids"])])
    return plain, rounded


_NOT_KEPT_IN_FP8 = ("kv_b_proj", "lm_head", "mlp.gate", "weights_proj")


def _fake_quant(module: nn.Linear, pow2: bool):
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rounded = fp8.dequantize(*fp8.quantize(flat, BLOCK, pow2), BLOCK)
        return (rounded @ module.weight.t()).view(*x.shape[:-1], -1)
    return forward


def _fake_quant_experts(module: nn.Module, pow2: bool):
    """HF's stacked experts with each expert's input and its intermediate SiLU(gate) * up rounded to FP8 per token
    and 128 inputs, as pressroom's FP8 experts run them (DeepSeek's recipe)."""
    def rounded(a: torch.Tensor) -> torch.Tensor:
        return fp8.dequantize(*fp8.quantize(a, BLOCK, pow2), BLOCK)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        fed, out = rounded(hidden_states), torch.zeros_like(hidden_states)
        for e in range(module.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = (fed[token] @ module.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = rounded(nn.functional.silu(gate) * up) @ module.down_proj[e].t()
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out
    return forward


@pytest.fixture(scope="module")
def hf_on_twin(checkpoints) -> tuple[torch.Tensor, torch.Tensor]:
    return _hf_logprobs(checkpoints.twin)


@pytest.fixture(scope="module")
def dequantized(checkpoints) -> LLM:
    return _dequantized_llm(checkpoints.fp8)


def _held_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each linear layer's weight as it multiplies (FP8 ones dequantized), and kv_b_proj's."""
    held = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            method = module.quant_method
            held[name] = method.dequantized(module) if method is not None else module.weight.float()
        elif name.endswith("kv_b_proj"):
            held[name] = module.weight.float()
    return held


def _assert_near(got: torch.Tensor, want: torch.Tensor, tolerance: float, flips: int = 0) -> None:
    off = (got - want).abs()
    assert (off > tolerance).sum() <= flips and off.max() < TWIN_BF16_TOLERANCE, off


def test_fp8_blocks_stay_in_fp8_and_match_the_dequantized_twin(checkpoints, hf_on_twin, dequantized):
    llm = _llm(checkpoints.fp8)
    model = llm.engine.model
    kept = [name for name, m in model.named_modules()
            if isinstance(m, LinearBase) and isinstance(m.quant_method, Fp8LinearMethod) and m.weight.dtype == fp8.FP8]
    for part in ("fused_qkv_a_proj", "q_b_proj", "o_proj", "layers.0.mlp.gate_up_proj",
                 "layers.0.mlp.down_proj", "shared_experts.gate_up_proj", "shared_experts.down_proj"):
        assert sum(part in name for name in kept) >= 1, (part, kept)
    assert next(m for m in model.modules() if isinstance(m, FusedMoE)).w13.dtype == fp8.FP8  # kept (Fp8MoeMethod)
    # the weights of the dequantized load, rope rows reordered with their scales: bit for bit
    dense = _held_weights(dequantized.engine.model)
    for name, weight in _held_weights(model).items():
        assert torch.equal(weight, dense[name]), name
    got = prompt_logprobs(llm)
    _assert_near(got, prompt_logprobs(_llm(checkpoints.twin, "bfloat16")), TWIN_BF16_TOLERANCE)
    _assert_near(got, hf_on_twin[1], FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS)


def test_quantization_none_matches_hf_on_the_dequantized_weights(dequantized, hf_on_twin):
    assert all(m.quant_method is None for m in dequantized.engine.model.modules() if isinstance(m, LinearBase))
    _assert_near(prompt_logprobs(dequantized), hf_on_twin[0], DEQUANTIZED_TOLERANCE)


@pytest.mark.slow  # ~5 s each: their own checkpoints and HF oracles
@pytest.mark.parametrize("arch, kept", [
    ("deepseek_v2", ("fused_qkv_a_proj", "o_proj", "shared_experts.down_proj")),  # q_proj + kv_a_proj_with_mqa
    ("deepseek_v32", ("q_b_proj", "fused_qkv_a_proj", "indexer.wq_b")),  # the indexer's wk is in fused_qkv_a_proj
])
def test_v2_and_v32_keep_their_linear_layers_in_fp8(arch, kept, tiny_model_dir, tmp_path):
    """V2-Lite's form (q_proj, no q compression) and V3.2's (the indexer's wq_b and wk in FP8, its head weights
    dense), one partial block per weight (hidden 64), against HF with FP8-rounded inputs."""
    write_deepseek_fp8(Path(tiny_model_dir(arch)), tmp_path / "fp8", tmp_path / "twin")
    llm, dequantized = _llm(tmp_path / "fp8"), _dequantized_llm(tmp_path / "fp8")
    held, dense = _held_weights(llm.engine.model), _held_weights(dequantized.engine.model)
    assert all(torch.equal(w, dense[name]) for name, w in held.items())
    fp8_layers = [name for name, m in llm.engine.model.named_modules()
                  if isinstance(m, LinearBase) and m.weight.dtype == fp8.FP8]
    assert all(any(part in name for name in fp8_layers) for part in kept), fp8_layers
    assert not any("weights_proj" in name for name in fp8_layers)
    _, rounded = _hf_logprobs(tmp_path / "twin")
    _assert_near(prompt_logprobs(llm), rounded, FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS)


def test_ue8m0_exponent_scales_and_power_of_two_activations(checkpoints):
    llm = _llm(checkpoints.ue8m0)
    o_proj = llm.engine.model.model.layers[1].self_attn.o_proj
    assert o_proj.quant_method.pow2_scales
    assert torch.equal(torch.exp2(torch.log2(o_proj.weight_scale).round()), o_proj.weight_scale)
    _, rounded = _hf_logprobs(checkpoints.ue8m0_twin, pow2=True)
    _assert_near(prompt_logprobs(llm), rounded, FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS)


@pytest.mark.parametrize("pow2", [False, True])
def test_the_triton_block_gemm_equals_the_reference(pow2):
    """kernels/triton/fp8_block_gemm.py (Triton's interpreter without CUDA) against kernels/fp8.py's reference:
    partial row blocks, a partial last group, tokens past one tile."""
    from pressroom.kernels.triton.fp8_block_gemm import block_fp8_linear
    gen = torch.Generator().manual_seed(5)
    x, w, bias = torch.randn(70, 320, generator=gen), torch.randn(200, 320, generator=gen) * 0.05, torch.randn(200)
    w_q, w_scale = fp8.quantize(w, BLOCK)
    want = fp8.reference(x, w_q, w_scale, BLOCK, bias, pow2)
    torch.testing.assert_close(block_fp8_linear(x, w_q, w_scale, bias, pow2), want, rtol=0, atol=1e-5)


def test_ue8m0_scales_read_as_exponent_bytes_or_powers_of_two():
    from pressroom.model.quantization.fp8 import _scale_values
    exponents = torch.tensor([[120, 127], [130, 1]], dtype=torch.uint8)
    want = torch.exp2(exponents.float() - 127)
    assert torch.equal(_scale_values(exponents, True, "s"), want)
    assert torch.equal(_scale_values(want.to(torch.float8_e8m0fnu), True, "s"), want)
    assert torch.equal(_scale_values(want, True, "s"), want)
    with pytest.raises(ValueError, match="x.weight_scale_inv is stored as torch.uint8 exponent bytes, but"):
        _scale_values(exponents, False, "x.weight_scale_inv")
    with pytest.raises(ValueError, match="the ue8m0 NaN"):
        _scale_values(torch.tensor([255], dtype=torch.uint8), True, "s")


def _with_config(checkpoint: Path, path: Path, **settings) -> Path:
    """`checkpoint`'s weights under a config.json whose quantization_config takes `settings`."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] |= settings
    path.mkdir()
    (path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("setting, value, message", [
    ("scale_fmt", "ue4m3", "quantization_config.scale_fmt is 'ue4m3', an unknown scale format"),
    ("fmt", "e5m2", "quantization_config.fmt is 'e5m2'"),
    ("weight_block_size", [128], r"quantization_config.weight_block_size must be \[rows, columns\]"),
])
def test_an_unknown_fp8_setting_is_refused_by_name(checkpoints, tmp_path, setting, value, message):
    with pytest.raises(ValueError, match=message):
        _llm(_with_config(checkpoints.fp8, tmp_path / "bad", **{setting: value}))


def test_a_scale_off_the_block_grid_or_its_promised_format_is_refused_by_name(checkpoints, tmp_path):
    weights = load_file(f"{checkpoints.fp8}/model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _write(tmp_path / "grid", {**weights, name: torch.ones(4, 4)},  # o_proj [256, 64] takes [2, 1]
           json.loads((checkpoints.fp8 / "config.json").read_text()))
    with pytest.raises(ValueError, match=rf"{name} has shape \(4, 4\)"):
        _llm(tmp_path / "grid")
    with pytest.raises(ValueError, match=r"weight_scale_inv has scales that are not powers of two"):
        _llm(_with_config(checkpoints.fp8, tmp_path / "pow2", scale_fmt="ue8m0"))  # float32 scales, any value
