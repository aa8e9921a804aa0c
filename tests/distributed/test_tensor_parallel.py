"""Tensor parallelism on the CPU: two worker processes in a gloo group give the greedy fp32 tokens of one
rank, on tiny random Llama and Qwen3 models and on the embedded SmolLM2 (9 query heads over 3 KV heads:
an uneven split, 2 KV heads on rank 0 and 1 on rank 1)."""
from __future__ import annotations

import re

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams
from pressroom.config import EngineArgs
from pressroom.model.layers.linear import head_split
from pressroom.sampling_params import StructuredOutputsParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)


def _generate(model: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    return _generate_and_count(model, prompts, **kw)[0]


def _generate_and_count(model: str, prompts: list[list[int]], **kw) -> tuple[list[list[int]], list[int]]:
    """The greedy tokens, and the parameters each rank holds."""
    llm = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        counts = llm.engine.core.executor.collective_rpc("parameter_count")
        return [list(o.outputs[0].token_ids) for o in outs], counts
    finally:
        llm.shutdown()


# Each run spawns two worker processes (some 10 s on two cores): CI runs a dense model here (and DeepSeek-V3's MoE
# with expert parallelism in test_deepseek_tensor_parallel.py), test-slow the rest (Qwen3, the embedded model's
# uneven split, Qwen3-MoE sliced and expert-parallel, Qwen2-MoE's shared expert over two ranks).
@pytest.mark.slow  # two worker processes, 11 s a case (the gpt-oss and MoE two-rank tests stay in the default suite)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_the_tokens_of_one(arch, tiny_model_dir):
    model = tiny_model_dir(arch)
    prompts = random_prompts(6, seed=3)
    two, counts = _generate_and_count(model, prompts, tensor_parallel_size=2)
    one, (whole,) = _generate_and_count(model, prompts)
    assert two == one
    # each rank holds about half: only the norms are replicated
    assert all(0.45 * whole < c < 0.55 * whole for c in counts) and sum(counts) >= whole, (counts, whole)


@pytest.mark.slow  # three engines of the embedded model, two of them over two ranks: 35 s on two cores
def test_the_embedded_model_splits_its_heads_unevenly(embedded_path):
    # quantization none: the dense fp32 weights. (The 4-bit kernels round activations to int8 per block, so
    # a sum split across ranks may round differently; that path is checked for running, not for equality.)
    prompts = random_prompts(4, seed=5)
    one = _generate(embedded_path, prompts, quantization="none")
    assert _generate(embedded_path, prompts, quantization="none", tensor_parallel_size=2) == one
    assert len(_generate(embedded_path, prompts[:1], tensor_parallel_size=2)[0]) == PARAMS.max_tokens


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (8, 2, 2, [(0, 4, 0, 1), (4, 4, 1, 1)]),  # even
    (9, 3, 2, [(0, 6, 0, 2), (6, 3, 2, 1)]),  # uneven: whole KV heads with their query groups
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),  # KV heads replicated
])
def test_head_split(heads, kv_heads, tp, expected):
    assert [head_split(heads, kv_heads, tp, r) for r in range(tp)] == expected


def test_head_splits_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="replicated evenly"):
        head_split(9, 3, 4, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs one process per rank"):
        EngineArgs(model="x", tensor_parallel_size=2, distributed_executor_backend="uni").create_engine_config()


@pytest.mark.parametrize("arch, expert_parallel", [
    pytest.param("qwen3_moe", False, marks=pytest.mark.slow), pytest.param("qwen3_moe", True, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", True, marks=pytest.mark.slow)])  # CI's MoE over two ranks: DeepSeek-V3's, with EP
def test_mixture_of_experts_over_two_ranks(arch, expert_parallel, tiny_model_dir):
    """Experts sliced (tensor parallel) or dealt out whole (expert parallel); Qwen2-MoE adds its gated shared
    expert and a dense layer."""
    model = tiny_model_dir(arch)
    prompts = random_prompts(4, seed=7)
    two, counts = _generate_and_count(model, prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    one, (whole,) = _generate_and_count(model, prompts)
    assert two == one
    assert all(c < 0.6 * whole for c in counts), (counts, whole)  # the experts, most of the weights, split


@pytest.mark.slow  # two worker processes and a grammar's first compile (11 s in CI)
def test_structured_outputs_over_two_ranks(tiny_model_dir):
    """Worker processes get each grammar as xgrammar's JSON (a compiled grammar does not pickle): the
    constrained greedy texts of two ranks are one rank's, and they keep to their constraints."""
    model = tiny_model_dir("llama")
    cases = [StructuredOutputsParams(regex=r"[a-z]{2,6} \d{3}"), StructuredOutputsParams(choice=["red", "green"]),
             StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"]}, disable_any_whitespace=True)]

    def texts(**kw) -> list[str]:
        llm = LLM(model, dtype="float32", device="cpu", **kw)
        try:
            params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=so) for so in cases]
            return [o.outputs[0].text for o in llm.generate(["The answer is"] * len(cases), params, use_tqdm=False)]
        finally:
            llm.shutdown()

    two = texts(tensor_parallel_size=2)
    assert two == texts()
    assert re.fullmatch(r"[a-z]{2,6} \d{3}", two[0]) and two[1] in ("red", "green")
