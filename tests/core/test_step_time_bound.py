"""The step-time bound (core/step_time.py, issue 44 item 6): beside running decodes, a step's prompt tokens keep its
roofline estimate (engine/step_cost.py: a Llama-3.1-8B shape on an H200 here) within step_time_factor x the
decodes' own step, never below the floor of prompt tokens where the model's matmuls turn compute-bound; steps
without decodes, and steps of decodes alone, are scheduled as without it; and every prompt still finishes."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest

from pressroom.config import CUDA_STEP_TIME_FACTOR, CheckpointFacts, EngineArgs, SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import ModelRunnerOutput, SchedulerOutput
from pressroom.core.request import Request
from pressroom.core.scheduler import Scheduler
from pressroom.core.step_time import StepLoad, StepTimeBound
from pressroom.engine.step_cost import (
    DEFAULT_CUDA_ROOFLINE,
    ModelShape,
    StepTimer,
    attention_cost,
    device_roofline,
    load_of,
    matmul_cost,
    request_steps,
)
from pressroom.sampling_params import SamplingParams

CONFIGS = Path(__file__).resolve().parents[2] / "pressroom" / "benchmarks" / "configs"
H200 = device_roofline("cuda", "NVIDIA H200")
STREAM = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _shape(name: str) -> ModelShape:
    config = SimpleNamespace(**json.loads((CONFIGS / name / "config.json").read_text()))
    return ModelShape.from_hf_config(config, weight_bytes=2, activation_bytes=2, kv_bytes=2)


LLAMA_8B = StepTimer(_shape("llama-3.1-8b"), H200)


def _scheduler(factor: float, timer: StepTimer = LLAMA_8B, max_num_seqs: int = 512) -> Scheduler:
    """CUDA's defaults for a Llama-3.1-8B shape (16k budget, a quarter of it per long prompt, cost context 26,624)."""
    config = SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=max_num_seqs, max_model_len=32768,
                             prefill_cost_context=26624, long_prefill_token_threshold=4096, step_time_factor=factor)
    return Scheduler(config, KVCacheManager(16384, 16), step_time=timer)


def _step(sched: Scheduler) -> SchedulerOutput:
    """One step, a token (7) sampled for every request that reached its end."""
    out = sched.schedule()
    sampled = {rid: [7] for rid in out.num_scheduled_tokens
               if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out


def _prompt(i: int, length: int) -> list[int]:
    return [(i * 131 + j) % 30_000 + 1 for j in range(length)]  # distinct: no prefix-cache hits


def _start_decodes(sched: Scheduler, count: int, prompt_len: int = 256) -> None:
    for i in range(count):
        sched.add_request(Request(f"d{i}", _prompt(i, prompt_len), STREAM, None))
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        _step(sched)


def _split(out: SchedulerOutput) -> tuple[StepLoad, int]:
    """A step's decodes (one-token shares) as a load, and its prompt tokens."""
    steps = request_steps(out)
    decodes = [s for s in steps if s.num_tokens == 1]
    return load_of(decodes), sum(s.num_tokens for s in steps if s.num_tokens > 1)


def _check_bound(out: SchedulerOutput, timer: StepTimer, factor: float) -> int:
    """Asserts the step within the bound (or at the floor of prompt tokens); returns its prompt tokens."""
    decodes, prompt_tokens = _split(out)
    estimate = timer.seconds(load_of(request_steps(out)))
    assert estimate <= factor * timer.seconds(decodes) * (1 + 1e-9) or prompt_tokens <= timer.floor_tokens, \
        (estimate, timer.seconds(decodes), prompt_tokens)
    return prompt_tokens


def test_a_wave_beside_256_decodes_stays_within_the_bound_and_every_prompt_finishes():
    sched = _scheduler(CUDA_STEP_TIME_FACTOR)
    _start_decodes(sched, 256)
    wave = [f"w{i}" for i in range(256)]
    for i, rid in enumerate(wave):
        sched.add_request(Request(rid, _prompt(1000 + i, 256), FIRST, None))
    steps, first_tokens = [], set()
    while any(rid in sched.requests for rid in wave):
        out = _step(sched)
        assert all(out.num_scheduled_tokens.get(f"d{i}") == 1 for i in range(256))  # every stream, every step
        steps.append(_check_bound(out, LLAMA_8B, CUDA_STEP_TIME_FACTOR))
        first_tokens |= {rid for rid in wave if rid in out.num_scheduled_tokens and rid not in sched.requests}
        assert len(steps) < 200
    assert first_tokens == set(wave)  # no prompt starved
    # ~800-1,050 prompt tokens a step (config.py's figures) rather than the 16k budget: 65k tokens in 60-85 steps
    assert 700 < statistics.median(steps) < 1100 and 60 <= len(steps) <= 85
    assert max(steps) < 1200

    unbounded = _scheduler(0)
    _start_decodes(unbounded, 256)
    for i in range(256):
        unbounded.add_request(Request(f"w{i}", _prompt(1000 + i, 256), FIRST, None))
    decodes, prompt_tokens = _split(_step(unbounded))
    assert prompt_tokens > 16000  # without the bound, one step takes the budget's worth: ~40x a decode step
    assert LLAMA_8B.seconds(load_of(request_steps(_step(_scheduler(0))))) == 0  # (an empty step costs nothing)


def test_a_lone_wave_and_decode_only_steps_are_scheduled_as_without_the_bound():
    bounded, plain = _scheduler(CUDA_STEP_TIME_FACTOR), _scheduler(0)
    for sched in (bounded, plain):
        for i in range(64):  # 16k tokens: one step's budget
            sched.add_request(Request(f"w{i}", _prompt(i, 256), STREAM, None))
    first = _step(bounded)
    assert first.num_scheduled_tokens == _step(plain).num_scheduled_tokens
    assert first.total_num_scheduled_tokens == 64 * 256  # the whole wave in its first step: TTFT unchanged
    for _ in range(5):  # then decodes alone, each one token, as without the bound
        out, ref = _step(bounded), _step(plain)
        assert out.num_scheduled_tokens == ref.num_scheduled_tokens == {f"w{i}": 1 for i in range(64)}
    # a wave larger than the budget: its first step is the budget's, as without the bound
    for sched in (bounded, plain):
        for i in range(128):
            sched.add_request(Request(f"x{i}", _prompt(500 + i, 256), FIRST, None))
    bounded.finish_requests([f"w{i}" for i in range(64)], bounded.requests["w0"].status.FINISHED_ABORTED)
    plain.finish_requests([f"w{i}" for i in range(64)], plain.requests["w0"].status.FINISHED_ABORTED)
    assert _step(bounded).num_scheduled_tokens == _step(plain).num_scheduled_tokens


def test_the_floor_keeps_prompts_going_where_the_bound_holds_none():
    """A mixture of experts (Qwen3-30B-A3B's shape): one decode reads 8 of 128 experts, a prompt chunk all of them,
    so no chunk fits 3x the decode's estimate; the prompt still gets the floor, the tokens whose matmul FLOPs take
    as long as reading every expert, each step."""
    moe = StepTimer(_shape("qwen3-30b-a3b"), H200)
    sched = _scheduler(CUDA_STEP_TIME_FACTOR, moe)
    _start_decodes(sched, 1)
    decode = StepLoad().plus(1, 300, 1)
    assert moe.seconds(decode.plus(64, 0, 1)) > CUDA_STEP_TIME_FACTOR * moe.seconds(decode)  # 64 tokens: too many
    sched.add_request(Request("long", _prompt(7, 20_000), FIRST, None))
    chunks = []
    while "long" in sched.requests:
        out = _step(sched)
        chunks.append(_check_bound(out, moe, CUDA_STEP_TIME_FACTOR))
        assert len(chunks) < 40
    # the floor, until the prompt's context shrinks its cost-based chunk below it (prefill_cost_context)
    assert chunks[:3] == [moe.floor_tokens] * 3 and all(0 < c <= moe.floor_tokens for c in chunks)
    assert sum(chunks) == 20_000


def test_the_floor_is_where_a_steps_matmuls_turn_compute_bound():
    floor = LLAMA_8B.floor_tokens
    def times(n: int) -> tuple[float, float]:
        cost = matmul_cost(StepLoad(tokens=n, sampled=1), LLAMA_8B.shape)
        return cost.flops / H200.flops_per_s, (cost.read_bytes + cost.write_bytes) / H200.bytes_per_s
    compute, memory = times(floor)
    assert compute >= memory and times(floor - 1)[0] < times(floor - 1)[1]
    # bf16 weights: about the device's FLOP per byte (989e12 / 4.8e12 = 206; activations' bytes add a little)
    assert 200 < floor < 260
    h100 = StepTimer(LLAMA_8B.shape, device_roofline("cuda", "NVIDIA H100 80GB HBM3"))
    assert h100.floor_tokens > floor  # less bandwidth for the same FLOPs
    assert StepTimer(_shape("qwen3-30b-a3b"), H200).floor_tokens > 10 * floor  # every expert read, few computed


def test_rooflines_by_the_gpus_name():
    assert device_roofline("cuda", "NVIDIA H200").name == "H200"
    assert device_roofline("cuda", "NVIDIA GH200 480GB").name == "GH200"
    assert device_roofline("cuda", "NVIDIA H100 80GB HBM3").name == "H100"
    assert device_roofline("cuda", "NVIDIA H100 PCIe").name == "H100 PCIe"
    assert device_roofline("cuda", "NVIDIA A100-SXM4-80GB").name == "A100"
    assert device_roofline("cuda", "NVIDIA L40S").name == "L40S"
    assert device_roofline("cuda", "Some Future GPU") is DEFAULT_CUDA_ROOFLINE
    assert device_roofline("cuda", None) is DEFAULT_CUDA_ROOFLINE  # the core process has no CUDA context
    assert device_roofline("cpu").name.startswith("CPU")


def test_cuda_defaults_the_bound_on_and_the_cpu_off():
    assert SchedulerConfig().step_time_factor == 0
    cuda = EngineArgs()._scheduler_config("cuda", CheckpointFacts(), None)
    assert cuda.step_time_factor == CUDA_STEP_TIME_FACTOR == 3
    assert EngineArgs(device="cpu").create_engine_config().scheduler.step_time_factor == 0
    assert EngineArgs(step_time_factor=0)._scheduler_config("cuda", CheckpointFacts(), None).step_time_factor == 0
    assert EngineArgs(device="cpu", step_time_factor=2.5).create_engine_config().scheduler.step_time_factor == 2.5
    with pytest.raises(ValueError, match="step_time_factor must be 0 \\(off\\) or above 1"):
        SchedulerConfig(step_time_factor=0.5)
    with pytest.raises(ValueError, match="step_time_factor must exceed 1"):
        StepTimeBound(LLAMA_8B, 1.0)


def _simulate(factor: float, num_requests: int, concurrency: int, input_len: int, output_len: int
              ) -> tuple[float, float, float]:
    """serve_vs_offline.sh's closed loop on the scheduler, a step taking 1.5x its roofline estimate + 2.5 ms (about
    an H200's: a c=256 decode step of ~12.8 ms, a 16k-token prompt step of ~400 ms): output tokens per second,
    and the median and P99 inter-token gap."""
    sched = _scheduler(factor, max_num_seqs=concurrency)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    now, sent, done, last, gaps = 0.0, 0, 0, {}, []

    def send() -> None:
        nonlocal sent
        sched.add_request(Request(f"r{sent}", _prompt(sent, input_len), params, None))
        sent += 1
    for _ in range(min(concurrency, num_requests)):
        send()
    while done < num_requests:
        out = sched.schedule()
        now += 1.5 * LLAMA_8B.seconds(load_of(request_steps(out))) + 0.0025
        sampled = {rid: [7] for rid in out.num_scheduled_tokens
                   if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
        for rid in sampled:
            if rid in last:
                gaps.append(now - last[rid])
            last[rid] = now
        for o in sched.update_from_output(out, ModelRunnerOutput(sampled)):
            if o.finish_reason is not None:
                done += 1
                if sent < num_requests:
                    send()
    gaps.sort()
    return num_requests * output_len / now, gaps[len(gaps) // 2], gaps[int(0.99 * (len(gaps) - 1))]


@pytest.mark.slow
def test_simulated_serving_tail_and_throughput():
    """Slow (~40 s: two runs of ~1,100 steps of 256-512 requests): serve_vs_offline.sh's workload (1,024 x
    256/256 at c=256) on the scheduler with a step time from the roofline: the bound takes the P99 inter-token gap
    from ~28x the median to under 4x, for at most 5% of the output rate (config.py's CUDA_STEP_TIME_FACTOR)."""
    rate, median, p99 = _simulate(CUDA_STEP_TIME_FACTOR, 1024, 256, 256, 256)
    rate0, median0, p990 = _simulate(0, 1024, 256, 256, 256)
    assert p990 > 10 * median0 and p99 < 4 * median
    assert rate > 0.95 * rate0


def test_the_fit_recovers_the_rates_an_engine_reaches():
    """StepTimeFit: steps whose times are 0.5 ms + 1.3x their bytes' time + 1.8x their FLOPs' time (an engine at
    77% of the bandwidth and 56% of the matmul rate) give those back; nothing before FIT_MIN_STEPS steps."""
    import random

    from pressroom.core.step_time import FIT_MIN_STEPS, StepTimeFit
    rng, fit = random.Random(3), StepTimeFit()
    for i in range(400):
        memory, compute = rng.uniform(4e-3, 6e-3), rng.choice([0.0, 1e-4, rng.uniform(1e-3, 40e-3)])
        assert (fit.predict(memory, compute) is None) == (i < FIT_MIN_STEPS)
        fit.observe(memory, compute, (0.5e-3 + 1.3 * memory + 1.8 * compute) * rng.uniform(0.98, 1.02))
    c, a, b = fit.coefficients
    assert abs(a - 1.3) < 0.1 and abs(b - 1.8) < 0.05 and 0 <= c < 1e-3
    assert abs(fit.predict(5e-3, 20e-3) - (0.5e-3 + 1.3 * 5e-3 + 1.8 * 20e-3)) < 1e-3


def test_the_fit_follows_a_change_and_keeps_rates_sane():
    """Old steps are forgotten (the rates it reaches now, not at start); a fit never calls the card more than
    1 / FIT_MIN_RATE times faster than its data sheet, however odd the steps."""
    from pressroom.core.step_time import FIT_MIN_RATE, StepTimeFit
    fit = StepTimeFit()
    for i in range(300):
        memory, compute = 5e-3, (i % 7) * 5e-3
        fit.observe(memory, compute, memory + 3.0 * compute)
    for i in range(1500):
        memory, compute = 5e-3, (i % 7) * 5e-3
        fit.observe(memory, compute, memory + 1.5 * compute)
    assert abs(fit.coefficients[2] - 1.5) < 0.1
    odd = StepTimeFit()
    for i in range(100):
        odd.observe(5e-3, (i % 5) * 1e-3, 1e-6)  # steps no card runs this fast
    assert min(odd.coefficients[1:]) >= FIT_MIN_RATE


def test_the_timer_learns_from_steps_but_not_from_stalls():
    """StepTimer.observe: a step far beyond its estimate (a compile) is left out, `forget` drops what was learned,
    and once fitted, seconds() is the fit's."""
    from pressroom.core.step_time import FIT_MIN_STEPS, FIT_OUTLIER
    timer = StepTimer(LLAMA_8B.shape, LLAMA_8B.roofline)
    decode = StepLoad.of([(1, 500, 1)] * 32)
    chunk = decode.plus(1000, 0, 1)
    sheet = timer.seconds(decode), timer.seconds(chunk)
    timer.observe(decode, 2 * FIT_OUTLIER * sheet[0])
    assert timer.fit.steps == 0
    for i in range(FIT_MIN_STEPS * 4):
        load = chunk if i % 2 else decode
        timer.observe(load, 1.2 * timer.roofline.seconds(matmul_cost(load, timer.shape)
                                                           + attention_cost(load, timer.shape)) + 1e-3)
    assert timer.fit.coefficients is not None and timer.seconds(chunk) != sheet[1]
    timer.forget()
    assert timer.fit.steps == 0 and (timer.seconds(decode), timer.seconds(chunk)) == sheet
