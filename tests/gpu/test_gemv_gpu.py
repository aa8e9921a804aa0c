"""The fused decode GEMVs (kernels/triton/gemv.py) on CUDA: each kernel at Llama-3.1-8B's shapes and 1 to 8 tokens
against the unfused path (the RMSNorm kernel or SwiGLU, then an fp32 product of the rounded operands), split-K's
sums the same bits on every run, the swept launch configurations all correct; and a tiny Llama / Qwen2 engine in
bf16 with CUDA graphs decoding the same greedy tokens, with the same logprobs, with the fused path on and off
(model/models/llama.py's SMALL_STEP_GEMV), the fused path shown to have run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SHAPE, random_prompts

from pressroom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

if torch.cuda.is_available():
    from pressroom.kernels.triton import gemv, norm

HIDDEN, INTERMEDIATE, EPS = 4096, 14336, 1e-5
QKV, O, GATE_UP, DOWN = (6144, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)
TOKENS = [1, 2, 3, 4, 8]


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def _linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(a.float(), w.float())  # exact products of the rounded operands, summed in fp32


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums in another order, rounded once to bf16 (2^-9 relative) at the end
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("shape", [QKV, GATE_UP], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_gemv_at_llama_8b_shapes(shape, tokens, with_residual):
    n, k = shape
    x, w = _randn(tokens, k, seed=tokens), _randn(n, k, seed=n, scale=0.02)
    residual = _randn(tokens, k, seed=7, scale=4.0) if with_residual else None
    norm_weight = _randn(k, seed=9, scale=0.1) + 1
    if residual is None:
        want_stream, normed = x, norm.rms_norm(x, norm_weight, EPS)
    else:  # the unfused layer's kernel, in place on copies
        normed, want_stream = norm.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, EPS)
    got, stream = gemv.norm_gemv(x, norm_weight, EPS, w, residual)
    _check(got, _linear(normed, w))
    assert torch.equal(stream, want_stream)


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul_gemv_at_the_down_projection(tokens):
    from pressroom.kernels.triton.activation import silu_and_mul
    gate_up, w = _randn(tokens, 2 * INTERMEDIATE, seed=tokens), _randn(*DOWN, seed=3, scale=0.02)
    _check(gemv.silu_mul_gemv(gate_up, w), _linear(silu_and_mul(gate_up), w))


@pytest.mark.parametrize("tokens", TOKENS)
def test_gemv_at_the_o_projection(tokens):
    x, w = _randn(tokens, HIDDEN, seed=tokens), _randn(*O, seed=5, scale=0.02)
    _check(gemv.gemv(x, w), _linear(x, w))


@pytest.mark.parametrize("tokens", [1, 8])
def test_split_k_sums_the_same_bits_every_run(tokens):
    x, w = _randn(tokens, INTERMEDIATE, seed=11), _randn(*DOWN, seed=12, scale=0.02)
    launch = gemv.GemvLaunch(block_n=8 if tokens == 1 else 32, block_k=512, split_k=4)
    first = gemv.gemv(x, w, launch=launch)
    _check(first, _linear(x, w))
    assert all(torch.equal(gemv.gemv(x, w, launch=launch), first) for _ in range(5))


def test_every_launch_the_benchmark_sweeps_is_correct():
    x8, w = _randn(8, HIDDEN, seed=13), _randn(*O, seed=14, scale=0.02)
    for tokens in (1, 8):
        x = x8[:tokens]
        want = _linear(x, w)
        for launch in gemv.sweep_launches(tokens, *O):
            _check(gemv.gemv(x, w, launch=launch), want)


D128 = dict(TINY_SHAPE, hidden_size=512, intermediate_size=1024, num_key_value_heads=1)  # the 8B's head_dim, GQA 4
SHAPES = {"llama-d128": ("llama", D128), "qwen2-d128": ("qwen2", D128)}  # Qwen2: qkv bias


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers
    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            family, shape = SHAPES[name]
            cls = transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig
            torch.manual_seed(4321)
            model = transformers.AutoModelForCausalLM.from_config(cls(**shape), dtype=torch.float32)
            made[name] = str(tmp_path_factory.mktemp(name))
            model.save_pretrained(made[name])
        return made[name]

    return make


def _decode(path: str, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens and each step's top-2 logprobs (bf16, CUDA graphs). The batch shrinks from 12 sequences to 1
    as they finish, so decode steps of 1 to 8 tokens replay graphs that take the fused path and larger ones not."""
    llm = LLM(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_gib=0.25,
              max_num_seqs=64)
    assert llm.engine.runner.graphs is not None
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True, detokenize=False, logprobs=2)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
            for c in (o.outputs[0] for o in outs)]


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_decodes_the_same_with_the_fused_path_on_and_off(name, model_dir, monkeypatch):
    from pressroom.model.models import llama
    path, prompts = model_dir(name), random_prompts(12, low=4, high=120, seed=19)
    calls = []
    fused = gemv.norm_gemv

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(gemv, "norm_gemv", counted)
    on = _decode(path, prompts)
    assert {1, 2, 4, 8} <= set(calls) and max(calls) <= gemv.GEMV_MAX_TOKENS  # each graph of <= 8 decodes has it
    monkeypatch.setattr(llama, "SMALL_STEP_GEMV", False)
    taken = len(calls)
    off = _decode(path, prompts)
    assert len(calls) == taken  # the switch turns it off
    diverged = 0
    for (tokens_on, lp_on), (tokens_off, lp_off) in zip(on, off):
        agree = next((i for i, (a, b) in enumerate(zip(tokens_on, tokens_off)) if a != b), len(tokens_on))
        # on the same context both paths give the same logprobs but for bf16 rounding (GEMMs summed in other orders)
        for i in range(agree):
            token = tokens_on[i]
            assert abs(lp_on[i][token] - lp_off[i][token]) < 0.05, (i, lp_on[i], lp_off[i])
        if agree < len(tokens_on):  # a divergence only where the fused path saw a near tie between the two tokens
            diverged += 1
            a, b = tokens_on[agree], tokens_off[agree]
            assert b in lp_on[agree] and lp_on[agree][a] - lp_on[agree][b] < 0.05, (agree, lp_on[agree], a, b)
    assert diverged <= len(prompts) // 2
