"""Work on a client's input that may run away (chat templates, grammars), done in child processes that may die.

A `WorkerPool` keeps a few copies of one worker script, run by path with `python -I` (no user site, none of
Python's environment variables, none of the server's imports or memory), each killed by the kernel if the server
dies. Each takes one job at a time: a JSON
line in, a JSON line out. At start the pool writes the script its set-up bytes (if any) and waits for a first
line that says it is ready ({"ready": true}); then the worker's address space is capped at what it maps by
then plus the pool's `max_bytes` (so the cap is the job's, whatever the script's imports map), and it runs
niced from then on, so that a job burning its deadline yields the cores to the engine.

A job past its deadline, or whose worker died (over its memory cap, or crashed), or whose reply overflows the
pipe's limit, kills that worker (a replacement starts in the background) and raises a `WorkerError` that says
which; a job cancelled midway kills its worker too, since its reply would be the next job's. A reply that says
{"retire": true} (a worker that ran into its memory cap, whose state the failed allocation may have left
half-made) is returned, and its worker replaced. Every worker busy for `wait_s`: `PoolBusy`, the server
overloaded rather than the request wrong.

Worker scripts import only the standard library and what their job needs, never pressroom: anything the
process holds, a job can reach.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("pressroom")

START_TIMEOUT_S = 120.0  # a worker's imports (xgrammar's pull in torch) on a machine busy serving
WAIT_FOR_WORKER_S = 10.0
REPLY_LIMIT = 64 << 20  # bytes of one reply line; a longer one fails the job (and costs its worker)
NICENESS = 10


class WorkerError(Exception):
    """A job that cost its worker; the message says why, for the client."""


class WorkerTimeout(WorkerError):
    pass


class WorkerFailed(WorkerError):
    """The worker died (over its memory cap, or crashed) or its reply could not be read."""


class PoolBusy(Exception):
    """Every worker stayed busy for the pool's wait."""


# How a worker starts: bound to die with the server (Linux's parent-death signal, so that a job in progress does not
# outlive a server killed outright), then its script, run as __main__ with its own arguments.
_BOOT = """
import os, runpy, sys
parent, script = int(sys.argv[1]), sys.argv[2]
if sys.platform == "linux":
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != parent:  # the server died before that took hold
    sys.exit(1)
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def job_line(job: dict) -> bytes:
    """A job as the workers read it; json.dumps's RecursionError or ValueError for what JSON cannot hold."""
    return json.dumps(job).encode() + b"\n"  # newlines in strings are escaped: one job, one line


class _Worker:
    """One worker process; one job at a time."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, argv: Sequence[str], setup: bytes, max_bytes: int) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _BOOT, str(os.getpid()), *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=REPLY_LIMIT)
        worker = cls(process)
        try:
            if setup:
                process.stdin.write(setup)
            ready = await worker.ask(b"", START_TIMEOUT_S)
            if not ready.get("ready"):
                raise WorkerFailed(f"the worker did not start: {ready.get('error', ready)}")
            _cap_memory(process.pid, max_bytes)
            _nice(process.pid)  # not before: on a busy machine a niced start took seconds, while jobs queued
        except BaseException:
            await worker.stop()
            raise
        return worker

    async def ask(self, job: bytes, timeout: float) -> dict:
        try:
            self.process.stdin.write(job)
            await self.process.stdin.drain()
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
            if not line:
                raise WorkerFailed("the worker exited")
            return json.loads(line)
        except TimeoutError:
            raise WorkerTimeout(f"no reply within {timeout:g} s") from None
        except (OSError, ValueError) as e:  # a broken pipe, a reply over REPLY_LIMIT, or not JSON
            raise WorkerFailed(f"the worker's reply could not be read ({type(e).__name__})") from None

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


def _nice(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, NICENESS)


def _cap_memory(pid: int, max_bytes: int) -> None:
    """Caps the worker's address space at what it maps now (its interpreter and imports) plus `max_bytes`."""
    import resource
    if hasattr(resource, "prlimit"):  # Linux
        limit = _mapped_bytes(pid) + max_bytes
        resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


def _mapped_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmSize in /proc/{pid}/status")


class WorkerPool:
    """`size` processes of `script` (run with `args` after it); each job is one JSON line, answered within
    `timeout_s` by one JSON object, or its worker is killed and replaced. Workers start at the first job (or
    `start`), in the running event loop."""

    def __init__(self, script: str | Path, args: Sequence[str] = (), *, size: int, timeout_s: float,
                 max_bytes: int, setup: bytes = b"", wait_s: float = WAIT_FOR_WORKER_S) -> None:
        self.argv = (str(script), *map(str, args))
        self.size, self.timeout_s, self.max_bytes, self.setup, self.wait_s = size, timeout_s, max_bytes, setup, wait_s
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: set[_Worker] = set()
        self._replacing: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self._idle is None:
            self._idle = idle = asyncio.Queue()
            try:
                for worker in await asyncio.gather(*(self._spawn() for _ in range(self.size))):
                    idle.put_nowait(worker)
            except BaseException:
                await self.close()  # the next job tries again
                raise

    async def close(self) -> None:
        workers, self._workers, self._idle = list(self._workers), set(), None
        for task in self._replacing:
            task.cancel()
        await asyncio.gather(*self._replacing, *(w.stop() for w in workers), return_exceptions=True)

    async def ask(self, job: bytes) -> dict:
        """The reply to `job` (a `job_line`); WorkerError when the job cost its worker, PoolBusy when no worker
        came free."""
        await self.start()
        idle = self._idle
        try:
            worker = await asyncio.wait_for(idle.get(), self.wait_s)
        except TimeoutError:
            raise PoolBusy(f"every worker stayed busy for {self.wait_s:g} s") from None
        try:
            reply = await worker.ask(job, self.timeout_s)
        except BaseException:  # a timeout, a dead worker, or the job cancelled midway: its reply is lost
            self._replace_later(worker)
            raise
        if reply.get("retire"):
            self._replace_later(worker)
        elif idle is self._idle:  # else the pool was closed meanwhile, which stopped the worker
            idle.put_nowait(worker)
        return reply

    async def _spawn(self) -> _Worker:
        worker = await _Worker.start(self.argv, self.setup, self.max_bytes)
        self._workers.add(worker)
        return worker

    def _replace_later(self, worker: _Worker) -> None:
        task = asyncio.ensure_future(self._replace(worker))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self, worker: _Worker) -> None:
        self._workers.discard(worker)
        idle = self._idle
        await worker.stop()
        try:
            fresh = await self._spawn()
        except Exception:  # noqa: BLE001 — a pool one short still serves; the log says why
            logger.exception("a replacement for a killed %s worker failed to start", Path(self.argv[0]).stem)
            return
        if idle is not None and idle is self._idle:  # not closed meanwhile
            idle.put_nowait(fresh)
        else:
            self._workers.discard(fresh)
            await fresh.stop()
