"""Tensor-parallel group state. World size 1 for now; layers already shard by these numbers."""
from __future__ import annotations

import torch


def get_tp_size() -> int:
    return 1


def get_tp_rank() -> int:
    return 0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return x  # one rank: nothing to reduce


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x
