"""The tensor-parallel group: which rank this process is, of how many, and the two collectives the layers
need. One rank (the default, and the in-process executor) needs no process group: the collectives return
their input. With more, each worker process joins the group (gloo on the CPU, NCCL on CUDA) before it builds
its model, so every layer shards by these numbers from the start.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_RANK, _SIZE, _EXPERT_PARALLEL = 0, 1, False


def init_tensor_parallel(rank: int, world_size: int, device: str, init_method: str,
                         expert_parallel: bool = False) -> None:
    """Joins this process to the tensor-parallel group (every rank calls it, with the same `init_method`).
    `expert_parallel`: mixture-of-experts layers split their experts over the ranks instead of each
    expert's matrices."""
    global _RANK, _SIZE, _EXPERT_PARALLEL
    if world_size > 1:
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _RANK, _SIZE, _EXPERT_PARALLEL = rank, world_size, expert_parallel


def destroy_tensor_parallel() -> None:
    global _RANK, _SIZE, _EXPERT_PARALLEL
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _EXPERT_PARALLEL = 0, 1, False


def expert_parallel() -> bool:
    return _EXPERT_PARALLEL and _SIZE > 1


def get_tp_size() -> int:
    return _SIZE


def get_tp_rank() -> int:
    return _RANK


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x` (in place)."""
    if _SIZE > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` (equal shapes), concatenated along `dim` in rank order."""
    if _SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim)
