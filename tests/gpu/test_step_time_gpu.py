"""The step-time bound on the GPU (issue 44 item 6; core/step_time.py): on by default on CUDA with the card's roofline
(by its name), and a wave of new prompts beside running streams no longer makes a step many times a decode step's
wall time: a Llama-3.1-8B shape, dummy bf16 weights, 128 streams decoding, then 128 prompts of 1,024 tokens; steps
timed synchronously (async scheduling off), the longest step carrying prompt tokens against the median decode-only
step, with the bound (default) and without it (--step-time-factor 0). Token ids only (no tokenizer on the machine)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from pressroom import LLM, SamplingParams
from pressroom.config import CUDA_STEP_TIME_FACTOR
from pressroom.engine.step_cost import DEFAULT_CUDA_ROOFLINE, DEVICE_ROOFLINES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

LLAMA_8B = str(Path(__file__).resolve().parents[2] / "pressroom" / "benchmarks" / "configs" / "llama-3.1-8b")
STREAMS, WAVE, PROMPT_LEN = 128, 128, 1024


def _step_times(**kwargs) -> tuple[float, float, list[int]]:
    """The median decode-only step, the longest step with prompt tokens beside decodes (seconds), and those steps'
    prompt tokens."""
    llm = LLM(LLAMA_8B, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.6, async_scheduling=False,
              enable_prefix_caching=False, **kwargs)
    try:
        engine = llm.engine
        scheduled, schedule = [], engine.scheduler.schedule

        def recording():
            scheduled.append(schedule())
            return scheduled[-1]

        engine.scheduler.schedule = recording
        stream = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, detokenize=False)
        for i in range(STREAMS):
            engine.add_request(f"s{i}", {"prompt_token_ids": [(i * 37 + j) % 30_000 + 1 for j in range(128)]},
                               stream)
        decode, mixed, prompt_tokens = [], [], []
        for k in range(40):  # the streams' prompts, then decode-only steps
            start = time.perf_counter()
            engine.step()
            if k >= 10:
                decode.append(time.perf_counter() - start)
        wave = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False)
        for i in range(WAVE):
            engine.add_request(f"w{i}", {"prompt_token_ids": [(i * 53 + j) % 30_000 + 1 for j in range(PROMPT_LEN)]},
                               wave)
        waiting = {f"w{i}" for i in range(WAVE)}
        # the scheduler knows a request by the engine's internal id; a prompt's last chunk may be one token: count
        # by request
        prompt_left = {cid: PROMPT_LEN for cid, (parent, _) in engine.child_to_parent.items()
                       if parent.request_id in waiting}
        assert len(prompt_left) == WAVE
        while waiting:
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            waiting -= {o.request_id for o in outputs if o.finished}
            tokens = 0
            for rid, n in scheduled[-1].num_scheduled_tokens.items():
                chunk = min(n, prompt_left.get(rid, 0))
                tokens += chunk
                if chunk:
                    prompt_left[rid] -= chunk
            if tokens:
                mixed.append(seconds)
                prompt_tokens.append(tokens)
        return statistics.median(decode), max(mixed), prompt_tokens
    finally:
        llm.shutdown()


def test_cuda_defaults_the_bound_on_with_the_cards_roofline():
    with LLM(LLAMA_8B, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
             max_model_len=1024, gpu_memory_utilization=0.6) as llm:
        bound = llm.engine.scheduler.time_bound
        assert bound is not None and bound.factor == CUDA_STEP_TIME_FACTOR
        name = torch.cuda.get_device_name()
        if any(r.name.upper() in name.upper() for r in DEVICE_ROOFLINES):  # H100, H200, A100 ...
            assert bound.model.roofline is not DEFAULT_CUDA_ROOFLINE and bound.model.roofline.name in name
        assert 150 < bound.model.floor_tokens < 500  # bf16 Llama: about the card's FLOP per byte


def test_a_wave_of_prompts_beside_streams_keeps_steps_within_4x_a_decode_step():
    decode, longest, chunks = _step_times()
    print(f"bound: decode step {decode * 1e3:.1f} ms, longest mixed {longest * 1e3:.1f} ms "
          f"({longest / decode:.2f}x), prompt tokens per mixed step median {statistics.median(chunks):.0f}")
    assert longest < 4 * decode
    assert sum(chunks) == WAVE * PROMPT_LEN and max(chunks) < 4096
    plain_decode, plain_longest, plain_chunks = _step_times(step_time_factor=0)
    print(f"no bound: decode step {plain_decode * 1e3:.1f} ms, longest mixed {plain_longest * 1e3:.1f} ms "
          f"({plain_longest / plain_decode:.2f}x)")
    assert plain_longest > 8 * plain_decode and max(plain_chunks) > 8192  # what the bound removes
