"""What the engine's processes set up first (children that cannot outlive their parent, a relaxed GC), and how
worker processes start (forked where safe, else fresh interpreters that never import the user's script)."""
from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger("pressroom")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` when the parent goes, however it goes (callers also check the
    parent's pid in their loops, for other systems). A process with something to clean up asks for
    SIGTERM and handles it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def allow_children() -> None:
    """Our parent started us as a daemon (ended at its exit), which multiprocessing takes to mean we may
    not start processes of our own; we may: ours die with us (die_with_parent) and we end them first."""
    multiprocessing.current_process().daemon = False


def relax_gc() -> None:
    """Cyclic-GC passes over the engine's many long-lived objects took half of the host's time per step
    at 1,000 requests (benchmarks/host_overhead.py), in the engine core and in a worker process alike:
    collect the young generation 14x less often, and the old ones rarely. Only raised, never lowered;
    cycles are still collected (gc.freeze would keep a deleted engine's cycles, and its GPU memory,
    alive)."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, 10_000), max(middle, 20), max(old, 100))


# ---- starting worker processes: vLLM's VLLM_WORKER_MULTIPROC_METHOD, safe for unguarded scripts ----

WORKER_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_METHODS = ("fork", "spawn")


class FreshProcess:
    """A worker in a fresh interpreter that imports only pressroom and runs `target(*args)`.

    multiprocessing's spawn re-imports the parent's `__main__`: a script that builds an LLM at module level,
    with no `if __name__ == "__main__":` guard, would build it again in every worker (and fail there). This
    child never imports the script. It has the Process methods the executors use."""

    def __init__(self, target: Callable, args: tuple, name: str) -> None:
        self.name = name
        bootstrap = ("import pickle, sys; stdin = sys.stdin.buffer; sys.path[:] = pickle.load(stdin); "
                     "target, args = pickle.load(stdin); sys.stdin.close(); target(*args)")
        self._popen = subprocess.Popen([sys.executable, "-c", bootstrap], stdin=subprocess.PIPE, close_fds=True)
        with self._popen.stdin as pipe:  # the parent's sys.path, as spawn passes it: pressroom is found alike
            pickle.dump(list(sys.path), pipe, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.dump((target, args), pipe, protocol=pickle.HIGHEST_PROTOCOL)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


def worker_start_method() -> str:
    """"fork" or "spawn" as VLLM_WORKER_MULTIPROC_METHOD asks (vLLM's default: fork). A fork is taken only where
    it is safe, as vLLM forces spawn where it is not: a process with other threads (OpenMP's, zmq's, a
    tokenizer's) would hand the child locks no thread will release (torch's OpenMP pool hangs the child's
    first parallel op), and CUDA cannot be used in a child forked after it was initialized."""
    asked = os.environ.get(WORKER_METHOD_ENV, "fork").strip().lower()
    if asked not in _METHODS:
        raise ValueError(f"{WORKER_METHOD_ENV}={asked!r} is not a start method; use one of {', '.join(_METHODS)}.")
    if asked == "fork":
        hazard = fork_hazard()
        if hazard is not None:
            logger.info("workers start in fresh interpreters, not forked: %s", hazard)
            return "spawn"
    return asked


def fork_hazard() -> str | None:
    """Why forking this process now is unsafe, or None."""
    if not sys.platform.startswith("linux"):
        return f"forking is only taken on Linux (this is {sys.platform})"
    threads = _thread_count()
    if threads != 1:
        return f"this process runs {threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized in this process"
    return None


def start_process(target: Callable, args: tuple, name: str, method: str):
    """`target(*args)` in a child process: forked (a daemon of multiprocessing's), or a FreshProcess."""
    if method == "fork":
        proc = multiprocessing.get_context("fork").Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        return proc
    return FreshProcess(target, args, name)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
