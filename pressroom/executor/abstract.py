"""The executor: how the engine core reaches its workers, one per rank.

The core calls the same methods whether its worker lives in this process (`UniProcExecutor`) or one
process per rank (`MultiprocExecutor`): find the memory the KV cache can have (the smallest over ranks),
initialise the cache, warm up, execute steps, shut down. Every rank runs every call; the driver
(rank 0) answers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

from pressroom.config import EngineConfig
from pressroom.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from pressroom.worker.worker import ModelSpec, StepCosts


class WorkerDiedError(RuntimeError):
    """A worker process exited: the engine cannot run steps any more."""


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, *args) -> list:
        """Runs `Worker.<method>(*args)` on every rank; their answers, by rank."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """One step on every rank; the driver's output (still on its way under async scheduling)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Frees every rank's device memory and ends worker processes; idempotent."""

    def load_model(self) -> ModelSpec:
        """The driver's spec, with the largest per-block KV bytes of any rank (heads may split unevenly)."""
        specs = self.collective_rpc("load_model")
        return replace(specs[0], kv_bytes_per_block=max(s.kv_bytes_per_block for s in specs),
                       state_bytes_per_slot=max(s.state_bytes_per_slot for s in specs))

    def determine_available_memory(self) -> int:
        return min(self.collective_rpc("determine_available_memory"))

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int, num_state_slots: int = 1) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks, max_model_len, num_state_slots)

    def compile_or_warm_up_model(self) -> bool:
        return self.collective_rpc("compile_or_warm_up_model")[0]

    def discard_inflight(self) -> None:
        """Forgets the device-side carry-over of steps that failed (their requests are ended)."""
        self.collective_rpc("discard_inflight")

    def profile_step_costs(self, max_drafts: int, max_model_len: int) -> StepCosts:
        return self.collective_rpc("profile_step_costs", max_drafts, max_model_len)[0]
