"""What the engine's processes set up first: children that cannot outlive their parent, a relaxed GC."""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import signal


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
