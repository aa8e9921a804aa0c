"""The int4 (GPTQ-form) Triton weight-only kernel on CUDA at Llama-3.1-8B's shapes, group 128, with and without
act-order, against dequantize-then-matmul; and a tiny act-order GPTQ and an AWQ checkpoint on the GPU against their
fp32 twins."""
from __future__ import annotations

import pytest
import torch
from fp8_checkpoint import prompt_logprobs
from int4_checkpoint import write_int4_checkpoint, write_twin

from pressroom import LLM
from pressroom.kernels import int4

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

if torch.cuda.is_available():
    from pressroom.kernels.triton import quant_gemv

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (out, in)
GROUP = 128


def _weight(out_features: int, in_features: int, act_order: bool) -> int4.Int4Weight:
    gen = torch.Generator(device="cuda").manual_seed(out_features + in_features)
    groups = in_features // GROUP
    q = torch.randint(0, 16, (in_features, out_features), device="cuda", generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 17, (groups, out_features), device="cuda", generator=gen).to(torch.uint8)
    scales = (torch.rand(groups, out_features, device="cuda", generator=gen) * 0.004 + 0.001).half()
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(in_features, device="cuda", generator=gen) // GROUP).to(torch.int32)
    return int4.Int4Weight(int4.pack_inputs(q), scales, zeros, g_idx, GROUP)


@pytest.mark.parametrize("out_features, in_features", LLAMA_8B)
@pytest.mark.parametrize("tokens", [1, 5, 16, 300])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_weight_only_gemm_at_llama_8b_shapes(out_features, in_features, tokens, act_order):
    w = _weight(out_features, in_features, act_order)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    want = x.float() @ w.dequantize().t()
    got = quant_gemv.int4_linear(x, w.qweight, w.scales, w.zeros, w.g_idx, GROUP)
    # fp32 sums; the tensor-core tiles and cuBLAS see the weight rounded to bf16 (2^-9 relative)
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("fmt, act_order", [("gptq", True), ("awq", False)])
def test_int4_checkpoint_on_the_gpu_matches_its_fp32_twin(tiny_model_dir, tmp_path, fmt, act_order):
    model = tiny_model_dir("llama")
    dequantized = write_int4_checkpoint(model, tmp_path / fmt, fmt, 32, act_order)
    write_twin(model, tmp_path / "twin", dequantized)
    kw = dict(device="cuda", dtype="float32", kv_cache_memory_gib=0.05, enforce_eager=True)
    got = prompt_logprobs(LLM(str(tmp_path / fmt), **kw))
    twin = prompt_logprobs(LLM(str(tmp_path / "twin"), **kw))
    assert (got - twin).abs().max() < 1e-3, (got - twin).abs().max()  # cuBLAS may sum fp32 in TF32 elsewhere
