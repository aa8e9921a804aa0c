"""Facts about the hardware pressroom runs on, read once (CPU tiers in cpu.py; CUDA's presence here), and the
set-up an engine's start gives its process (set_up_process)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pressroom.platforms.cpu import log_cpu_path


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (asked without creating a CUDA context)."""
    return torch.cuda.is_available()


def set_up_process(device: str, num_threads: int | None, asked_dtype: str, dtype: torch.dtype) -> None:
    """What an engine's start does to its process: torch's CPU threads (None: torch's own) and, on the CPU,
    one start-up line saying which path runs and why."""
    if num_threads:
        torch.set_num_threads(num_threads)
    if device == "cpu":
        log_cpu_path(asked_dtype, dtype)


def set_up_worker_threads(device: str, num_threads: int | None, world_size: int) -> None:
    """torch's CPU threads for one rank's worker, which may run in a process of its own and so does not
    inherit its caller's setting: the configured count, else on the CPU with several ranks an even share of
    the cores (ranks share them rather than each taking them all), else torch's own."""
    if num_threads:
        torch.set_num_threads(num_threads)
    elif world_size > 1 and device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def user_cache_dir(name: str) -> Path:
    """pressroom's folder `name` in the user's cache: under $PRESSROOM_CACHE, else ~/.cache/pressroom."""
    root = os.environ.get("PRESSROOM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pressroom")
    return Path(root) / name
