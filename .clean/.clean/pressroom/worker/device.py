"""Host-to-device copies that never wait for the GPU.

A copy from pageable host memory makes CUDA synchronise the stream first, so the CPU would wait
for the step in flight; staging through pinned memory lets it queue the copy and move on.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
