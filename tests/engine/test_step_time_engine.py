"""The step-time bound in a real engine on the CPU (--step-time-factor 3; CUDA's default, off on the CPU by default):
a small Llama's prompts arriving beside running streams are computed in chunks that keep each step's estimate within
3x the streams' own step (the engine's roofline: the CPU's nominal one), read off the scheduler's outputs, and the
greedy tokens are those of the same engine without the bound."""
from __future__ import annotations

import pytest
import torch

from pressroom import LLMEngine, SamplingParams
from pressroom.config import EngineArgs
from pressroom.engine.step_cost import StepTimer, attention_cost, load_of, matmul_cost, request_steps

STREAM = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FACTOR = 3.0


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> str:
    """A random Llama whose layers, not its LM head, hold most of its weights (hidden 256, vocabulary 512), as a
    real model's do: its floor of prompt tokens per step is ~20, so the bound, not the floor, sets its chunks.
    No tokenizer: the engine takes token ids (skip_tokenizer_init)."""
    import transformers
    torch.manual_seed(44)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      initializer_range=0.2, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("small-llama"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _run(model: str, factor: float, async_scheduling: bool = False) -> tuple[LLMEngine, list, dict[str, list[int]]]:
    """Four streams decoding, then two 400-token prompts: every scheduled step with the bound's estimates of it and
    of its decodes alone when it was scheduled (the estimates learn from the steps' times as they run), and each
    request's tokens."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.05, num_threads=1,
        max_num_batched_tokens=2048, long_prefill_token_threshold=0, prefill_cost_context=0,
        step_time_factor=factor, async_scheduling=async_scheduling))
    steps, schedule = [], engine.scheduler.schedule
    bound = engine.scheduler.time_bound

    def recording():
        out = schedule()
        shares = request_steps(out)
        decodes = [s for s in shares if s.num_tokens == 1]
        estimates = (bound.model.seconds(load_of(shares)), bound.model.seconds(load_of(decodes))) \
            if bound is not None and decodes else None
        steps.append((out, estimates))
        return out

    engine.scheduler.schedule = recording
    tokens: dict[str, list[int]] = {}

    def run_until(done) -> None:
        while engine.has_unfinished_requests() and not done():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)

    for i in range(4):
        engine.add_request(f"s{i}", {"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(8)]}, STREAM)
    run_until(lambda: all(len(tokens.get(f"s{i}", ())) >= 2 for i in range(4)))
    for i in range(2):
        engine.add_request(f"p{i}", {"prompt_token_ids": [(13 * i + 3 * j) % 500 + 1 for j in range(400)]}, PROMPT)
    run_until(lambda: False)
    return engine, steps, tokens


def test_prompts_beside_streams_keep_each_step_within_the_bound_and_the_tokens(small_llama):
    engine, steps, tokens = _run(small_llama, FACTOR)
    timer = engine.scheduler.time_bound.model
    assert isinstance(timer, StepTimer) and engine.scheduler.time_bound.factor == FACTOR
    mixed = []
    for out, estimates in steps:
        prompt_tokens = sum(s.num_tokens for s in request_steps(out) if s.num_tokens > 1)
        if estimates is None or not prompt_tokens:
            continue
        mixed.append(prompt_tokens)
        estimate, decode_only = estimates
        assert estimate <= FACTOR * decode_only * (1 + 1e-9) or prompt_tokens <= timer.floor_tokens, \
            (out.num_scheduled_tokens, estimate, decode_only)
    # the two prompts' 800 tokens came in chunks the bound cut (the budget held them in one step)
    assert sum(mixed) == 800 and max(mixed) < 200 and len(mixed) >= 5
    assert timer.floor_tokens < min(mixed[:-1])  # the bound, not the floor, set them

    _, plain_steps, plain_tokens = _run(small_llama, 0)
    assert plain_tokens == tokens  # chunking changes no greedy token
    assert max(sum(n for n in o.num_scheduled_tokens.values() if n > 1) for o, _ in plain_steps) == 800  # one step


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_estimates_learn_the_engines_own_step_times(small_llama, async_scheduling):
    """Every step's measured time goes into the bound's fit (core/step_time.py's StepTimeFit), which takes over
    from the data sheet's roofline once it has enough steps: what the bound compares is then the engine's own."""
    from pressroom.core.step_time import FIT_MIN_STEPS
    engine, steps, _ = _run(small_llama, FACTOR, async_scheduling)
    timer = engine.scheduler.time_bound.model
    worked = [out for out, _ in steps if not out.is_empty]
    assert FIT_MIN_STEPS <= timer.fit.steps <= len(worked)
    c, memory_rate, compute_rate = timer.fit.coefficients
    assert c >= 0 and memory_rate > 0 and compute_rate > 0
    load = load_of(request_steps(worked[-1]))
    assert timer.seconds(load) == timer.fit.predict(*timer._terms(matmul_cost(load, timer.shape)
                                                                  + attention_cost(load, timer.shape)))
