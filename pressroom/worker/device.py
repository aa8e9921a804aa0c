"""Host-to-device copies that never wait for the GPU.

A copy from pageable host memory makes CUDA synchronise the stream first, so the CPU would wait
for the step in flight; staging through pinned memory lets it queue the copy and move on.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)  # already on a device (a draft fed back): no host copy to stage
    return t.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work (a no-op on the CPU, whose work is done when it returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
