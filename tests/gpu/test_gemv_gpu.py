"""The fused decode GEMVs (kernels/triton/gemv.py) on CUDA: each kernel at Llama-3.1-8B's shapes at one token
(the one-token kernel) and 2, 5 and 8 (the rows kernel, at its default launches; rows scaled apart so each must be
normalised by its own statistics) against the unfused path (the RMSNorm kernel or SwiGLU, then an fp32 product of
the rounded operands), every launch the benchmark sweeps at one token correct at each projection's shape (the
benchmark checks the rows kernel's before timing them); and a tiny Llama / Qwen2 engine with CUDA graphs decoding
one prompt at a time (every decode step one token) with the fused path on and off (model/models/llama.py's
SMALL_STEP_GEMV): the fused path shown to run at steps of at most GEMV_MAX_TOKENS only and not when switched off,
the greedy tokens the same up to a near tie, the logprobs close on the same context; and the same engine decoding
six prompts together with GEMV_MAX_TOKENS raised to MAX_ROWS, so its decode graphs of 2 to 8 take the rows kernel;
and an FP8 engine (--quantization fp8, one scale a row) with the fused path on and off.

How close: the LM head's logits are rounded to the activation dtype, and this random model's (initializer range
0.2) top logits lie near 16-32, where a bf16 logit is rounded to 0.125 and an fp16 one to 0.0156; two summation
orders flip such roundings. Measured on the CPU with HF's model (6 prompts, 48 steps, every projection summed in
reversed order against as it is): the greedy tokens agreed but for one divergence at a 0.125 margin (bf16), and
the logprobs differed by at most 0.12 (bf16) and 0.015 (fp16), from the first step on, not growing with the steps.
So fp16, where the paths agree closely, is checked at every step to about three of its logit steps; bf16 over the
first steps to about two and a half of its own."""
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


TOKENS = [1, 2, 5, 8]  # the one-token kernel, then the rows kernel at 2 and 8 rows (5: three masked)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def _rows(tokens: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[tokens, width], row i scaled by (i + 1) * scale: a row normalised by another's statistics is far off."""
    return _randn(tokens, width, seed=seed, scale=scale) * torch.arange(1, tokens + 1, device="cuda")[:, None]


def _linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(a.float(), w.float())  # exact products of the rounded operands, summed in fp32


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums in another order, rounded once to bf16 (2^-9 relative) at the end; each row against its own scale
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want).abs().amax(1) <= 2 ** -7 * want.abs().amax(1)).all()


@pytest.mark.parametrize("shape", [QKV, GATE_UP], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens", TOKENS)
def test_norm_gemv_at_llama_8b_shapes(shape, with_residual, tokens):
    n, k = shape
    x, w = _rows(tokens, k, seed=1), _randn(n, k, seed=n, scale=0.02)
    residual = _rows(tokens, k, seed=7, scale=4.0) if with_residual else None
    norm_weight = _randn(k, seed=9, scale=0.1) + 1
    if residual is None:
        want_stream, normed = x, norm.rms_norm(x, norm_weight, EPS)
    else:  # the unfused layer's kernel, in place on copies
        normed, want_stream = norm.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, EPS)
    got, stream = gemv.norm_gemv(x, norm_weight, EPS, w, residual)
    _check(got, _linear(normed, w))
    assert torch.equal(stream, want_stream)


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_silu_mul_gemv_at_the_down_projection(tokens):
    from pressroom.kernels.triton.activation import silu_and_mul
    gate_up, w = _randn(tokens, 2 * INTERMEDIATE, seed=1), _randn(*DOWN, seed=3, scale=0.02)
    _check(gemv.silu_mul_gemv(gate_up, w), _linear(silu_and_mul(gate_up), w))


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gemv_at_the_o_projection(tokens):
    x, w = _rows(tokens, HIDDEN, seed=1), _randn(*O, seed=5, scale=0.02)
    _check(gemv.gemv(x, w), _linear(x, w))


@pytest.mark.parametrize("shape", [QKV, O, GATE_UP, DOWN], ids=["qkv", "o", "gate_up", "down"])
def test_every_launch_the_benchmark_sweeps_is_correct(shape):
    n, k = shape
    x, w = _randn(1, k, seed=13), _randn(n, k, seed=14, scale=0.02)
    want = _linear(x, w)
    for launch in gemv.sweep_launches():
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


STEPS = 48
LOGPROB_TOL = {"float16": 0.05, "bfloat16": 0.3}  # |fused - unfused| on the same context (the module docstring)
BF16_CLOSE_STEPS = 16  # bf16 logprobs compared over this many first steps; fp16's over every agreed step
TIE = {"float16": 0.1, "bfloat16": 0.3}  # a divergence only where the fused path's top two were this close


def _decode(path: str, prompts: list[list[int]], dtype: str, together: bool = False,
            quantization: str | None = None) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens and each step's top-2 logprobs (CUDA graphs), one prompt at a time (every decode step is one
    token, so each replays the one-token graph) or `together` (decode steps of all the prompts at once)."""
    llm = LLM(path, device="cuda", dtype=dtype, skip_tokenizer_init=True, kv_cache_memory_gib=0.25, max_num_seqs=8,
              **({"quantization": quantization} if quantization else {}))
    graphs = llm.engine.runner.graphs
    assert graphs is not None and max(graphs.shapes[1]) > 1  # larger decode graphs too, which must not fuse
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, detokenize=False, logprobs=2)
    if together:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    else:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    llm.shutdown()
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
            for c in (o.outputs[0] for o in outs)]


def _count_norm_gemv(monkeypatch) -> list[int]:
    """The rows of every fused norm_gemv call from now on (the layer looks it up in the module at each call)."""
    calls, fused = [], gemv.norm_gemv

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(gemv, "norm_gemv", counted)
    return calls


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_decodes_the_same_with_the_fused_path_on_and_off(name, dtype, model_dir, monkeypatch):
    from pressroom.model.models import llama
    path, prompts = model_dir(name), random_prompts(6, low=4, high=120, seed=19)
    calls = _count_norm_gemv(monkeypatch)
    on = _decode(path, prompts, dtype)
    # graphs of 1 to 8 decodes are captured at start and prompts prefill eagerly: only steps of at most
    # GEMV_MAX_TOKENS take it
    assert calls and max(calls) <= gemv.GEMV_MAX_TOKENS
    monkeypatch.setattr(llama, "SMALL_STEP_GEMV", False)
    taken = len(calls)
    off = _decode(path, prompts, dtype)
    assert len(calls) == taken  # the switch turns it off
    _compare(on, off, dtype)


def test_an_fp8_engine_decodes_the_same_with_the_fused_path_on_and_off(model_dir, monkeypatch):
    """--quantization fp8 (online, one scale a row): its one-token decode steps take the fused GEMVs over the FP8
    weights, and decode as the modules' weight-only FP8 products do (the same checks as bf16)."""
    from pressroom.model.models import llama
    path, prompts = model_dir("qwen2-d128"), random_prompts(4, low=4, high=120, seed=29)
    calls = _count_norm_gemv(monkeypatch)
    on = _decode(path, prompts, "bfloat16", quantization="fp8")
    assert calls and max(calls) <= gemv.GEMV_MAX_TOKENS
    monkeypatch.setattr(llama, "SMALL_STEP_GEMV", False)
    off = _decode(path, prompts, "bfloat16", quantization="fp8")
    _compare(on, off, "bfloat16")


def test_engine_decodes_a_batch_the_same_through_the_rows_kernel(model_dir, monkeypatch):
    """GEMV_MAX_TOKENS raised to MAX_ROWS (as it will be once the sweep shows the rows kernel winning): six prompts
    decoded together, their decode steps replaying graphs that take the rows kernel, against the modules' path;
    the same checks as one prompt at a time (fp16: every step)."""
    from pressroom.model.models import llama
    path, prompts = model_dir("llama-d128"), random_prompts(6, low=4, high=120, seed=23)
    calls = _count_norm_gemv(monkeypatch)
    monkeypatch.setattr(gemv, "GEMV_MAX_TOKENS", gemv.MAX_ROWS)
    on = _decode(path, prompts, "float16", together=True)
    assert calls and max(calls) == gemv.MAX_ROWS and len(set(calls)) > 2  # graphs of 1 to 8 decodes take it
    monkeypatch.setattr(llama, "SMALL_STEP_GEMV", False)
    off = _decode(path, prompts, "float16", together=True)
    _compare(on, off, "float16")


def _compare(on: list, off: list, dtype: str) -> None:
    """The fused and unfused runs' tokens and logprobs: the same logprobs on the same context but for rounding,
    and a divergence only at a near tie."""
    close_steps = STEPS if dtype == "float16" else BF16_CLOSE_STEPS
    for (tokens_on, lp_on), (tokens_off, lp_off) in zip(on, off):
        agree = next((i for i, (a, b) in enumerate(zip(tokens_on, tokens_off)) if a != b), len(tokens_on))
        # on the same context both paths give the same logprobs but for rounding (GEMMs summed in other orders)
        for i in range(min(agree, close_steps)):
            token = tokens_on[i]
            assert abs(lp_on[i][token] - lp_off[i][token]) < LOGPROB_TOL[dtype], (i, lp_on[i], lp_off[i])
        if agree < len(tokens_on):  # a divergence only where the fused path saw a near tie between the two tokens
            a, b = tokens_on[agree], tokens_off[agree]
            assert b in lp_on[agree] and lp_on[agree][a] - lp_on[agree][b] < TIE[dtype], (agree, lp_on[agree], a, b)
