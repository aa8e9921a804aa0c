"""Data parallelism: several engine cores behind one front-end, each a full copy of the model (with its own
tensor-parallel ranks) and its own KV cache, as vLLM's `--data-parallel-size`.

`DPCoreClient` speaks for them with CoreClient's interface. A request goes to the rank it names
(`data_parallel_rank`), else to the core serving the fewest requests, unless the core that took the last
request with the same opening tokens is at most a few requests busier: requests that share a prefix (a
system prompt, a document) then share that core's prefix cache. The siblings of an n > 1 request follow
their lead. Outputs arrive from every core on one poller; a core that dies ends the whole engine.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import replace

import zmq

from pressroom.config import EngineConfig
from pressroom.core.request import RequestStatus
from pressroom.engine.core import CoreOutputs, CoreRequest
from pressroom.engine.core_client import CoreClient, EngineDeadError

AFFINITY_TOKENS = 64  # the opening tokens that name a shared prefix
AFFINITY_SLACK = 4  # how many requests busier than the least busy core an affine core may be
_AFFINITY_ENTRIES = 4096


class DPCoreClient:
    EOS_FUTURE = True  # as CoreClient: every core starts at once and is sent the id when the Future has it

    def __init__(self, config: EngineConfig, eos_token_id: int | None | Future, start_timeout: float = 600.0) -> None:
        size = config.parallel.data_parallel_size
        self.clients: list[CoreClient] = []
        try:
            for rank in range(size):  # started side by side, then waited for
                self.clients.append(CoreClient(rank_config(config, rank), eos_token_id, start_timeout, wait=False))
            for client in self.clients:
                client.wait_ready(start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.info = self.clients[0].info
        self.load = [0] * size  # requests in flight per core
        self._rank_of: dict[str, int] = {}
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._poller = zmq.Poller()
        for client in self.clients:
            self._poller.register(client.output_socket, zmq.POLLIN)
        self._next = 0  # the core read first when several have messages waiting

    def add_request(self, request: CoreRequest) -> None:
        rank = request.data_parallel_rank
        if rank is None:
            rank = self._rank_of.get(request.follows) if request.follows else None
        if rank is None:
            rank = self._balanced(request.prompt_token_ids)
        self.clients[rank].add_request(request)
        self._rank_of[request.req_id] = rank
        self.load[rank] += 1

    def _balanced(self, token_ids: list[int]) -> int:
        key = hashlib.blake2b(repr(token_ids[:AFFINITY_TOKENS]).encode(), digest_size=16).digest()
        least = min(range(len(self.load)), key=self.load.__getitem__)
        preferred = self._affinity.get(key)
        rank = preferred if preferred is not None and self.load[preferred] <= self.load[least] + AFFINITY_SLACK \
            else least
        self._affinity[key] = rank
        self._affinity.move_to_end(key)
        if len(self._affinity) > _AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return rank

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        by_rank: dict[int, list[str]] = {}
        for req_id in req_ids:
            rank = self._forget(req_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(req_id)
        for rank, ids in by_rank.items():
            self.clients[rank].finish_requests(ids, status)

    def _forget(self, req_id: str) -> int | None:
        rank = self._rank_of.pop(req_id, None)
        if rank is not None:
            self.load[rank] -= 1
        return rank

    def reset_prefix_cache(self) -> None:
        for client in self.clients:
            client.reset_prefix_cache()

    def sleep(self, level: int, mode: str) -> None:
        """Every core sleeps; each answers (a message with `reply` set)."""
        for client in self.clients:
            client.sleep(level, mode)

    def wake_up(self, tags: list[str] | None) -> None:
        for client in self.clients:
            client.wake_up(tags)

    def recv(self, timeout_ms: int = 500) -> CoreOutputs | None:
        """The next message from any core (cores take turns), or None after `timeout_ms` of silence;
        EngineDeadError once any core is gone."""
        ready = dict(self._poller.poll(timeout_ms))
        n = len(self.clients)
        for i in range(n):
            rank = (self._next + i) % n
            if self.clients[rank].output_socket in ready:
                self._next = rank + 1
                step = self.clients[rank].recv(0)
                if step is not None:
                    step.engine_index = rank
                    for out in step.outputs:
                        if out.finish_reason is not None:
                            self._forget(out.req_id)
                return step
        for rank, client in enumerate(self.clients):
            if not client.process.is_alive():  # (not recv: a message arriving just now would be lost)
                raise EngineDeadError(f"Engine core {rank} died (exit code {client.process.exitcode}).")
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        for client in self.clients:
            client.shutdown(timeout)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One core's config: its data-parallel rank (CUDA: its own GPUs) and, on the CPU, its share of the cores."""
    parallel = replace(config.parallel, data_parallel_rank=rank)
    threads = config.num_threads
    if threads is None and config.device == "cpu":
        threads = max(1, (os.cpu_count() or 1) // config.parallel.data_parallel_size)
    return replace(config, parallel=parallel, num_threads=threads)
