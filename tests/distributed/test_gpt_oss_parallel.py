"""gpt-oss over two CPU ranks (gloo): each rank's heads' sinks, its slices of the fused experts and their biases
(down's bias added by one rank only), or whole experts under expert parallelism, give the greedy fp32 tokens of
one rank."""
from __future__ import annotations

import pytest
from conftest import random_prompts
from gpt_oss_checkpoint import save_tiny_gpt_oss

from pressroom import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)


def _generate(model: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_gib=0.05, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


# Each two-rank run spawns two worker processes (some 10 s on two cores): expert parallelism is left to test-slow.
@pytest.mark.parametrize("expert_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gpt_oss_over_two_ranks_gives_the_tokens_of_one(tmp_path, expert_parallel):
    save_tiny_gpt_oss(tmp_path)
    prompts = random_prompts(3, low=12, high=30, seed=8)  # past the 8-token window
    two = _generate(str(tmp_path), prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert two == _generate(str(tmp_path), prompts)
