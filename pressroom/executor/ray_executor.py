"""Workers as Ray actors, one per rank, placed by a placement group (one bundle per rank), across the nodes
of a Ray cluster: `--distributed-executor-backend ray`.

pressroom joins the cluster RAY_ADDRESS names (a cluster started with `ray start --head` on the first node
and `ray start --address HEAD:6379` on the others), or starts a local one. The ranks form their
torch.distributed group over TCP at rank 0's node. Every call goes to every actor (in order: an actor runs
its calls one at a time); the driver's answer is rank 0's. Under async scheduling a step's answer is an
object reference the engine resolves after it has scheduled the next step. An actor that dies (its node
lost, its process killed) ends the engine with WorkerDiedError; actors die with the engine core that owns
them (Ray's fate-sharing).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace

from pressroom.config import EngineConfig
from pressroom.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from pressroom.executor.abstract import Executor, WorkerDiedError
from pressroom.executor.process import relax_gc

logger = logging.getLogger("pressroom")


class RayWorker:
    """The actor: a Worker built once the group's address is known (rank 0's node)."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        relax_gc()
        self.config, self.rank, self.worker = config, rank, None

    def node_and_free_port(self) -> tuple[str, int, str]:
        import ray
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, ray.get_runtime_context().get_node_id()

    def start(self, init_method: str) -> None:
        from pressroom.spec_decode import make_proposer
        from pressroom.worker.worker import Worker
        self.worker = Worker(self.config, make_proposer, self.rank, init_method)

    def call(self, method: str, *args):
        result = getattr(self.worker, method)(*args)
        if isinstance(result, AsyncModelRunnerOutput):  # the device step is launched: its answer goes back now
            result = result.resolve()
        return result


class _RayOutput(AsyncModelRunnerOutput):
    __slots__ = ("_ref", "_executor", "_result")

    def __init__(self, executor: RayExecutor, ref) -> None:
        self._executor, self._ref, self._result = executor, ref, None

    def resolve(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self._executor.get([self._ref])[0]
        return self._result


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address or None, ignore_reinit_error=True, log_to_driver=False)
        world = config.parallel.world_size
        unit = {"GPU": 1} if config.device == "cuda" else {"CPU": 1}
        self._group = placement_group([dict(unit) for _ in range(world)])
        ray.get(self._group.ready(), timeout=300)
        actor = ray.remote(RayWorker)
        # a rank has the one core of its bundle unless told otherwise
        rank_config = config if config.num_threads else replace(config, num_threads=1)
        self.actors = [
            actor.options(num_cpus=unit.get("CPU", 0), num_gpus=unit.get("GPU", 0),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, i)).remote(rank_config, i)
            for i in range(world)]
        try:
            places = self.get([a.node_and_free_port.remote() for a in self.actors])
            self.nodes = [node for _, _, node in places]
            host, port, _ = places[0]
            self.get([a.start.remote(f"tcp://{host}:{port}") for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray executor: %d ranks on %d node(s)", world, len(set(self.nodes)))

    def get(self, refs: list) -> list:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"A Ray worker died: {e}") from None
        except self._ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, ValueError) else RuntimeError(str(e))) from None

    def collective_rpc(self, method: str, *args) -> list:
        return self.get([a.call.remote(method, *args) for a in self.actors])

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        refs = [a.call.remote("execute_model", sched) for a in self.actors]
        if self.config.scheduler.async_scheduling:
            return _RayOutput(self, refs[0])
        return self.get(refs)[0]

    def shutdown(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "_group", None) is not None:
            ray.util.remove_placement_group(self._group)
            self._group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
