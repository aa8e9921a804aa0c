"""Executors: how the engine core reaches its workers (see abstract.py)."""
from __future__ import annotations

from pressroom.config import EngineConfig
from pressroom.executor.abstract import Executor, WorkerDiedError

FATAL_ERRORS = (WorkerDiedError,)  # failures that end the engine, not just the step's requests


def make_executor(config: EngineConfig) -> Executor:
    """`distributed_executor_backend` "uni": the worker runs in this process; "mp": one process per rank;
    "ray": one Ray actor per rank, on the nodes of a Ray cluster."""
    if config.parallel.distributed_executor_backend == "ray":
        from pressroom.executor.ray_executor import RayExecutor
        return RayExecutor(config)
    if config.parallel.distributed_executor_backend == "mp":
        from pressroom.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(config)
    from pressroom.executor.uniproc import UniProcExecutor
    return UniProcExecutor(config)
