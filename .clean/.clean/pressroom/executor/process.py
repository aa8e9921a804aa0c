"""Child processes that cannot outlive their parent."""
from __future__ import annotations

import ctypes
import multiprocessing
import signal


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL when the parent goes, however it goes (callers also check the
    parent's pid in their loops, for other systems)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def allow_children() -> None:
    """Our parent started us as a daemon (ended at its exit), which multiprocessing takes to mean we may
    not start processes of our own; we may: ours die with us (die_with_parent) and we end them first."""
    multiprocessing.current_process().daemon = False
