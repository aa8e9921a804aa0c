"""The fused decode GEMVs (kernels/triton/gemv.py) against their unfused torch references: RMSNorm (with and
without the residual add) then F.linear, silu(gate) * up then F.linear, and F.linear alone, at one token (the
one-token kernel) and 2, 3, 4 and 8 (the rows kernel: a masked row past 3); run by Triton's interpreter on the CPU
at tiny shapes with tails in N and K (tests/conftest.py sets TRITON_INTERPRET=1 where CUDA is absent). Rows to be
normalised are scaled apart (row i by i + 1), so a row normalised by another row's statistics would be far off.
And the decoder layer: its small-step path (the four launches around attention) equal to its modules' forward at
one and three decodes, and its choice of path: never on the CPU, never over a weight it would skip a form of.

fp16 is the exact check: the interpreter rounds to fp16 as the GPU does, so the references round where the unfused
kernels round and only the GEMM's summation order differs (the output within about an fp16 step). Its bf16 rounding
truncates instead, so bf16 is checked to bf16's coarser tolerance."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pressroom.kernels import triton as triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
SHAPES = [(40, 96), (37, 70)]  # (out, in): a partial row block and, in the second, odd N and K
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = [1, 2, 3, 4, 8]  # one token's kernel, then the rows kernel at 2, 4 (3: a masked row) and MAX_ROWS


def _gemv():
    from pressroom.kernels.triton import gemv
    return gemv


def _launches():
    """None (the default table's) and a small tiling that gives several programs and K tiles even at these
    shapes."""
    return [None, _gemv().GemvLaunch(block_n=16, block_k=32)]


def _operands(tokens: int, n: int, k: int, dtype: torch.dtype, seed: int, width: int | None = None,
              scaled: bool = False):
    """x [tokens, width or k], row i scaled by i + 1 where `scaled` (the norm's tests: each row its own statistics);
    w [n, k]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width or k, generator=gen)
    if scaled:
        x *= torch.arange(1, tokens + 1)[:, None]
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


def _scaled_rows(tokens: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[tokens, width] normal, row i scaled by (i + 1) * scale."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, width, generator=gen) * torch.arange(1, tokens + 1)[:, None] * scale


def _linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in fp32 over the rounded operands, rounded once: what an fp32-accumulating GEMM gives."""
    return F.linear(a.float(), w.float(), None if bias is None else bias.float()).to(a.dtype)


def _rms_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """kernels/triton/norm.py's arithmetic: fp32, x * rsqrt(mean(x^2) + eps) * w, rounded once."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(h.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[got.dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])  # Qwen2's qkv bias
@pytest.mark.parametrize("tokens", TOKENS)
def test_norm_gemv_equals_rms_norm_then_linear(dtype, with_residual, n, k, with_bias, tokens):
    gemv = _gemv()
    x, w = _operands(tokens, n, k, dtype, seed=tokens, scaled=True)
    residual = _scaled_rows(tokens, k, seed=50 + tokens, scale=4).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + torch.randn(k) / 4).to(DEVICE, dtype)
    bias = torch.randn(n).to(DEVICE, dtype) if with_bias else None
    x_before = x.clone()
    h = x if residual is None else (x.float() + residual.float()).to(dtype)  # torch's `x + residual`
    want = _linear(_rms_norm(h, norm_weight), w, bias)
    for launch in _launches():
        got, stream = gemv.norm_gemv(x, norm_weight, EPS, w, residual, bias, launch=launch)
        _close(got, want)
        if residual is None:
            assert stream is x  # the stream is x itself, as `x, residual = norm(x), x`
        elif dtype == torch.float16:
            assert torch.equal(stream, h)  # every row's, written once
        else:
            _close(stream, h)
        assert torch.equal(x, x_before)  # x and the old residual are read, never written


@pytest.mark.parametrize("tokens", [1, 4])
def test_norm_gemv_over_rows_longer_than_a_statistics_tile(tokens):
    """The statistics pass reads tiles of 8,192 activations over the rows: one token's 8,300 inputs take two tiles,
    the second partial; four tokens' tiles are 2,048 wide, five tiles."""
    gemv = _gemv()
    n, k = 24, 8300
    x, w = _operands(tokens, n, k, torch.float16, seed=301, scaled=True)
    residual = _scaled_rows(tokens, k, seed=302).to(DEVICE, torch.float16)
    norm_weight = (1 + torch.randn(k) / 4).to(DEVICE, torch.float16)
    h = (x.float() + residual.float()).to(torch.float16)
    got, stream = gemv.norm_gemv(x, norm_weight, EPS, w, residual)
    _close(got, _linear(_rms_norm(h, norm_weight), w))
    assert torch.equal(stream, h)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul_gemv_equals_swiglu_then_linear(dtype, n, k, tokens):
    gemv = _gemv()
    gate_up, w = _operands(tokens, n, k, dtype, seed=100 + tokens, width=2 * k)
    bias = torch.randn(n).to(DEVICE, dtype) if tokens % 2 else None
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = _linear((F.silu(gate) * up).to(dtype), w, bias)  # activation.py's: fp32, rounded once
    for launch in _launches():
        _close(gemv.silu_mul_gemv(gate_up, w, bias, launch=launch), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gemv_equals_linear_for_a_view_into_a_wider_row(dtype, n, k, tokens):
    gemv = _gemv()
    wide, w = _operands(tokens, n, k, dtype, seed=200, width=k + 8)
    x = wide[:, 8:]  # a view starting past its storage's start, at a row stride longer than K
    bias = torch.randn(n).to(DEVICE, dtype)
    for launch in _launches():
        _close(gemv.gemv(x, w, launch=launch), _linear(x, w))
        _close(gemv.gemv(x, w, bias, launch=launch), _linear(x, w, bias))


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_prologues_read_rows_at_their_strides(tokens):
    """x, the residual and gate_up as views into wider rows, each at its own row stride (fp16: exact)."""
    gemv = _gemv()
    n, k = 37, 70
    wide, w = _operands(tokens, n, k, torch.float16, seed=400, width=k + 3, scaled=True)
    x = wide[:, 3:]
    residual = _scaled_rows(tokens, k + 10, seed=401).to(DEVICE, torch.float16)[:, :k]
    norm_weight = (1 + torch.randn(k) / 4).to(DEVICE, torch.float16)
    h = (x.float() + residual.float()).to(torch.float16)
    got, stream = gemv.norm_gemv(x, norm_weight, EPS, w, residual)
    _close(got, _linear(_rms_norm(h, norm_weight), w))
    assert torch.equal(stream, h)
    wide_gate_up, _ = _operands(tokens, n, k, torch.float16, seed=402, width=2 * k + 5)
    gate_up = wide_gate_up[:, 5:]
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close(gemv.silu_mul_gemv(gate_up, w), _linear((F.silu(gate) * up).half(), w))


def test_the_kernels_refuse_what_they_do_not_take():
    gemv = _gemv()
    x, w = _operands(gemv.MAX_ROWS + 1, 16, 32, torch.float16, seed=0)
    with pytest.raises(ValueError, match="tokens <= 8"):
        gemv.gemv(x, w)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv.gemv(x[:1].float(), w.float())
    with pytest.raises(ValueError, match=r"\[out, 32\]"):
        gemv.gemv(x[:1], w[:, :16])
    with pytest.raises(ValueError, match="residual must match"):
        gemv.norm_gemv(x[:1], torch.ones(32, dtype=x.dtype, device=DEVICE), EPS, w, x[:1, :16])
    with pytest.raises(ValueError, match="2 \\* I"):
        gemv.silu_mul_gemv(x[:1, :31], w)
    with pytest.raises(ValueError, match="power of two"):
        gemv.GemvLaunch(block_n=12, block_k=64)


def test_the_rows_kernels_launches_keep_the_accumulator_within_its_registers():
    """Past one token rows_launch cuts block_k, only as far as needed, so rows x block_n x block_k fp32
    accumulators fit ACC_PER_THREAD a thread: the defaults are so cut, the swept launches within twice that; one
    token's defaults are the one-token table's as they are."""
    gemv = _gemv()
    assert gemv.GEMV_MAX_TOKENS <= gemv.MAX_ROWS
    for tokens in range(2, gemv.MAX_ROWS + 1):
        for n, k in LLAMA_8B.values():
            launch = gemv.default_launch(n, k, tokens)
            assert gemv.rows_launch(launch, tokens) == launch
            assert gemv.acc_per_thread(launch, tokens) <= gemv.ACC_PER_THREAD
            table = gemv.MULTI_ROW_LAUNCHES[gemv.shape_class(n, k)]
            assert launch.block_k == table.block_k or 2 * gemv.acc_per_thread(launch, tokens) > gemv.ACC_PER_THREAD
        swept = gemv.sweep_launches(tokens)
        assert len(set(swept)) == len(swept) > 8
        assert all(gemv.acc_per_thread(launch, tokens) <= 2 * gemv.ACC_PER_THREAD for launch in swept)
    assert all(gemv.default_launch(n, k) == gemv.DEFAULT_LAUNCHES[gemv.shape_class(n, k)]
               for n, k in LLAMA_8B.values())
    assert gemv.rows_launch(gemv.GemvLaunch(16, 512), 1) == gemv.GemvLaunch(16, 512)


def test_each_llama_projection_takes_its_own_swept_launch():
    """Llama-3.1-8B's four projections fall in four shape classes, each with the H100 sweep's best; so do
    SmolLM2-135M's (960 x 576 qkv) and Qwen2.5-7B's (4608 x 3584 qkv)."""
    gemv = _gemv()
    classes = {name: gemv.shape_class(n, k) for name, (n, k) in LLAMA_8B.items()}
    assert classes == {"qkv": "wide", "o": "square", "gate_up": "tall", "down": "long"}
    assert set(gemv.DEFAULT_LAUNCHES) == set(classes.values())
    assert gemv.shape_class(960, 576) == gemv.shape_class(4608, 3584) == "wide"
    sweep = set(gemv.sweep_launches())
    assert all(launch in sweep for launch in gemv.DEFAULT_LAUNCHES.values())


def _tiny_layer(dtype: torch.dtype):
    from conftest import tiny_config

    from pressroom.model.models.llama import LlamaDecoderLayer
    return LlamaDecoderLayer(tiny_config("llama"), qk_norm=False).to(dtype)


def _as_fp8_rows(linear) -> None:
    """The layer's weight quantized online to FP8 with one scale a row, weight-only at every step (as a decode step
    runs it on CUDA)."""
    from pressroom.model.quantization.fp8 import Fp8LinearMethod
    linear.set_quant_method(Fp8LinearMethod(serialized=False))
    linear.quant_method.quantize_activations = False
    linear.quant_method.process_weights_after_loading(linear)


@pytest.mark.parametrize("with_residual, decodes, fp8", [(False, 1, False), (True, 1, False), (False, 3, False),
                                                         (True, 3, False), (True, 1, True)])
def test_the_decoder_layers_small_step_path_equals_its_modules_forward(with_residual, decodes, fp8, monkeypatch):
    """LlamaDecoderLayer._forward_small (the four fused launches around attention; the interpreter on the CPU) against
    forward through its modules, one decode token of each of `decodes` sequences over a cached context (three: the
    rows kernel, as a step takes it once GEMV_MAX_TOKENS is raised), fp16, qkv bias on: the same layer output up to
    the GEMMs' summation order, the same residual stream and the same KV cache entries. `fp8`: every projection
    FP8 with row scales (the modules' forward: Fp8LinearMethod's weight-only product)."""
    from conftest import tiny_config

    from pressroom.attention.backend import AttentionMetadata, forward_context
    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.model.models import llama
    from pressroom.model.models.llama import LlamaDecoderLayer, RopeTables, rotary_from_config
    monkeypatch.setattr(llama, "SMALL_STEP_GEMV", False)  # forward: the modules' path on CUDA too
    config = tiny_config("llama")
    config.attention_bias = True  # Qwen2's
    layer = LlamaDecoderLayer(config, qk_norm=False)
    gen = torch.Generator().manual_seed(1)
    for name, p in layer.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.data.copy_(1 + noise / 4 if "norm" in name else noise / p.shape[-1] ** 0.5)
    layer = layer.to(DEVICE, torch.float16)
    if fp8:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            _as_fp8_rows(linear)
    attn = layer.self_attn.attn
    attn.backend = TorchAttentionBackend()  # the same attention on both paths: the GEMVs' wiring is under test
    block = 8  # a block a sequence, each with 5 cached tokens and the step's at position 5
    past = torch.randn(attn.cache_shape(decodes, block), generator=gen).to(DEVICE, torch.float16)
    rotary = rotary_from_config(config).to(DEVICE)
    rope = RopeTables(rotary, *rotary.cos_sin(torch.full((decodes,), 5, device=DEVICE)))
    seqs = torch.arange(decodes, device=DEVICE)
    meta = AttentionMetadata(num_decodes=decodes, num_decode_tokens=decodes, slot_mapping=seqs * block + 5,
                             block_tables=seqs[:, None], seq_lens=torch.full((decodes,), 6, device=DEVICE),
                             query_start_loc=list(range(decodes + 1)), seq_lens_host=[6] * decodes, max_query_len=1)
    x = torch.randn(decodes, config.hidden_size, generator=gen).to(DEVICE, torch.float16)
    residual = (torch.randn(decodes, config.hidden_size, generator=gen).to(DEVICE, torch.float16) if with_residual
                else None)

    def step(forward):
        attn.kv_cache = past.clone()
        with forward_context(meta):
            out, stream = forward(rope, x, residual)
        return out, stream, attn.kv_cache

    want_out, want_stream, want_cache = step(layer.forward)
    out, stream, cache = step(layer._forward_small)
    _close(out, want_out)
    assert torch.equal(stream, want_stream) and torch.equal(cache, want_cache)


def test_the_decoder_layer_keeps_its_own_path_on_the_cpu():
    layer = _tiny_layer(torch.bfloat16)
    assert not layer._takes_small_step(torch.zeros(1, 64, dtype=torch.bfloat16))


def test_only_plain_dense_weights_on_one_rank_count_as_fusable():
    from pressroom.model.models.llama import dense_on_one_rank
    layer = _tiny_layer(torch.bfloat16)
    qkv = layer.self_attn.qkv_proj
    assert dense_on_one_rank(qkv, torch.bfloat16)
    assert not dense_on_one_rank(qkv, torch.float16)  # another dtype than the step's
    handle = qkv.register_forward_hook(lambda module, inputs, output: output)  # LoRA's updates come as hooks
    assert not dense_on_one_rank(qkv, torch.bfloat16)
    handle.remove()
    qkv.batch_invariant = True
    assert not dense_on_one_rank(qkv, torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 3])
def test_fp8_weights_with_row_scales_take_the_same_prologues(tokens):
    """FP8 e4m3 weights with one fp32 scale a row (Fp8LinearMethod's per-row form): norm_gemv, silu_mul_gemv and gemv
    equal the unfused prologue then the weight-only FP8 product (dequantized weight, fp32 sums, scaled per row)."""
    from pressroom.kernels import fp8
    gemv = _gemv()
    n, k = SHAPES[1]
    x, w_full = _operands(tokens, n, k, torch.float16, seed=400 + tokens, scaled=True)
    w, scale = fp8.quantize(w_full.float().cpu(), k)
    w, scale = w.to(DEVICE), scale.reshape(-1).to(DEVICE)
    dense = (w.float() * scale[:, None]).to(DEVICE)  # what the product multiplies by, in fp32
    bias = torch.randn(n).to(DEVICE, torch.float16)
    residual = _scaled_rows(tokens, k, seed=401, scale=4).to(DEVICE, torch.float16)
    norm_weight = (1 + torch.randn(k) / 4).to(DEVICE, torch.float16)

    def product(a, b=None):
        return F.linear(a.float(), dense, None if b is None else b.float()).to(torch.float16)

    h = (x.float() + residual.float()).to(torch.float16)
    for launch in _launches():
        got, stream = gemv.norm_gemv(x, norm_weight, EPS, w, residual, bias, launch=launch, scale=scale)
        _close(got, product(_rms_norm(h, norm_weight), bias))
        assert torch.equal(stream, h)
        _close(gemv.gemv(x, w, launch=launch, scale=scale), product(x))
        gate_up = torch.cat([x, residual], dim=1)
        _close(gemv.silu_mul_gemv(gate_up, w, launch=launch, scale=scale),
               product((F.silu(x.float()) * residual.float()).to(torch.float16)))
    with pytest.raises(ValueError, match="FP8 e4m3 weights with their scales"):
        gemv.gemv(x, w)  # an FP8 weight without its scales
    with pytest.raises(ValueError, match="one a row"):
        gemv.gemv(x, w, scale=scale[:-1])


def test_fp8_weights_with_row_scales_on_one_rank_count_as_fusable():
    from pressroom.model.models.llama import dense_on_one_rank, fp8_rows_on_one_rank
    layer = _tiny_layer(torch.bfloat16)
    qkv = layer.self_attn.qkv_proj
    assert not fp8_rows_on_one_rank(qkv)  # dense
    _as_fp8_rows(qkv)
    assert fp8_rows_on_one_rank(qkv) and not dense_on_one_rank(qkv, torch.bfloat16)
    handle = qkv.register_forward_hook(lambda module, inputs, output: output)
    assert not fp8_rows_on_one_rank(qkv)
    handle.remove()
    o = layer.self_attn.o_proj  # block scales (DeepSeek's checkpoints): not one a row
    from pressroom.model.quantization.fp8 import Fp8LinearMethod
    o.set_quant_method(Fp8LinearMethod(serialized=False, block_cols=32))
    o.quant_method.process_weights_after_loading(o)
    assert o.weight_scale.shape[1] > 1 and not fp8_rows_on_one_rank(o)
