"""`--batch-invariant` end to end on the CPU backend: each request's tokens, logprobs and prompt logprobs are
the same bits alone (its prompt in one step) and inside random batches of mixed sizes and lengths whose
prompts the scheduler chunks at small token budgets; the default mode is shown to differ, and what the mode
does not cover is refused by name."""
from __future__ import annotations

import argparse
import random

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams
from pressroom.config import EngineArgs
from pressroom.entrypoints.cli import add_engine_args, engine_kwargs

N = 10


def _params(i: int) -> SamplingParams:
    """Greedy and seeded sampling, with logprobs of the sampled tokens, and of the prompt's for half."""
    prompt_logprobs = 1 if i % 2 == 0 else None
    if i % 3 == 2:
        return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=5, ignore_eos=True, logprobs=3,
                              prompt_logprobs=prompt_logprobs)
    return SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=prompt_logprobs)


def _record(output) -> tuple:
    """Everything a request reports, logprobs as exact floats."""
    def positions(logprobs):
        return [None if p is None else sorted((t, lp.logprob) for t, lp in p.items()) for p in logprobs or []]
    completion = output.outputs[0]
    return tuple(completion.token_ids), positions(completion.logprobs), positions(output.prompt_logprobs)


def _run(llm: LLM, prompts: list[list[int]], ids: list[int]) -> dict[int, tuple]:
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in ids], [_params(i) for i in ids],
                           use_tqdm=False)
    return {i: _record(o) for i, o in zip(ids, outputs)}


def _random_batches(rng: random.Random) -> list[list[int]]:
    ids = list(range(N))
    rng.shuffle(ids)
    batches = []
    while ids:
        size = rng.choice([2, 3, 5, 7])
        batches.append(ids[:size])
        ids = ids[size:]
    return batches


def _llm(model: str, invariant: bool, budget: int) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False,
               max_num_batched_tokens=budget, long_prefill_token_threshold=budget, batch_invariant=invariant)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(N, low=3, high=50, seed=11)


@pytest.fixture(scope="module")
def alone(tiny_model_dir, prompts):
    llm = _llm(tiny_model_dir("llama"), True, budget=512)
    return {i: _run(llm, prompts, [i])[i] for i in range(N)}


@pytest.mark.parametrize("budget", [16, 29])
def test_each_request_is_the_same_alone_and_in_chunked_random_batches(tiny_model_dir, prompts, alone, budget):
    llm = _llm(tiny_model_dir("llama"), True, budget)
    rng = random.Random(budget)
    batched = {}
    for batch in _random_batches(rng):
        batched |= _run(llm, prompts, batch)
    assert batched == alone
    if budget == 16:
        assert _run(llm, prompts, list(range(N))) == alone  # all at once


def test_the_default_mode_differs_somewhere(tiny_model_dir, prompts, alone):
    """The check above can fail: by default a prompt's attention in chunks (SDPA) and in one step round
    differently, and it shows in the logprobs."""
    llm = _llm(tiny_model_dir("llama"), False, budget=16)
    assert _run(llm, prompts, list(range(N))) != alone


def test_the_cli_flag_reaches_the_model_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--model", "m", "--device", "cpu", "--batch-invariant"]))
    assert EngineArgs(**kwargs).create_engine_config().model.batch_invariant


def test_vllm_env_var_turns_the_mode_on(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineArgs(model="m", device="cpu").create_engine_config().model.batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineArgs(model="m", device="cpu").create_engine_config().model.batch_invariant


@pytest.mark.parametrize("kwargs, words", [
    ({"quantization": "fp8"}, "dense weights only"),
    ({"runner": "pooling"}, "generation only"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, "tensor-parallel-size 1"),
])
def test_config_refuses_what_the_mode_does_not_cover(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineArgs(model="m", device="cpu", batch_invariant=True, **kwargs).create_engine_config()


@pytest.mark.parametrize("arch, words", [("qwen3_moe", "mixture-of-experts|router"),
                                         ("deepseek_v2", "MLA|Attention")])
def test_a_model_the_mode_does_not_cover_is_refused_by_name(tiny_model_dir, arch, words):
    with pytest.raises(ValueError, match=f"--batch-invariant does not cover .*({words})"):
        LLM(tiny_model_dir(arch), dtype="float32", kv_cache_memory_gib=0.05, batch_invariant=True)


@pytest.mark.parametrize("arch, dtype", [("qwen3", "bfloat16"), ("qwen2", "float32")])
def test_qk_norms_biases_and_bf16_are_covered(tiny_model_dir, arch, dtype):
    """Qwen3's per-head q/k norms and a bf16 model (oneDNN's bf16 GEMM where the CPU has one), Qwen2's
    qkv biases: six requests alone and together, chunked at 16 tokens."""
    prompts = random_prompts(6, low=3, high=40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    def run(llm, ids):
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in ids], params, use_tqdm=False)
        return [_record(o) for o in outs]

    common = dict(dtype=dtype, kv_cache_memory_gib=0.05, enable_prefix_caching=False, batch_invariant=True)
    alone_llm = LLM(tiny_model_dir(arch), max_num_batched_tokens=512, **common)
    alone = [run(alone_llm, [i])[0] for i in range(6)]
    chunked = LLM(tiny_model_dir(arch), max_num_batched_tokens=16, long_prefill_token_threshold=16, **common)
    assert run(chunked, list(range(6))) == alone
