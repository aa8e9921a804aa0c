"""DeepSeek's FP8 block checkpoints with their routed experts kept in FP8 (model/quantization/fp8.py's
`Fp8MoeMethod`): a tiny DeepSeek-V3 written in DeepSeek's form (test_deepseek_fp8_blocks.py's writer; expert shapes
of whole 128 x 128 blocks, hidden 256, moe_intermediate_size 256), loaded with each FusedMoE holding FP8 experts and
block scales, against its dequantized twin in bf16, HF transformers on the twin with each FP8 layer's and expert's
inputs rounded to FP8 as pressroom rounds them, and HF on the twin as it is when pressroom runs weight-only. Plus the
slices a rank holds (tensor and expert parallelism), the refusals, and the kernels' power-of-two activation scales.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_prompt_logprobs, tiny_config
from safetensors.torch import load_file, save_file
from test_deepseek_fp8_blocks import (
    _NOT_KEPT_IN_FP8,
    CONFIG,
    PROMPTS,
    VOCAB,
    _fake_quant,
    _llm,
    prompt_logprobs,
    write_deepseek_fp8,
)
from torch import nn

from pressroom.config import ModelConfig
from pressroom.distributed import parallel_state
from pressroom.kernels import fp8, fp8_moe
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.moe_activation import LimitedSwiglu
from pressroom.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from pressroom.model.loader import load_model
from pressroom.model.quantization.fp8 import Fp8LinearMethod, Fp8Method, Fp8MoeMethod, Fp8Weight

HIDDEN, INTER, EXPERTS = 256, 256, 8
# the FP8 model (fp32 compute, DeepSeek's activation recipe) against the twin in bf16: the bar
TWIN_BF16_TOLERANCE = 2e-2
# against HF on the twin with the same FP8 roundings (linear layers' and experts' inputs): the same arithmetic in
# another order (measured: 5e-7), except where an activation sits on an FP8 rounding boundary and rounds the other
# way, which moves that position and the ones after it in its prompt. Experts fed unrounded activations instead: 16
# of the 18 positions over 1e-4.
FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS = 1e-4, 2
# test_deepseek_fp8_blocks.py's init scale, lowered a little: these shapes amplify FP8's rounding more (at 0.01 the
# bf16 twin was 1.7e-2 away, at 0.008 8.5e-3; the logprobs span 0.42 nats)
INIT_HERE = 0.008
# weight-only (activations not quantized) against HF on the twin as it is: the same fp32 products
WEIGHT_ONLY_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Checkpoints:
    src: Path  # the HF checkpoint the FP8 ones are written from
    fp8: Path
    twin: Path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    import transformers
    cfg = tiny_config("deepseek_v3")
    # o_proj's inputs (4 heads x 64) and every MLP's intermediate features split over two ranks at block edges
    cfg.update(dict(vocab_size=VOCAB, hidden_size=HIDDEN, moe_intermediate_size=INTER, intermediate_size=256,
                    v_head_dim=64, q_lora_rank=160, kv_lora_rank=124, initializer_range=INIT_HERE))
    torch.manual_seed(44)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zero at init: make it steer the choice
            buffer.copy_(torch.rand(buffer.shape) * 0.5)
    root = tmp_path_factory.mktemp("deepseek-fp8-experts")
    model.save_pretrained(root / "src")
    found = Checkpoints(root / "src", root / "fp8", root / "twin")
    write_deepseek_fp8(found.src, found.fp8, found.twin)
    return found


@pytest.fixture(scope="module")
def fp8_llm(checkpoints):
    return _llm(checkpoints.fp8)


def _experts_of(llm) -> list[FusedMoE]:
    return [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]


def _fake_quant_experts(module: nn.Module, pow2: bool):
    """HF's DeepseekV3Experts with each expert's input and intermediate rounded to FP8 per token and 128 inputs, as
    DeepSeek's recipe does (written here from the twin's dense experts)."""
    def rounded(a: torch.Tensor) -> torch.Tensor:
        return fp8.dequantize(*fp8.quantize(a, 128, pow2), 128)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        fed, out = rounded(hidden_states), torch.zeros_like(hidden_states)
        for e in range(module.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = (fed[token] @ module.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = rounded(F.silu(gate) * up) @ module.down_proj[e].t()
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out
    return forward


def _hf_logprobs(twin: Path, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's prompt logprobs on the twin as it is, and with every FP8 linear layer's and expert's input rounded."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)

    def logprobs() -> torch.Tensor:
        return torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(hf, p["prompt_token_ids"])])

    with torch.no_grad():
        plain = logprobs()
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith(_NOT_KEPT_IN_FP8):
                module.forward = _fake_quant(module, pow2)
            elif type(module).__name__ == "DeepseekV3Experts":
                module.forward = _fake_quant_experts(module, pow2)
        return plain, logprobs()


@pytest.fixture(scope="module")
def hf_on_twin(checkpoints) -> tuple[torch.Tensor, torch.Tensor]:
    return _hf_logprobs(checkpoints.twin)


def _assert_near(got: torch.Tensor, want: torch.Tensor, tolerance: float, flips: int = 0) -> None:
    off = (got - want).abs()
    assert (off > tolerance).sum() <= flips and off.max() < TWIN_BF16_TOLERANCE, off


def test_routed_experts_stay_in_fp8_one_byte_a_weight(fp8_llm, checkpoints):
    twin = load_file(f"{checkpoints.twin}/model.safetensors")
    layers = _experts_of(fp8_llm)
    assert layers
    for moe in layers:
        method = moe.quant_method
        assert isinstance(method, Fp8MoeMethod) and not method.pow2_scales
        assert moe.w13.dtype == moe.w2.dtype == fp8.FP8
        assert moe.w13_scale.shape == (EXPERTS, 4, 2) and moe.w2_scale.shape == (EXPERTS, 2, 2)  # gate's, up's grids
        held = sum(t.numel() * t.element_size() for t in [*moe.parameters(), *moe.buffers()])
        assert held == moe.w13.numel() + moe.w2.numel() + 4 * (moe.w13_scale.numel() + moe.w2_scale.numel())
    # layer 1's experts multiply by exactly the twin's dequantized weights
    moe, stem = layers[0], "model.layers.1.mlp.experts"
    for e in range(EXPERTS):
        w13 = torch.cat([twin[f"{stem}.{e}.gate_proj.weight"], twin[f"{stem}.{e}.up_proj.weight"]])
        assert torch.equal(moe.quant_method.dequantized(moe, "w13", e), w13)
        assert torch.equal(moe.quant_method.dequantized(moe, "w2", e), twin[f"{stem}.{e}.down_proj.weight"])


def test_fp8_experts_match_the_twin_in_bf16_and_hf_with_the_same_roundings(fp8_llm, checkpoints, hf_on_twin):
    got = prompt_logprobs(fp8_llm)
    _assert_near(got, prompt_logprobs(_llm(checkpoints.twin, "bfloat16")), TWIN_BF16_TOLERANCE)
    _assert_near(got, hf_on_twin[1], FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS)


@contextmanager
def activations_unquantized(llm) -> Iterator[None]:
    """Every FP8 layer and expert of `llm` with activations as they are (`quantize_activations` off): the
    dequantized weights' model."""
    methods = [m.quant_method for m in llm.engine.model.modules()
               if isinstance(getattr(m, "quant_method", None), (Fp8LinearMethod, Fp8MoeMethod))]
    try:
        for method in methods:
            method.quantize_activations = False
        yield
    finally:
        for method in methods:
            method.quantize_activations = True


def test_weight_only_matches_the_fp32_twin(fp8_llm, hf_on_twin):
    """Activations unquantized: the dequantized weights' model, which HF runs on the twin."""
    with activations_unquantized(fp8_llm):
        _assert_near(prompt_logprobs(fp8_llm), hf_on_twin[0], WEIGHT_ONLY_TOLERANCE)


@pytest.mark.slow  # another engine and HF oracle (~4 s)
def test_ue8m0_experts_scale_activations_by_powers_of_two(checkpoints, tmp_path):
    """scale_fmt ue8m0 (exponent bytes): the experts' scales and their activations' are powers of two."""
    write_deepseek_fp8(checkpoints.src, tmp_path / "ue8m0", tmp_path / "twin", scale_fmt="ue8m0")
    llm = _llm(tmp_path / "ue8m0")
    moe = _experts_of(llm)[0]
    assert moe.quant_method.pow2_scales and moe.w13.dtype == fp8.FP8
    assert torch.equal(torch.exp2(torch.log2(moe.w13_scale).round()), moe.w13_scale)
    _, rounded = _hf_logprobs(tmp_path / "twin", pow2=True)
    _assert_near(prompt_logprobs(llm), rounded, FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS)


def _rank_experts(path: Path, monkeypatch, rank: int, expert_parallel: bool) -> FusedMoE:
    """Layer 1's experts as rank `rank` of two builds and loads them (no process group: loading needs none)."""
    monkeypatch.setattr(parallel_state, "_RANK", rank)
    monkeypatch.setattr(parallel_state, "_SIZE", 2)
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", expert_parallel)
    model = load_model(ModelConfig(model=str(path), dtype=torch.float32), "cpu").model
    return next(m for m in model.modules() if isinstance(m, FusedMoE))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_rank_of_two_holds_its_experts_in_fp8(fp8_llm, checkpoints, monkeypatch, expert_parallel):
    """Rank 1 of two: experts 4 to 7 whole (expert parallelism), or every expert's second 128 intermediate features
    (gate's and up's rows, down's columns), in FP8 with their blocks' scales."""
    whole = _experts_of(fp8_llm)[0]
    moe = _rank_experts(checkpoints.fp8, monkeypatch, 1, expert_parallel)
    assert isinstance(moe.quant_method, Fp8MoeMethod) and moe.w13.dtype == moe.w2.dtype == fp8.FP8
    half = moe.quant_method.dequantized
    for e in range(moe.w13.shape[0]):
        gate_up, down = whole.quant_method.dequantized(whole, "w13", e), whole.quant_method.dequantized(whole, "w2", e)
        if expert_parallel:
            e_whole = e + EXPERTS // 2
            want13 = whole.quant_method.dequantized(whole, "w13", e_whole)
            want2 = whole.quant_method.dequantized(whole, "w2", e_whole)
        else:
            want13, want2 = torch.cat([gate_up[128:256], gate_up[384:]]), down[:, 128:]
        assert torch.equal(half(moe, "w13", e), want13) and torch.equal(half(moe, "w2", e), want2)
    assert moe.w13.shape == ((4, 512, HIDDEN) if expert_parallel else (EXPERTS, 256, HIDDEN))


@pytest.mark.slow  # two engines of two worker processes each (~15 s on two cores)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_experts_over_two_ranks_give_one_ranks_logprobs(fp8_llm, checkpoints, expert_parallel):
    """Each rank's slices of the intermediate features are whole 128-input groups, so the activations round as on
    one rank and the sums differ only in order (a value on an FP8 rounding boundary may flip)."""
    llm = _llm(checkpoints.fp8, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        _assert_near(prompt_logprobs(llm), prompt_logprobs(fp8_llm), FAKE_QUANT_TOLERANCE, FAKE_QUANT_FLIPS)
    finally:
        llm.shutdown()


def _fp8_expert_weights(seed: int) -> dict[tuple[str, int], Fp8Weight]:
    """Each expert's gate, up and down as an FP8 checkpoint's rows read them (per-row block scales), inter 320: a
    partial last block."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(4):
        for part, shape in ((GATE, (320, HIDDEN)), (UP, (320, HIDDEN)), (DOWN, (HIDDEN, 320))):
            q, scale = fp8_moe.quantize_blocks(torch.randn(shape, generator=gen) * 10 ** (e - 2))
            out[part, e] = Fp8Weight(q, scale.repeat_interleave(128, 0)[:shape[0]], 128)
    return out


def _loaded_layer(expert_range=None, inter_shard=(0, 1), inter: int = 320, activation=None, fp8_held: bool = True
                  ) -> FusedMoE:
    """Experts loaded from _fp8_expert_weights: held in FP8, or (not `fp8_held`) dense, dequantized."""
    moe = FusedMoE(4, HIDDEN, inter, expert_range=expert_range, inter_shard=inter_shard, activation=activation)
    if fp8_held:
        moe.set_quant_method(Fp8Method(CONFIG).moe_method(moe, "model.layers.1.mlp.experts"))
    for (part, e), w in _fp8_expert_weights(seed=1).items():
        loaded = w.lazy() if inter == 320 else _cut(w, inter)
        moe.weight_loader(moe.w2 if part == DOWN else moe.w13, loaded if fp8_held else loaded.load().dequantize(),
                          (part, e))
    return moe


def _cut(w: Fp8Weight, inter: int) -> Fp8Weight:
    """A weight of 320 intermediate features cut to `inter` (rows of gate and up, columns of down)."""
    if w.q.shape[0] == HIDDEN:
        return w.part(((0, HIDDEN), (0, inter))).lazy()
    return w.part(((0, inter), (0, HIDDEN))).lazy()


def test_a_rank_holds_whole_experts_or_whole_blocks_of_each():
    """Expert parallelism: experts 2 and 3 whole, a partial last block included. Tensor parallelism: the second
    half of 256 intermediate features (whole blocks), gate's, up's and down's; the kernel's reference over the
    rank's experts and slices sums to the whole layer's."""
    weights = _fp8_expert_weights(seed=1)
    ep = _loaded_layer(expert_range=(2, 4))
    for e in (2, 3):
        w13 = torch.cat([weights[GATE, e].dequantize(), weights[UP, e].dequantize()])
        assert torch.equal(ep.quant_method.dequantized(ep, "w13", e - 2), w13)
        assert torch.equal(ep.quant_method.dequantized(ep, "w2", e - 2), weights[DOWN, e].dequantize())
    whole, halves = _loaded_layer(inter=256), [_loaded_layer(inter_shard=(r, 2), inter=256) for r in (0, 1)]
    for e in range(4):
        gate, up = (weights[p, e].dequantize()[:256] for p in (GATE, UP))
        assert torch.equal(halves[1].quant_method.dequantized(halves[1], "w13", e), torch.cat([gate[128:], up[128:]]))
        assert torch.equal(halves[1].quant_method.dequantized(halves[1], "w2", e),
                           weights[DOWN, e].dequantize()[:, 128:256])
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1]])
    routing = (torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(3)), dim=-1), ids)
    for layer in [ep, *halves]:  # weight-only: a rank's slice of down's inputs is its own groups
        layer.quant_method.quantize_activations = False
    whole.quant_method.quantize_activations = False
    want = whole(x, *routing)  # the same fp32 products summed in another order
    torch.testing.assert_close(halves[0](x, *routing) + halves[1](x, *routing), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())
    assert ep(x, *routing).abs().sum() > 0


@pytest.mark.parametrize("shard, message", [
    ((1, 2), r"this rank's share of their 320 intermediate features \(160 from 160\) cuts a block; use a "
             "tensor_parallel_size"),
    ((0, 4), r"\(80 from 0\) cuts a block"),
])
def test_a_tensor_parallel_slice_that_cuts_a_block_is_refused(shard, message):
    moe = FusedMoE(4, HIDDEN, 320, inter_shard=shard)
    with pytest.raises(ValueError, match=rf"model.layers.1.mlp.experts: FP8 experts .* {message}"):
        Fp8Method(CONFIG).moe_method(moe, "model.layers.1.mlp.experts")


def test_deepseek_v4s_clamped_swiglu_runs_in_fp8():
    """FP8 experts with LimitedSwiglu (weight-only here) give the dense layer's output on the same weights, and the
    clamp bites."""
    gen = torch.Generator().manual_seed(6)
    x, ids = torch.randn(5, HIDDEN, generator=gen), torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1]])
    weights = torch.softmax(torch.randn(5, 2, generator=gen), dim=-1)
    clamped = _loaded_layer(activation=LimitedSwiglu(limit=20.0))
    clamped.quant_method.quantize_activations = False
    want = _loaded_layer(activation=LimitedSwiglu(limit=20.0), fp8_held=False)(x, weights, ids)
    got = clamped(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.allclose(got, _loaded_layer(fp8_held=False)(x, weights, ids), rtol=1e-3)


def test_experts_load_dense_where_blocks_are_not_128_or_quantized_online():
    moe = FusedMoE(4, HIDDEN, 320)
    assert Fp8Method({**CONFIG, "weight_block_size": [64, 64]}).moe_method(moe, "e") is None
    assert Fp8Method().moe_method(moe, "e") is None


def _rewritten(checkpoint: Path, path: Path, **changed: torch.Tensor) -> Path:
    weights = load_file(f"{checkpoint}/model.safetensors")
    path.mkdir()
    save_file({**weights, **changed}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text((checkpoint / "config.json").read_text())
    return path


def test_an_expert_scale_off_the_grid_or_a_weight_not_e4m3_is_refused_by_name(checkpoints, tmp_path):
    stem = "model.layers.1.mlp.experts.3.down_proj"
    with pytest.raises(ValueError, match=rf"{stem}.weight_scale_inv has shape \(4, 2\)"):  # [256, 256] takes [2, 2]
        _llm(_rewritten(checkpoints.fp8, tmp_path / "grid", **{f"{stem}.weight_scale_inv": torch.ones(4, 2)}))
    e5m2 = load_file(f"{checkpoints.fp8}/model.safetensors")[f"{stem}.weight"].float().to(torch.float8_e5m2)
    with pytest.raises(ValueError, match=rf"{stem}.weight is stored as torch.float8_e5m2 beside the scale "
                                         rf"{stem}.weight_scale_inv; FP8 checkpoints are read in float8_e4m3fn"):
        _llm(_rewritten(checkpoints.fp8, tmp_path / "e5m2", **{f"{stem}.weight": e5m2}))


def test_scales_of_an_unknown_dtype_or_not_finite_are_refused_by_name():
    """What the load above reads each scale through (fp8.py's _scale_values, handed the tensor's name)."""
    from pressroom.model.quantization.fp8 import _scale_values
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=rf"{name} is stored as torch.int32, an unknown scale format"):
        _scale_values(torch.ones(2, 2, dtype=torch.int32), False, name)
    with pytest.raises(ValueError, match=rf"{name} holds scales that are not finite"):
        _scale_values(torch.tensor([[1.0, float("nan")]]), False, name)
    assert torch.equal(_scale_values(torch.tensor([0.5], dtype=torch.bfloat16), False, name), torch.tensor([0.5]))


needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")


@needs_triton
def test_triton_power_of_two_activation_scales_equal_torchs():
    """ue8m0 checkpoints: the group quantization launch's power-of-two scales are kernels/fp8.py's, and the fused
    MoE with them equals the reference."""
    from pressroom.kernels.triton.fused_moe_fp8 import fused_moe_fp8, quantize_groups
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 300, generator=gen) * torch.logspace(-4, 1, 300)
    q, scale = quantize_groups(x.to(device), pow2_scales=True)
    want_q, want_scale = fp8.quantize(x, 128, pow2_scales=True)
    assert torch.equal(scale.cpu(), want_scale) and torch.equal(q.cpu().float(), want_q.float())
    w13 = fp8_moe.quantize(torch.randn(4, 256, 200, generator=gen) * 0.1, halves=2)
    w2 = fp8_moe.quantize(torch.randn(4, 200, 128, generator=gen) * 0.1)
    ids = torch.tensor([[0, 1], [2, 3], [3, 0]])
    weights, x = torch.softmax(torch.randn(3, 2, generator=gen), dim=-1), torch.randn(3, 200, generator=gen) * 4
    want = fp8_moe.reference(x, w13, w2, weights, ids, pow2_scales=True)
    on = [fp8_moe.Fp8Experts(w.weight.to(device), w.scale.to(device), w.halves) for w in (w13, w2)]
    got = fused_moe_fp8(x.to(device), *on, weights.to(device), ids.to(device), pow2_scales=True).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert not torch.allclose(want, fp8_moe.reference(x, w13, w2, weights, ids), rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("expert_range", [(2, 4), pytest.param(None, marks=pytest.mark.slow)])  # ~3 s each
def test_the_triton_kernel_reads_a_layers_fp8_experts_as_its_cpu_path_does(expert_range):
    """What Fp8MoeMethod hands fused_moe_fp8 on CUDA (its held experts, local ids, all_local), here in Triton's
    interpreter, against the layer's CPU path: partial last blocks, all of the experts or a rank's two."""
    from pressroom.kernels.triton.fused_moe_fp8 import fused_moe_fp8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = _loaded_layer(expert_range=expert_range)
    gen = torch.Generator().manual_seed(4)
    x, ids = torch.randn(5, HIDDEN, generator=gen), torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1]])
    weights = torch.softmax(torch.randn(5, 2, generator=gen), dim=-1)
    want = layer(x, weights, ids)
    held = [fp8_moe.Fp8Experts(w.weight.to(device), w.scale.to(device), w.halves)
            for w in layer.quant_method.experts(layer)]
    got = fused_moe_fp8(x.to(device), *held, weights.to(device), layer.local_ids(ids).to(device),
                        all_local=layer.owns_all).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H100/H200 box)")
def test_fp8_experts_on_cuda_match_the_twin_in_bf16(checkpoints):
    """On the GPU the experts stay in FP8 on the device and run through fused_moe_fp8 (FP8 tensor cores)."""
    llm = _llm(checkpoints.fp8, "bfloat16", device="cuda")
    moe = _experts_of(llm)[0]
    assert isinstance(moe.quant_method, Fp8MoeMethod) and moe.w13.is_cuda and moe.w13.dtype == fp8.FP8
    twin = _llm(checkpoints.twin, "bfloat16", device="cuda")
    _assert_near(prompt_logprobs(llm), prompt_logprobs(twin), TWIN_BF16_TOLERANCE)
