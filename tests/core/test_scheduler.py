"""Prefill chunks on the defaults (the CPU's measured, CUDA's from the model's FLOPs): a long prompt gets at most
long_prefill_token_threshold of a step, counted as cost (tokens x (1 + context / prefill_cost_context)), so its
later chunks shrink while decodes keep their token each step; and it still progresses every step."""
from __future__ import annotations

import torch

from pressroom.config import (
    CPU_PREFILL_COST_CONTEXT,
    CPU_TOKENS_PER_THREAD,
    CheckpointFacts,
    EngineArgs,
    SchedulerConfig,
    checkpoint_facts,
    flops_prefill_cost_context,
)
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import ModelRunnerOutput
from pressroom.core.request import Request
from pressroom.core.scheduler import Scheduler
from pressroom.sampling_params import SamplingParams

STREAM = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _scheduler(budget: int, cost_context: int, threshold: int = 0, caching: bool = False,
               max_model_len: int = 8192) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len,
                             prefill_cost_context=cost_context, long_prefill_token_threshold=threshold)
    return Scheduler(config, KVCacheManager(max(2048, max_model_len // 16 + 256), 16, enable_caching=caching))


def _step(sched: Scheduler) -> dict[str, int]:
    """One scheduled step, its tokens sampled (token 7) for every request that reached its end."""
    out = sched.schedule()
    sampled = {rid: [7] for rid in out.num_scheduled_tokens
               if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out.num_scheduled_tokens


def _prefill_long_prompt(sched: Scheduler, streams: int, prompt_len: int = 8000) -> list[dict[str, int]]:
    """`streams` short requests decoding, then a long prompt: each step until its prompt is computed."""
    for i in range(streams):
        sched.add_request(Request(f"s{i}", [1] * 20, STREAM, None))
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        _step(sched)  # their prompts
    sched.add_request(Request("long", list(range(prompt_len)), ONE, None))
    steps = []
    while "long" in sched.requests and sched.requests["long"].num_computed_tokens < prompt_len:
        steps.append(_step(sched))
        assert len(steps) < 5000
    return steps


def test_a_long_prompts_chunks_shrink_as_its_context_grows_while_decodes_keep_their_pace():
    for k, budget, threshold in ((2048, 512, 0), (2048, 512, 256)):
        steps = _prefill_long_prompt(_scheduler(budget, k, threshold), streams=4)
        limit = min(budget - 4, threshold or budget)
        chunks, context = [], 0
        for step in steps:
            # every stream gets its token in every step, and the prompt progresses in every step
            assert all(step.get(f"s{i}") == 1 for i in range(4)), step
            assert step["long"] > 0
            # the chunk's cost at its context stays within what the step leaves it
            n = step["long"]
            assert n * (1 + context / k) <= limit + 1
            chunks.append(n)
            context += n
        assert sum(chunks) == 8000
        assert chunks[0] == limit  # no context yet: tokens alone
        assert all(a >= b for a, b in zip(chunks, chunks[1:-1]))  # non-increasing (the last is the remainder)
        assert chunks[-2] < chunks[0] / 3  # at ~7,500 tokens of context: 1 + 7500/2048 = 4.7x the cost per token

    # Cost-based chunking off (CUDA's default): tokens count alone, every chunk as large as the budget allows.
    plain = _prefill_long_prompt(_scheduler(budget, 0), streams=4)
    assert [s["long"] for s in plain[:-1]] == [budget - 4] * (len(plain) - 1)
    assert len(steps) > len(plain)


def test_a_prompt_alone_is_prefilled_with_progress_every_step():
    # the second: past 960 tokens of context, even one token costs more than the budget
    for budget, k, threshold, prompt_len in ((512, CPU_PREFILL_COST_CONTEXT, 256, 8000), (16, 64, 0, 2000)):
        steps = _prefill_long_prompt(_scheduler(budget, k, threshold), streams=0, prompt_len=prompt_len)
        assert all(s["long"] >= 1 for s in steps)
        assert sum(s["long"] for s in steps) == prompt_len
    # decodes fill most of the budget: the prompt still gets a chunk every step, and every stream its token
    steps = _prefill_long_prompt(_scheduler(64, 128), streams=60, prompt_len=400)
    assert all(s["long"] >= 1 and len(s) == 61 for s in steps)


def test_a_prefix_cache_hit_is_the_context_of_the_first_chunk():
    k, budget = 1024, 512
    sched = _scheduler(budget, k, threshold=budget, caching=True)
    prompt = list(range(4000))
    sched.add_request(Request("first", prompt, ONE, None))
    while "first" in sched.requests:
        _step(sched)
    sched.add_request(Request("again", prompt[:3072] + [9] * 928, ONE, None))
    first_chunk = _step(sched)["again"]
    assert first_chunk == budget * k // (k + 3072)  # 3,072 cached tokens before it


def test_a_short_prompt_joins_while_a_long_one_is_prefilled():
    """The threshold leaves the rest of the step to others: a short prompt arriving behind the long one is
    computed in the next step, not after the whole long prompt."""
    sched = _scheduler(512, 2048, threshold=256)
    sched.add_request(Request("long", list(range(8000)), ONE, None))
    _step(sched)
    sched.add_request(Request("short", [5] * 100, ONE, None))
    step = _step(sched)
    assert step["short"] == 100 and 0 < step["long"] < 256
    # without a threshold the long prompt takes every step's whole budget, and the short one waits
    sched = _scheduler(512, 2048)
    sched.add_request(Request("long", list(range(8000)), ONE, None))
    _step(sched)
    sched.add_request(Request("short", [5] * 100, ONE, None))
    assert "short" not in _step(sched)


LLAMA_3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "model_type": "llama"}


def test_the_cpu_defaults_to_its_measured_cost_based_chunks():
    assert SchedulerConfig().prefill_cost_context == 0 and SchedulerConfig().long_prefill_token_threshold == 0
    cpu = EngineArgs(device="cpu").create_engine_config().scheduler
    assert cpu.prefill_cost_context == CPU_PREFILL_COST_CONTEXT
    assert cpu.long_prefill_token_threshold == CPU_TOKENS_PER_THREAD * torch.get_num_threads()
    off = EngineArgs(device="cpu", prefill_cost_context=0, long_prefill_token_threshold=0).create_engine_config()
    assert off.scheduler.prefill_cost_context == 0 and off.scheduler.long_prefill_token_threshold == 0
    # the checkpoint's shape changes nothing on the CPU
    facts = checkpoint_facts(LLAMA_3_8B)
    assert EngineArgs()._prefill_chunking("cpu", 2, 512, facts) == {
        "long_prefill_token_threshold": 2 * CPU_TOKENS_PER_THREAD, "prefill_cost_context": CPU_PREFILL_COST_CONTEXT}


def test_the_cost_context_is_where_attention_flops_equal_the_linear_layers():
    # 2 x active parameters per token against 4 x layers x heads x head_dim per context token
    smollm = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536}
    assert flops_prefill_cost_context(smollm) == 3072  # config.py's "~3,000" for the CPU's model
    assert flops_prefill_cost_context(LLAMA_3_8B) == 26624
    assert flops_prefill_cost_context({"text_config": LLAMA_3_8B}) == 26624  # a multimodal checkpoint's
    # MLA (DeepSeek-V3's shape): q/k 192 wide, v 128; 8 of 256 experts and a shared one active past layer 3
    v3 = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "intermediate_size": 18432,
          "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
          "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert 13_000 < flops_prefill_cost_context(v3) < 16_000
    # only the layers that attend over the context count their attention
    hybrid = dict(LLAMA_3_8B, layer_types=["linear_attention"] * 24 + ["full_attention"] * 8)
    assert flops_prefill_cost_context(hybrid) == 4 * 26624
    assert flops_prefill_cost_context(dict(hybrid, layer_types=["linear_attention"] * 32)) == 0
    assert flops_prefill_cost_context({"model_type": "gpt2", "n_embd": 768}) == 0  # no shape it reads: tokens
    assert checkpoint_facts(LLAMA_3_8B) == CheckpointFacts(prefill_cost_context=26624)
    assert checkpoint_facts(dict(LLAMA_3_8B, model_type="bert")) == CheckpointFacts(encoder_only=True)


def test_cuda_defaults_bound_a_long_prompts_step_cost():
    """On CUDA's defaults, a 64k-token prompt of a Llama-3-8B shape beside 32 streams: every step's cost stays
    within the budget and its chunk within a quarter of it, and every stream gets its token every step; with
    vLLM's (tokens count alone, no threshold) its last chunks cost nearly three budgets' worth, and leave no
    room for a newcomer's prompt."""
    facts = checkpoint_facts(LLAMA_3_8B)
    budget = 16384
    chunking = EngineArgs()._prefill_chunking("cuda", 1, budget, facts)
    assert chunking == {"long_prefill_token_threshold": 4096, "prefill_cost_context": 26624}
    k, threshold = chunking["prefill_cost_context"], chunking["long_prefill_token_threshold"]
    prompt_len = 65536
    sched = _scheduler(budget, k, threshold, max_model_len=prompt_len + 64)
    steps = _prefill_long_prompt(sched, streams=32, prompt_len=prompt_len)
    context = 0
    for step in steps:
        assert all(step.get(f"s{i}") == 1 for i in range(32)), step
        cost = sched._cost(step["long"], context)
        assert cost <= threshold and cost + 32 <= budget
        context += step["long"]
    assert steps[0]["long"] == threshold and steps[-2]["long"] < threshold / 3
    plain = _prefill_long_prompt(_scheduler(budget, 0, max_model_len=prompt_len + 64), streams=32,
                                 prompt_len=prompt_len)
    context = sum(s["long"] for s in plain[:-2])
    assert plain[-2]["long"] * (1 + context / k) > 2.5 * budget


def test_explicit_flags_win_over_the_cuda_defaults():
    facts = checkpoint_facts(LLAMA_3_8B)
    off = EngineArgs(long_prefill_token_threshold=0, prefill_cost_context=0)
    assert off._prefill_chunking("cuda", 1, 16384, facts) == {"long_prefill_token_threshold": 0,
                                                               "prefill_cost_context": 0}
    mine = EngineArgs(long_prefill_token_threshold=1000, prefill_cost_context=5000)
    assert mine._prefill_chunking("cuda", 1, 16384, facts) == {"long_prefill_token_threshold": 1000,
                                                                "prefill_cost_context": 5000}
    # the threshold follows an asked budget; a checkpoint whose shape is unknown (a GGUF) counts tokens alone
    sched = EngineArgs(max_num_batched_tokens=2048)._scheduler_config("cuda", CheckpointFacts(), None)
    assert (sched.long_prefill_token_threshold, sched.prefill_cost_context) == (512, 0)


def test_suspects_of_a_failed_step_run_alone_taking_turns_with_the_others():
    """Each suspect is recomputed (prompt and outputs) alone until it samples; the others run in between."""
    sched = _scheduler(512, 0)
    for rid in ("a", "b", "c"):
        sched.add_request(Request(rid, [1] * 20, STREAM, None))
    _step(sched)
    _step(sched)  # each has 2 outputs: 22 tokens
    sched.suspect(["b", "a"])  # a step of a and b failed
    steps = [_step(sched) for _ in range(4)]
    assert steps == [{"a": 22}, {"a": 1, "c": 1}, {"b": 22}, {"a": 1, "b": 1, "c": 1}]
    assert not sched.suspects and sched.num_preemptions == 2
    assert [r.num_output_tokens for r in sched.requests.values()] == [5, 4, 4]  # outputs kept, none repeated
