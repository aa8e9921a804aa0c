"""A request whose step raises ends alone, with finish_reason "error"; the engine goes on serving. A failed
step of several requests runs each of them alone to find the culprit: the others finish with the tokens of a
run without the fault, none sent twice. Three faults in a row are the engine's, not a request's: then it
stops. A request the core cannot take ends alone too.

Faults are injected where a request's own sampling parameters are read (the host sampler), with a marker
seed no other request uses, or by a prompt token past the vocabulary (the model's embedding raises)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import random_prompts

from pressroom import LLMEngine, SamplingParams
from pressroom.config import EngineArgs
from pressroom.engine import core as engine_core
from pressroom.engine.core import CoreRequest, EngineCore
from pressroom.worker import model_runner

POISON_SEED = 4242
BAD_TOKEN = 10**6  # past any vocabulary: the embedding lookup raises
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir, monkeypatch):
    real = model_runner.sample

    def sample_or_fail(logits, rows, generator):
        if any(row.params.seed == POISON_SEED for row in rows):
            raise IndexError("injected fault in one request's sampling")
        return real(logits, rows, generator)

    monkeypatch.setattr(model_runner, "sample", sample_or_fail)
    args = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05)
    eng = LLMEngine.from_engine_args(args)
    yield eng
    eng.shutdown()


def _run(engine: LLMEngine, steps: int = 100) -> dict:
    finished = {}
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return finished


def _params(seed: int | None = None, n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=n, ignore_eos=True)


def test_a_failing_request_ends_with_error_and_the_engine_goes_on(engine):
    engine.add_request("bad", {"prompt_token_ids": [5, 6, 7, 8]}, _params(POISON_SEED))
    done = _run(engine)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert engine.core.kv_cache.usage() == 0.0  # its blocks are back
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7, 8]}, _params(1))
    done = _run(engine)
    assert done["good"].outputs[0].finish_reason == "length"
    assert len(done["good"].outputs[0].token_ids) == 6


def test_requests_outside_the_failing_step_are_untouched(engine):
    engine.add_request("early", {"prompt_token_ids": [1, 2, 3]}, _params(1, n=2))
    done = _run(engine)  # finished before the bad one arrives
    engine.add_request("bad", {"prompt_token_ids": [5, 6, 7, 8]}, _params(POISON_SEED))
    done |= _run(engine)
    assert done["early"].outputs[0].finish_reason == "length"
    assert done["bad"].outputs[0].finish_reason == "error"


def test_poisoned_requests_in_a_batch_end_alone_and_the_others_are_unchanged(engine):
    """Two culprits in one batch: each is found alone and ends with "error", the engine goes on, and the
    front-end sees the others' fault-free tokens, each once."""
    prompts = random_prompts(4, seed=7)
    for i, p in enumerate(prompts):
        engine.add_request(f"ref{i}", {"prompt_token_ids": p}, GREEDY)
    reference = _run(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"good{i}", {"prompt_token_ids": p}, GREEDY)
    engine.step()  # the good ones have streamed tokens when the batch fails
    engine.add_request("bad0", {"prompt_token_ids": [5, 6, 7, 8]}, _params(POISON_SEED))
    engine.add_request("bad1", {"prompt_token_ids": [9, 6, 7]}, _params(POISON_SEED))
    done = _run(engine)
    assert {rid: done[rid].outputs[0].finish_reason for rid in ("bad0", "bad1")} == {"bad0": "error", "bad1": "error"}
    for i in range(len(prompts)):
        assert done[f"good{i}"].outputs[0].finish_reason == "length"
        assert done[f"good{i}"].outputs[0].token_ids == reference[f"ref{i}"].outputs[0].token_ids
    assert engine.core.scheduler.num_preemptions >= len(prompts)  # they were recomputed
    assert engine.core.kv_cache.usage() == 0.0 and not engine.core.scheduler.suspects


def _core(path: str, async_scheduling: bool) -> EngineCore:
    args = EngineArgs(model=path, dtype="float32", kv_cache_memory_gib=0.05, async_scheduling=async_scheduling)
    return EngineCore(args.create_engine_config())


def _drain(core: EngineCore, tokens: dict[str, list[int]], reasons: dict[str, str], steps: int = 200) -> None:
    for _ in range(steps):
        if not core.has_unfinished_requests():
            return
        for out in core.step().outputs:
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.req_id] = out.finish_reason


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_bad_request_in_a_batch_ends_alone_with_the_others_tokens_unchanged(tiny_model_dir, async_scheduling):
    """The bad request arrives while the others decode, with a new one ("late"): the model raises on its
    prompt in a step they all share. Late's prompt fills blocks the failed step never wrote: the prefix
    cache must not hand them back when it is recomputed."""
    core = _core(tiny_model_dir("llama"), async_scheduling)
    try:
        prompts = random_prompts(4, low=10, high=40, seed=9) + random_prompts(1, low=40, high=41, seed=11)
        reference: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            core.add_request(CoreRequest(f"r{i}", p, GREEDY, 0.0))
        _drain(core, reference, {})
        core.kv_cache.reset_prefix_cache()
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        for i, p in enumerate(prompts[:-1]):
            core.add_request(CoreRequest(f"r{i}", p, GREEDY, 1.0))
        _drain(core, tokens, reasons, steps=3)
        assert any(tokens.values())  # tokens already streamed before the fault
        core.add_request(CoreRequest("bad", [5, BAD_TOKEN, 7], GREEDY, 2.0))
        core.add_request(CoreRequest(f"r{len(prompts) - 1}", prompts[-1], GREEDY, 3.0))
        _drain(core, tokens, reasons)
        assert reasons == {"bad": "error", **{f"r{i}": "length" for i in range(len(prompts))}}
        assert tokens == {"bad": [], **reference}  # none lost, none sent twice
        assert core.scheduler.num_preemptions >= len(prompts)
        assert core.kv_cache.usage() == 0.0 and not core.scheduler.suspects
    finally:
        core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_fault_in_every_step_still_ends_the_engine(tiny_model_dir, async_scheduling, monkeypatch):
    """A broken device: the batch fails, then its suspects fail alone one after another. The batch and its
    first culprit are one fault; the third fault in a row ends the engine."""
    core = _core(tiny_model_dir("llama"), async_scheduling)
    try:
        real = core.executor.execute_model

        def broken(sched):
            if not sched.is_empty:
                raise RuntimeError("injected device fault")
            return real(sched)

        monkeypatch.setattr(core.executor, "execute_model", broken)
        for i, p in enumerate(random_prompts(4, seed=10)):
            core.add_request(CoreRequest(f"r{i}", p, GREEDY, float(i)))
        ended: list[str] = []
        with pytest.raises(RuntimeError, match="steps in a row failed"):
            for _ in range(10):
                ended += [out.req_id for out in core.step().outputs if out.finish_reason == "error"]
        assert ended == ["r0", "r1"]  # the suspects, alone in arrival order; r2's failure was the third
    finally:
        core.shutdown()


def test_three_failed_steps_in_a_row_stop_the_engine(engine):
    for i in range(engine_core.MAX_FAILED_STEPS):
        engine.add_request(f"bad{i}", {"prompt_token_ids": [5, 6, 7, 8]}, _params(POISON_SEED))
    scheduler = engine.core.scheduler
    scheduler.config = replace(scheduler.config, max_num_seqs=1)  # each step runs, and fails, one of them
    with pytest.raises(RuntimeError, match="steps in a row failed"):
        for _ in range(engine_core.MAX_FAILED_STEPS):
            engine.step()


def test_a_request_the_core_cannot_take_ends_alone(engine, monkeypatch):
    scheduler = engine.core.scheduler
    real_add = scheduler.add_request

    def add_or_fail(request):
        real_add(request)  # registered first: the failure must also undo what was done
        if request.request_id == "odd":
            raise KeyError("injected fault while adding one request")

    monkeypatch.setattr(scheduler, "add_request", add_or_fail)
    rejected = engine.core.try_add_request(CoreRequest("odd", [1, 2, 3], _params(1), 0.0))
    assert rejected is not None and rejected.finish_reason == "error" and rejected.req_id == "odd"
    assert not engine.core.has_unfinished_requests() and not scheduler.has_unfinished()
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7, 8]}, _params(1))
    assert _run(engine)["good"].outputs[0].finish_reason == "length"
