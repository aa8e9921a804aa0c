"""One worker, in the engine core's own process: every call is a plain method call."""
from __future__ import annotations

from pressroom.config import EngineConfig
from pressroom.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from pressroom.executor.abstract import Executor
from pressroom.spec_decode import make_proposer
from pressroom.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.driver_worker: Worker | None = Worker(config, make_proposer)

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.driver_worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self.driver_worker.execute_model(sched)

    def shutdown(self) -> None:
        if self.driver_worker is not None:
            self.driver_worker.shutdown()
            self.driver_worker = None
