"""Tensor parallelism on the CPU: two worker processes in a gloo group give the greedy fp32 tokens of one
rank, on tiny random Llama and Qwen3 models and on the embedded SmolLM2 (9 query heads over 3 KV heads:
an uneven split, 2 KV heads on rank 0 and 1 on rank 1)."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams
from pressroom.config import EngineArgs
from pressroom.model.layers.linear import head_split

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)


def _generate(model: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_the_tokens_of_one(arch, tiny_model_dir):
    model = tiny_model_dir(arch)
    prompts = random_prompts(6, seed=3)
    assert _generate(model, prompts, tensor_parallel_size=2) == _generate(model, prompts)


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
