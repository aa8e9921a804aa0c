"""The multiprocess executor (a worker process per rank, driven over ZMQ) gives the same tokens as the
in-process one, in every scheduling mode, and a worker's death ends the engine with an error, not a hang."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from conftest import random_prompts

from pressroom import LLM, SamplingParams
from pressroom.executor import WorkerDiedError
from pressroom.executor.multiproc import MultiprocExecutor


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def _generate(llm: LLM, prompts, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("engine", [
    {"async_scheduling": False},
    {"async_scheduling": True},
    {"async_scheduling": False, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
], ids=["sync", "async", "ngram"])
def test_multiproc_matches_uniproc(tiny_llama, engine):
    shared = random_prompts(1, low=40, high=41, seed=5)[0]
    prompts = random_prompts(6, low=3, high=60, seed=4) + [shared + p for p in random_prompts(3, seed=6)]
    runs = {}
    for backend in ("uni", "mp"):
        with LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=48,
                 distributed_executor_backend=backend, **engine) as llm:
            if backend == "mp":
                assert isinstance(llm.engine.core.executor, MultiprocExecutor)
                assert llm.engine.core.executor.processes[0].is_alive()
            runs[backend] = _generate(llm, prompts)
    assert runs["mp"] == runs["uni"]
    assert all(len(t) == 12 for t in runs["mp"])


def test_worker_death_fails_the_engine_and_shutdown_leaves_no_process(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, distributed_executor_backend="mp")
    executor = llm.engine.core.executor
    pid = executor.processes[0].pid
    assert _generate(llm, random_prompts(2, seed=1), 4)  # it works first
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="died"):
        _generate(llm, random_prompts(2, seed=2), 4)
    assert time.monotonic() - start < 5
    llm.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not executor.processes


def test_shutdown_ends_worker_processes(tiny_llama):
    with LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, distributed_executor_backend="mp") as llm:
        proc = llm.engine.core.executor.processes[0]
        assert proc.is_alive()
    proc.join(5)
    assert not proc.is_alive() and proc.exitcode == 0  # it exited on its own, not killed


def test_unknown_backend_is_a_clear_error():
    from pressroom.config import ParallelConfig
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of uni, mp"):
        ParallelConfig(distributed_executor_backend="ray-ish")


def _threads_in_a_fresh_worker(config, queue) -> None:
    from pressroom.worker.worker import Worker
    Worker(config, lambda spec, runner: None)
    queue.put(torch.get_num_threads())


def test_num_threads_reaches_a_worker_in_another_process(tiny_llama):
    """--num-threads is applied where the model runs, not only in the process that parsed it."""
    import multiprocessing

    from pressroom.config import EngineArgs
    config = EngineArgs(model=tiny_llama, num_threads=1).create_engine_config()
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    child = spawn.Process(target=_threads_in_a_fresh_worker, args=(config, queue))
    child.start()
    assert queue.get(timeout=120) == 1
    child.join(30)
