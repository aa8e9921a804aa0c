"""The experts' gated activation over their gate and up halves: SwiGLU (silu(gate) * up), gpt-oss's clamped
form, or DeepSeek-V4's (SwiGLU on clamped halves). The torch forms
here are what the experts' CPU paths run and what the Triton kernels (kernels/triton/fused_moe.py) are tested
against."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True, frozen=True)
class ClampedSwiglu:
    """gpt-oss's experts (HF GptOssExperts): the gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.limit <= 0:
            raise ValueError(f"the clamped SwiGLU's limit must be positive, got {self.limit}.")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # HF's order of operations


@dataclass(slots=True, frozen=True)
class LimitedSwiglu:
    """DeepSeek-V4's experts (HF DeepseekV4Experts, `swiglu_limit`): the gate clamped above at `limit`, up to
    [-limit, limit], then silu(gate) * up."""
    limit: float = 10.0

    def __post_init__(self) -> None:
        if self.limit <= 0:
            raise ValueError(f"the SwiGLU limit must be positive, got {self.limit}.")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


def gated(gate: torch.Tensor, up: torch.Tensor, clamped: ClampedSwiglu | LimitedSwiglu | None = None
          ) -> torch.Tensor:
    """SwiGLU, or `clamped`'s form where given."""
    return F.silu(gate) * up if clamped is None else clamped(gate, up)


@dataclass(slots=True, frozen=True)
class Relu2:
    """Nemotron-H's experts: no gate half, relu(up)² between the up and down projections."""

    def __call__(self, up: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(up))
