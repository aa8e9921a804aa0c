"""One worker process per rank, driven over ZMQ (ipc).

The executor PUSHes each call (method and arguments, pickled) to every rank and PULLs their answers
from one socket; each rank answers its calls in the order they came. Under async scheduling a worker
launches step N + 1 before it sends step N's output (it waits for N's tokens to reach the host only
then), so the device runs while the engine core schedules; the executor asks for a held step's output
with a flush when it has nothing newer to send.

A worker that dies, or fails, ends the engine: the executor notices within half a second and raises
WorkerDiedError. Workers die with the process that started them.
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections import deque

import zmq

from pressroom.config import EngineConfig
from pressroom.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from pressroom.executor.abstract import Executor, WorkerDiedError
from pressroom.executor.process import die_with_parent, relax_gc, start_process, worker_start_method
from pressroom.spec_decode import make_proposer
from pressroom.worker.worker import Worker

logger = logging.getLogger("pressroom")

_FLUSH, _READY = b"flush", b"ready"
_OK, _ERROR = b"ok", b"error"
_POLL_MS = 500


class _Call:
    """One call sent to every rank, waiting for their answers."""
    __slots__ = ("method", "results", "remaining", "error")

    def __init__(self, method: str, world_size: int) -> None:
        self.method, self.results, self.remaining = method, [None] * world_size, world_size
        self.error: BaseException | None = None


class RemoteOutput(AsyncModelRunnerOutput):
    """A step launched on the workers; `resolve` waits for the driver's answer."""
    __slots__ = ("_executor", "_call")

    def __init__(self, executor: MultiprocExecutor, call: _Call) -> None:
        self._executor, self._call = executor, call

    def resolve(self) -> ModelRunnerOutput:
        return self._executor.wait(self._call)[0]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, start_timeout: float = 600.0) -> None:
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self._dir = tempfile.mkdtemp(prefix="pressroom-workers-")
        results_addr = f"ipc://{self._dir}/results"
        input_addrs = [f"ipc://{self._dir}/rank{rank}" for rank in range(self.world_size)]
        dist_init = f"file://{self._dir}/tensor-parallel"  # where the ranks meet to form their process group
        # The workers start before this process makes zmq's threads (a fork must find it single-threaded);
        # their sockets connect before ours bind, and zmq retries until they do.
        self.start_method = worker_start_method()
        self.processes = [start_process(run_worker, (config, rank, addr, results_addr, os.getpid(), dist_init),
                                        f"pressroom-worker-{rank}", self.start_method)
                          for rank, addr in enumerate(input_addrs)]
        logger.info("%d worker processes started (%s)", self.world_size,
                    "forked" if self.start_method == "fork" else "fresh interpreters")
        self._zmq = zmq.Context()
        self._results = self._zmq.socket(zmq.PULL)
        self._results.bind(results_addr)
        self._inputs = []
        for addr in input_addrs:
            sock = self._zmq.socket(zmq.PUSH)
            sock.bind(addr)
            self._inputs.append(sock)
        self._pending: list[deque[_Call]] = [deque() for _ in range(self.world_size)]
        self._last_sent: _Call | None = None
        self._flushed = False
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        ready, deadline = set(), time.monotonic() + timeout
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Worker processes did not start within {timeout:.0f} s.")
            if self._results.poll(_POLL_MS):
                rank, kind, _ = self._results.recv_multipart()
                if kind == _READY:
                    ready.add(int(rank))
            else:
                self._check_alive()

    # ---- calls ----

    def _send(self, method: str, *args) -> _Call:
        call, message = _Call(method, self.world_size), pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, sock in enumerate(self._inputs):
            self._pending[rank].append(call)
            sock.send(message)
        self._last_sent, self._flushed = call, False
        return call

    def wait(self, call: _Call) -> list:
        """The call's answers by rank, once every rank has given its own."""
        while call.remaining:
            if call is self._last_sent and not self._flushed:  # a worker may hold it until the next call
                for sock in self._inputs:
                    sock.send(_FLUSH)
                self._flushed = True
            if self._results.poll(_POLL_MS):
                self._receive()
            else:
                self._check_alive()
        if call.error is not None:
            raise call.error
        return call.results

    def _receive(self) -> None:
        rank, kind, payload = self._results.recv_multipart()
        r = int(rank)
        call = self._pending[r].popleft()
        if kind == _OK:
            call.results[r] = pickle.loads(payload)
        elif call.error is None:
            call.error = _unpickled_error(payload, r, call.method)
        call.remaining -= 1

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                raise WorkerDiedError(f"Worker process {rank} died (exit code {proc.exitcode}).")

    def collective_rpc(self, method: str, *args) -> list:
        return self.wait(self._send(method, *args))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        call = self._send("execute_model", sched)
        if self.config.scheduler.async_scheduling:
            return RemoteOutput(self, call)
        return self.wait(call)[0]

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self.processes:
            return
        try:
            if all(p.is_alive() for p in self.processes):
                self.collective_rpc("shutdown")  # frees device memory before the processes go
        except (WorkerDiedError, RuntimeError) as e:
            logger.warning("worker shutdown: %s", e)
        for proc in self.processes:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        self.processes = []
        for sock in (*self._inputs, self._results):
            sock.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _unpickled_error(payload: bytes, rank: int, method: str) -> BaseException:
    error, text = pickle.loads(payload)
    if isinstance(error, ValueError):  # a configuration the worker rejects stays a ValueError for the caller
        return error
    return RuntimeError(f"Worker {rank} failed in {method}: {text}")


# ---- the worker process ----

def run_worker(config: EngineConfig, rank: int, in_addr: str, out_addr: str, parent_pid: int,
               distributed_init_method: str | None = None) -> None:
    die_with_parent()
    relax_gc()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent shuts us down
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(in_addr)
    out.connect(out_addr)
    tag = str(rank).encode()
    try:
        out.send_multipart([tag, _READY, b""])
        _serve(Worker(config, make_proposer, rank, distributed_init_method), inp, out, tag, parent_pid)
    finally:
        inp.close(linger=0)
        out.close(linger=2000)  # let a last answer leave
        ctx.term()


def _serve(worker: Worker, inp, out, tag: bytes, parent_pid: int) -> None:
    held: AsyncModelRunnerOutput | None = None  # a launched step whose answer waits for the next message

    def answer(fn, *args) -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 — the executor must hear of any failure
            logger.exception("worker %s failed", tag.decode())
            out.send_multipart([tag, _ERROR, _pickled_error(e)])
            return
        out.send_multipart([tag, _OK, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)])

    while True:
        if not inp.poll(1000):
            if os.getppid() != parent_pid:
                return
            continue
        message = inp.recv()
        if message == _FLUSH:
            if held is not None:
                answer(held.resolve)
                held = None
            continue
        method, args = pickle.loads(message)
        if method == "execute_model":
            try:
                result = worker.execute_model(*args)
            except BaseException as e:  # noqa: BLE001
                result = e
            if held is not None:  # the step before: its answer comes first
                answer(held.resolve)
                held = None
            if isinstance(result, AsyncModelRunnerOutput):
                held = result
            else:
                answer(_returning, result)
            continue
        if held is not None:
            answer(held.resolve)
            held = None
        answer(getattr(worker, method), *args)
        if method == "shutdown":
            return


def _returning(result):
    if isinstance(result, BaseException):
        raise result
    return result


def _pickled_error(e: BaseException) -> bytes:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    try:
        return pickle.dumps((e, text))
    except Exception:  # noqa: BLE001 — an exception that does not pickle still gets its text through
        return pickle.dumps((None, text))
