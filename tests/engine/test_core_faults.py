"""A step that raises ends only the requests it ran, with finish_reason "error"; the engine goes on serving.
Three failures in a row are the engine's, not a request's: then it stops. A request the core cannot take
ends alone too.

Faults are injected where a request's own sampling parameters are read (the host sampler), with a marker
seed no other request uses."""
from __future__ import annotations

import pytest

from pressroom import LLMEngine, SamplingParams
from pressroom.config import EngineArgs
from pressroom.engine import core as engine_core
from pressroom.engine.core import CoreRequest
from pressroom.worker import model_runner

POISON_SEED = 4242


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


def test_three_failed_steps_in_a_row_stop_the_engine(engine):
    for i in range(engine_core.MAX_FAILED_STEPS):
        engine.add_request(f"bad{i}", {"prompt_token_ids": [5, 6, 7, 8]}, _params(POISON_SEED))
    engine.core.scheduler.config.max_num_seqs = 1  # each step runs, and fails, one of them
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
