"""The weight-only FP8 and MXFP4 Triton GEMV/GEMM and the per-token FP8 quantization kernel on CUDA at
Llama-3.1-8B's shapes against dequantize-then-matmul; the FP8 layer's choice of path by step size; a tiny MXFP4
model's prompt logprobs on the GPU against the CPU's reference path."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE
from fp8_checkpoint import PROMPTS

from pressroom import LLM, SamplingParams
from pressroom.kernels import fp8, mxfp4, nvfp4

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

if torch.cuda.is_available():
    from pressroom.kernels.triton import quant_gemv

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (out, in)
LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)


def _operands(tokens: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(out_features + in_features + tokens)
    x = torch.randn(tokens, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    return x, torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02


def _check_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums of exact products, rounded once to bf16 (2^-9 relative) at the end
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("out_features, in_features", LLAMA_8B)
@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("group", ["row", 128])
def test_fp8_weight_only_gemv_at_llama_8b_shapes(out_features, in_features, tokens, group):
    x, w = _operands(tokens, out_features, in_features)
    group = in_features if group == "row" else group
    w_q, w_scale = fp8.quantize(w, group)
    want = x.float() @ fp8.dequantize(w_q, w_scale, group).t()
    _check_bf16(quant_gemv.fp8_linear(x, w_q, w_scale, group), want)


@pytest.mark.parametrize("out_features, in_features", LLAMA_8B)
@pytest.mark.parametrize("tokens", [1, 5, 16, 300])
def test_mxfp4_weight_only_gemm_at_llama_8b_shapes(out_features, in_features, tokens):
    x, w = _operands(tokens, out_features, in_features)
    packed, scales = mxfp4.quantize(w)
    want = x.float() @ mxfp4.dequantize(packed, scales).t()
    _check_bf16(quant_gemv.mxfp4_linear(x, packed, scales), want)


@pytest.mark.parametrize("out_features, in_features", LLAMA_8B)
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_nvfp4_weight_only_gemm_at_llama_8b_shapes(out_features, in_features, tokens):
    x, w = _operands(tokens, out_features, in_features)
    weight = nvfp4.quantize(w)
    want = x.float() @ nvfp4.dequantize(*weight).t()
    _check_bf16(quant_gemv.nvfp4_linear(x, *weight), want)


@pytest.mark.parametrize("tokens, in_features", [(1, 4096), (16, 4096), (512, 14336)])
def test_per_token_fp8_kernel_equals_the_torch_quantizer(tokens, in_features):
    x, _ = _operands(tokens, 16, in_features)
    q, scale = quant_gemv.quantize_per_token_fp8(x)
    want_q, want_scale = fp8.quantize(x, in_features)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())


def test_an_fp8_layer_takes_the_gemv_for_small_steps_and_scaled_mm_beyond():
    from pressroom.model.layers.linear import ColumnParallelLinear
    from pressroom.model.quantization.fp8 import Fp8LinearMethod
    with torch.device("cuda"):
        layer = ColumnParallelLinear(4096, 1024, bias=True).to(torch.bfloat16)
        layer.set_quant_method(Fp8LinearMethod(serialized=False))
        layer.weight_loader(layer.weight, torch.randn(1024, 4096) * 0.02)
        layer.bias.data.normal_()
        layer.quant_method.process_weights_after_loading(layer)
        small, large = torch.randn(3, 5, 4096, dtype=torch.bfloat16), torch.randn(4, 16, 4096, dtype=torch.bfloat16)
    args = layer.weight, layer.weight_scale
    gemv = quant_gemv.fp8_linear(small.view(15, 4096), *args, 4096, layer.bias)
    assert torch.equal(layer(small), gemv.view(3, 5, -1))
    assert torch.equal(layer(large), fp8.scaled_mm(large.view(64, 4096), *args, layer.bias).view(4, 16, -1))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_SHAPE), dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-llama-mxfp4")
    model.save_pretrained(path)
    return path


def _run(path, device: str, method: str, **kw) -> tuple[torch.Tensor, list[list[int]]]:
    llm = LLM(str(path), device=device, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.25,
              quantization=method, **kw)
    outs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    logprobs = torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return logprobs, tokens


@pytest.mark.parametrize("method", ["mxfp4", "nvfp4"])
def test_a_tiny_fp4_model_on_cuda_matches_the_cpu_reference(tiny_llama, method):
    cuda, cuda_tokens = _run(tiny_llama, "cuda", method)  # decode steps replay CUDA graphs
    eager, eager_tokens = _run(tiny_llama, "cuda", method, enforce_eager=True)
    cpu, _ = _run(tiny_llama, "cpu", method)
    assert cuda_tokens == eager_tokens
    # weight-only on both, fp32 activations (the kernel's tl.dot in IEEE fp32): sums in another order only
    assert (cuda - cpu).abs().max() < 1e-3, (cuda - cpu).abs().max()
