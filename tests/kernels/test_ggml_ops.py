"""GGML-quantized matmuls (kernels/csrc/ggml_ops.c) on random GGUF blocks: the layouts dequantize to gguf's own
values bit for bit, the C kernels equal their torch reference (kernels/ggml.py), and both stay within activation
rounding of dequantize-then-matmul. CI's AVX2 pass runs this file on the AVX2 build; here the other tiers' builds
run it in a subprocess too."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from pressroom.kernels import cpu, ggml
from pressroom.model import gguf_quants
from pressroom.model.layers.quant import GgmlStack, KWeight, Q5Weight, Q6KWeight, Q8Weight, pack_ggml
from pressroom.platforms.cpu import CpuIsa, cpu_info

T = gguf.GGMLQuantizationType
needs_c = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch reference serves")
FORMS = {
    T.Q8_0: lambda raw: Q8Weight(*gguf_quants.unpack_q8_0(raw)),
    T.Q5_0: lambda raw: Q5Weight(*gguf_quants.unpack_q5_0(raw)),
    T.Q4_K: lambda raw: KWeight(*gguf_quants.unpack_k4(raw, five=False)),
    T.Q5_K: lambda raw: KWeight(*gguf_quants.unpack_k4(raw, five=True)),
    T.Q6_K: lambda raw: Q6KWeight(*gguf_quants.unpack_q6_k(raw)),
}
# byte offsets of each block's fp16 scales (set to sane values; every other byte is random)
F16_AT = {T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_rows(ggml_type: T, rows: int, cols: int, seed: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if ggml_type == T.Q8_0:  # GGML's Q8_0 never holds -128
        raw[..., 2:] = np.where(raw[..., 2:] == 128, 129, raw[..., 2:])
    for at in F16_AT[ggml_type]:
        scale = rng.uniform(1e-3, 2e-2, (rows, cols // block)).astype(np.float16)
        raw[..., at:at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    return bool(((y - ref).abs() <= rel * ref.abs().max()).all())


@pytest.mark.parametrize("ggml_type", list(FORMS))
def test_layouts_dequantize_to_gguf_values(ggml_type):
    raw = random_rows(ggml_type, 6, 512, 1)
    weight = FORMS[ggml_type](raw)
    assert weight.shape == (6, 512)
    assert torch.equal(weight.dequantize(), gguf_quants.dequantize(raw, ggml_type))
    half = weight.narrow(1, 256, 256).dequantize()  # narrowing at a block boundary keeps the values
    assert torch.equal(half, gguf_quants.dequantize(raw, ggml_type)[:, 256:])


def _activations(tokens: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=gen)
    x[0, :256] = 0.0  # a zero block: scale 0, no division by zero
    if tokens > 1:
        x[1, 3] = -40.0  # a block whose largest magnitude is negative (Q8_K's sign convention)
        x[1, 300:332] = torch.arange(32) / 2  # values on rounding ties
    return x


@pytest.mark.parametrize("ggml_type", list(FORMS))
@pytest.mark.parametrize("tokens", [1, 3, 20])
@pytest.mark.parametrize("rows", [1, 37, 64])  # 37: not a multiple of the four-row tile
def test_reference_is_within_activation_rounding_of_dense(ggml_type, tokens, rows):
    raw = random_rows(ggml_type, rows, 512, rows + tokens)
    weight = FORMS[ggml_type](raw)
    x = _activations(tokens, 512, tokens)
    w = gguf_quants.dequantize(raw, ggml_type)
    dense = x @ w.t()
    ref = weight._reference(x, weight._arrays())
    # each activation moves by at most half a step of its block's grid (amax / 254), plus fp16's rounding of Q8_0's
    # scale: under amax / 200 in all
    block = 32 if ggml_type in (T.Q8_0, T.Q5_0) else 256
    step = x.abs().reshape(tokens, -1, block).amax(-1).repeat_interleave(block, dim=1) / 200
    assert ((ref - dense).abs() <= step @ w.abs().t() + 1e-5).all()
    # and not the dense product itself: the activations really are rounded (llama.cpp's arithmetic)
    assert not torch.allclose(ref, dense, rtol=1e-6, atol=1e-6)


@needs_c
@pytest.mark.parametrize("ggml_type", list(FORMS))
@pytest.mark.parametrize("tokens", [1, 3, 20])
@pytest.mark.parametrize("rows", [1, 37, 64])
def test_c_kernel_equals_reference(ggml_type, tokens, rows):
    raw = random_rows(ggml_type, rows, 768, 7 * rows + tokens)
    weight = FORMS[ggml_type](raw)
    x = _activations(tokens, 768, tokens + 1)
    c = weight.matmul(x)
    ref = weight._reference(x, weight._arrays())
    assert c.shape == (tokens, rows)
    assert _close(c, ref, 1e-5)


@needs_c
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_0, T.Q4_K])
def test_products_shared_between_threads_are_the_same_every_time(ggml_type):
    """Large enough for the helper threads (csrc/workshare.c) to take chunks of rows: every row written exactly
    once, the same bits as the reference's C twin on one thread, time after time (a lost or twice-run chunk, or
    a helper running an older job's chunk, would show)."""
    raw = random_rows(ggml_type, 1000, 768, 11)
    weight = FORMS[ggml_type](raw)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = _activations(1, 768, 5)
        alone, alone3 = weight.matmul(x), weight.matmul(_activations(3, 768, 6))
        torch.set_num_threads(max(2, threads))
        for _ in range(50):
            assert torch.equal(weight.matmul(x), alone)
            assert torch.equal(weight.matmul(_activations(3, 768, 6)), alone3)
    finally:
        torch.set_num_threads(threads)


@needs_c
@pytest.mark.parametrize("ggml_type", list(FORMS))
def test_one_token_equals_its_row_in_a_batch(ggml_type):
    """Single-token fast paths (Q5_0 straight from its blocks) compute the batch path's integers in its order."""
    weight = FORMS[ggml_type](random_rows(ggml_type, 64, 768, 3))
    x = _activations(3, 768, 4)
    assert torch.equal(weight.matmul(x[1:2])[0], weight.matmul(x)[1])


@needs_c
@pytest.mark.parametrize("block", [32, 256])
def test_c_activation_rounding_equals_reference(block):
    x = _activations(4, 1024, 3) * 7
    x[2] = torch.randn(1024) * 1e-6  # tiny values: fp16's subnormal scales
    q, d, sums = cpu.ggml_quantize(x, block)
    rq, rd, rsums = (ggml.quantize_q8_0 if block == 32 else ggml.quantize_q8_k)(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(sums, rsums)
    if block == 32:  # llama.cpp keeps Q8_0 activation scales in fp16
        assert torch.equal(d, d.half().float())


def test_stacked_parts_of_two_types_multiply_as_one_matrix():
    q = FORMS[T.Q5_0](random_rows(T.Q5_0, 8, 256, 1))
    k = FORMS[T.Q5_0](random_rows(T.Q5_0, 4, 256, 2))
    v = FORMS[T.Q8_0](random_rows(T.Q8_0, 4, 256, 3))
    stacked = pack_ggml([(12, v), (0, q), (8, k)], 16)
    assert isinstance(stacked, GgmlStack) and [type(p) for p in stacked.parts] == [Q5Weight, Q8Weight]
    x = torch.randn(2, 256)
    assert torch.equal(stacked.matmul(x), torch.cat([q.matmul(x), k.matmul(x), v.matmul(x)], dim=1))
    assert pack_ggml([(0, q), (12, v)], 16) is None  # a gap: rows 8-11 came otherwise


@needs_c
@pytest.mark.skipif(cpu_info().detected < CpuIsa.AVX2 or bool(os.environ.get("PRESSROOM_CPU_ISA")),
                    reason="the other tiers: on an AVX2 CPU, from the top-level run only")
# CI's AVX2 pass builds and runs the AVX2 tier itself: its build here runs with test-slow
@pytest.mark.parametrize("tier", [pytest.param("avx2", marks=pytest.mark.slow), "generic"])
def test_other_tiers_builds(tier):
    """The AVX2 build (CI's second pass) and the plain-C one, whatever this CPU's tier."""
    env = {**os.environ, "PRESSROOM_CPU_ISA": tier}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
            "-k", "c_kernel_equals_reference and (1- or 20-) or activation_rounding"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
