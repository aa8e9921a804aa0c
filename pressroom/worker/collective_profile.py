"""How long a rank spends in collectives (all-reduces, all-gathers) over the steps it runs, from torch.profiler:
on CUDA the NCCL kernels' device time (CUDA graphs replay them, so no host-side timer sees them), on the CPU
the gloo transfers' wall time (it includes waiting for the slowest rank)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = {"all_reduce": ("allreduce", "all_reduce"), "all_gather": ("allgather", "all_gather")}


@dataclass(slots=True)
class CollectiveProfile:
    device: str
    profiler: profile
    steps: int = 0

    @classmethod
    def start(cls, device: str) -> CollectiveProfile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        profiler = profile(activities=activities)
        profiler.__enter__()
        return cls(device, profiler)

    def stop(self) -> dict:
        """{kind: {"calls", "seconds"}} per collective kind, and "steps": model steps run meanwhile."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        out = {kind: {"calls": 0, "seconds": 0.0} for kind in KINDS}
        for event in self.profiler.events():
            kind = _kind(event.name)
            if kind is None or not self._counts(event):
                continue
            out[kind]["calls"] += 1
            out[kind]["seconds"] += event.time_range.elapsed_us() * 1e-6
        return {**out, "steps": self.steps}

    def _counts(self, event) -> bool:
        """NCCL's kernels on CUDA; on the CPU gloo's own record of the transfer, on its worker thread (the
        caller's `c10d::` op only enqueues it)."""
        if self.device == "cuda":
            return event.device_type == DeviceType.CUDA
        return event.name.startswith("gloo:")


def _kind(name: str) -> str | None:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS.items() if any(k in lowered for k in keys)), None)
