"""FP8 block-scaled experts on CUDA at DeepSeek-V3's expert shape (256 experts, top-8, hidden 7168, 2048 intermediate
features): the Triton fused MoE (kernels/triton/fused_moe_fp8.py) against the torch reference (kernels/fp8_moe.py) in
bf16, DeepSeek's recipe, weight-only and with DeepSeek-V4's clamp; its time beside the bf16 kernel's on the same
experts, printed (pytest -s); and the launch sweep's table read back."""
from __future__ import annotations

import json

import pytest
import torch

from pressroom.kernels import fp8_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H100/H200 box)")]

if torch.cuda.is_available():
    from triton.testing import do_bench_cudagraph

    from pressroom.kernels.triton import fused_moe_fp8 as kernel
    from pressroom.kernels.triton.fused_moe import fused_moe, load_sweep

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 7168, 2048


def _experts(experts: int, rows: int, cols: int, halves: int, seed: int) -> fp8_moe.Fp8Experts:
    """Random FP8 experts, quantized 16 at a time (the whole stack in fp32 would take 30 GB)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    parts = [fp8_moe.quantize(torch.randn(16, rows, cols, device="cuda", generator=gen) * 0.02, halves)
             for _ in range(experts // 16)]
    return fp8_moe.Fp8Experts(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), halves)


@pytest.fixture(scope="module")
def deepseek_v3_experts() -> tuple[fp8_moe.Fp8Experts, fp8_moe.Fp8Experts]:
    return _experts(EXPERTS, 2 * INTER, HIDDEN, 2, seed=0), _experts(EXPERTS, HIDDEN, INTER, 1, seed=1)


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    top = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1)
    return x, torch.softmax(top.values, dim=-1), top.indices


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same FP8 products; the tensor cores sum each 128-input tile with fewer bits than fp32, and the pairs'
    bf16 outputs may round apart: within 2^-7 of the largest output."""
    error = (got.float() - want.float()).abs().max()
    assert got.dtype == torch.bfloat16 and error <= 2 ** -7 * want.float().abs().max(), error


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_fp8_moe_at_deepseek_v3_shape(deepseek_v3_experts, tokens):
    w13, w2 = deepseek_v3_experts
    x, weights, ids = _inputs(tokens)
    _assert_near(kernel.fused_moe_fp8(x, w13, w2, weights, ids, all_local=True),
                 fp8_moe.reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("options", [{"quantize_activations": False}, {"swiglu_limit": 0.5}])
def test_fp8_moe_options_at_deepseek_v3_shape(deepseek_v3_experts, options):
    """Weight-only (bf16 activations against widened FP8 weights); DeepSeek-V4's clamp (gate and up spread about 1.7
    here: 0.5 clamps many)."""
    w13, w2 = deepseek_v3_experts
    x, weights, ids = _inputs(64)
    want = fp8_moe.reference(x, w13, w2, weights, ids, **options)
    _assert_near(kernel.fused_moe_fp8(x, w13, w2, weights, ids, **options), want)
    if "swiglu_limit" in options:
        assert not torch.allclose(want, fp8_moe.reference(x, w13, w2, weights, ids), rtol=2 ** -6)


def _graph_us(moe, *args) -> float:
    """Microseconds per call of moe(*args, all_local=True) replayed from a CUDA graph, compiled first."""
    moe(*args, all_local=True)
    return do_bench_cudagraph(lambda: moe(*args, all_local=True), rep=50) * 1e3


def test_fp8_moe_time_beside_bf16(deepseek_v3_experts):
    """Prints microseconds per call (CUDA graph replays) of fused_moe_fp8 (its sweep's launches where committed for
    this GPU, else the defaults) and of the bf16 kernel on the same experts dequantized; and the FP8 kernel's weight
    bytes per second at one token (8 experts' weights read)."""
    w13, w2 = deepseek_v3_experts
    w13_bf16, w2_bf16 = (torch.empty(w.shape, dtype=torch.bfloat16, device="cuda") for w in (w13, w2))
    for e in range(EXPERTS):
        w13_bf16[e], w2_bf16[e] = w13.dequantize(e), w2.dequantize(e)
    print(f"\n{torch.cuda.get_device_name()}: DeepSeek-V3 experts ({EXPERTS}, top-{TOP_K}, {HIDDEN} x {INTER})")
    for tokens in (1, 8, 64, 300, 1024):
        x, weights, ids = _inputs(tokens)
        fp8_us = _graph_us(kernel.fused_moe_fp8, x, w13, w2, weights, ids)
        bf16_us = _graph_us(fused_moe, x, w13_bf16, w2_bf16, weights, ids)
        line = f"tokens {tokens:>5}: fp8 {fp8_us:9.1f} us, bf16 {bf16_us:9.1f} us ({bf16_us / fp8_us:.2f}x)"
        if tokens == 1:
            read = TOP_K * 3 * HIDDEN * INTER  # FP8 bytes of gate, up and down for 8 experts
            line += f"; {read / fp8_us / 1e3:.0f} GB/s of FP8 weights"
        print(line, flush=True)
        assert fp8_us > 0


def test_sweep_writes_a_table_the_lookup_reads(tmp_path, monkeypatch):
    """Two candidate launches at a small shape, swept in two parts: the table keeps both parts' token counts, each
    naming one of the candidates in MoeLaunch's form."""
    candidates = [kernel.MoeLaunch(16, 64, 128, 4, 3), kernel.MoeLaunch(16, 128, 64, 4, 3)]
    monkeypatch.setattr(kernel, "sweep_candidates", lambda tokens, top_k, experts: candidates)
    path = tmp_path / "table.json"
    for part in ((1,), (64,)):
        kernel.sweep(16, 256, 512, 2, token_counts=part, path=path)
    table = load_sweep(path)
    assert set(table) == {1, 64} and all(launch in candidates for launch in table.values())
    assert json.loads(path.read_text())["shape"] == {"experts": 16, "inter": 256, "hidden": 512, "top_k": 2}
