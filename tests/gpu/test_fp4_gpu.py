"""FP4 experts on CUDA: the Triton fused MoE over MXFP4 / NVFP4 experts at real expert shapes (Mixtral-8x7B,
gpt-oss-20b, Qwen3-30B-A3B) against dequantize-then-MLP in fp32; tiny MoE models from FP4 checkpoints (gpt-oss's
MXFP4 form, ModelOpt's NVFP4) and quantized online, on CUDA (graphs and eager) against the CPU's reference path."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE
from fp4_checkpoint import write_mxfp4_checkpoint, write_nvfp4_checkpoint
from fp8_checkpoint import PROMPTS

from pressroom import LLM, SamplingParams
from pressroom.kernels import fp4_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

if torch.cuda.is_available():
    from pressroom.kernels.triton.fused_moe import fused_moe_fp4

# (experts, hidden, intermediate, top_k)
SHAPES = {"mixtral_8x7b": (8, 4096, 14336, 2), "gpt_oss_20b": (32, 2880, 2880, 4), "qwen3_30b_a3b": (128, 2048, 768, 8)}
LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)


def _experts(experts: int, hidden: int, inter: int, fmt: str) -> tuple[fp4_moe.Fp4Experts, fp4_moe.Fp4Experts]:
    gen = torch.Generator(device="cuda").manual_seed(experts + hidden)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02
    return fp4_moe.quantize(w13, fmt), fp4_moe.quantize(w2, fmt)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", fp4_moe.FORMATS)
def test_fp4_moe_at_real_expert_shapes(shape, fmt):
    experts, hidden, inter, top_k = SHAPES[shape]
    w13, w2 = _experts(experts, hidden, inter, fmt)
    for tokens in (1, 16, 300):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        top = torch.randn(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1)
        weights = torch.softmax(top.values, dim=-1)
        want = fp4_moe.reference(x.float(), w13, w2, weights, top.indices)  # fp32 all through
        got = fused_moe_fp4(x, w13, w2, weights, top.indices, all_local=True)
        # bf16 activations and a bf16 intermediate (the kernel rounds SiLU(gate) * up once): ~2^-8 relative
        error = (got.float() - want).abs().max()
        assert got.dtype == torch.bfloat16 and error <= 2 ** -6 * want.abs().max(), (tokens, error)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny Mixtral (4 experts, 128 intermediate features: whole MXFP4 and NVFP4 blocks), no tokenizer."""
    import transformers
    torch.manual_seed(1234)
    cfg = transformers.MixtralConfig(**TINY_SHAPE, num_experts_per_tok=2, num_local_experts=4, sliding_window=None)
    path = tmp_path_factory.mktemp("tiny-mixtral-fp4")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def _run(path, device: str, method: str, **kw) -> tuple[torch.Tensor, list[list[int]]]:
    llm = LLM(str(path), device=device, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.25,
              quantization=method, **kw)
    outs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    logprobs = torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return logprobs, tokens


def _checkpoint(tiny_moe, tmp_path, form: str):
    if form == "online_mxfp4":
        return tiny_moe, "mxfp4"
    if form == "online_nvfp4":
        return tiny_moe, "nvfp4"
    if form == "mxfp4_checkpoint":
        write_mxfp4_checkpoint(str(tiny_moe), tmp_path / "q", fused_experts=True, expert_names=("w1", "w3", "w2"))
    else:
        write_nvfp4_checkpoint(str(tiny_moe), tmp_path / "q")
    return tmp_path / "q", "auto"


@pytest.mark.parametrize("form", ["online_mxfp4", "online_nvfp4", "mxfp4_checkpoint", "nvfp4_checkpoint"])
def test_a_tiny_fp4_moe_on_cuda_matches_the_cpu_reference(tiny_moe, tmp_path, form):
    path, method = _checkpoint(tiny_moe, tmp_path, form)
    cuda, cuda_tokens = _run(path, "cuda", method)  # decode steps replay CUDA graphs
    eager, eager_tokens = _run(path, "cuda", method, enforce_eager=True)
    cpu, _ = _run(path, "cpu", method)
    assert cuda_tokens == eager_tokens
    # weight-only on both, fp32 activations (tl.dot in IEEE fp32): sums in another order only
    assert (cuda - cpu).abs().max() < 1e-3, (cuda - cpu).abs().max()
