"""Mamba2's mixer as an engine layer: in_proj, the causal depthwise conv, the SSD scan and the output gate (with or
without Mamba2's grouped RMSNorm), over a flat varlen batch whose per-request conv and SSM states live in slot pools
(layers/state.py). One class serves every family that carries the HF Mamba2 mixer's weights (Nemotron-H, Falcon-H1,
and the attention-free Mamba2 could): `Mamba2MixerConfig` says where they differ.

Prefill rows go through the packed varlen kernels (Triton's on CUDA, kernels/triton/ssm_prefill.py; elsewhere the
torch forms of kernels/ssm.py, one chunked SSD scan per request); decode rows (one token each) step their slots with
the batched pool kernels (Triton's on CUDA, kernels/triton/ssm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.state import StateRound
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.kernels import ssm
from pressroom.model.layers import state
from pressroom.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pressroom.model.layers.state import RecurrentLayer, StateShape


@dataclass(frozen=True)
class Mamba2MixerConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    norm_eps: float
    # the output gate: "norm_gated" RMSNorm(y * silu(z)) (Mamba2, Nemotron-H), "gated_norm" RMSNorm(y) * silu(z)
    # (Falcon-H1's norm_before_gate), "gated" y * silu(z) with no norm (Falcon-H1 without mamba_rms_norm)
    gate: str = "norm_gated"
    dt_limit: tuple[float, float] = ssm.DT_LIMIT  # clamps dt in prefill only, as HF and mamba_ssm's step do
    in_multiplier: float = 1.0  # Falcon-H1: the input is scaled before in_proj
    # Falcon-H1's muP: in_proj's [z, x, B, C, dt] outputs scaled, each part by its own factor
    proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        if self.gate not in ("norm_gated", "gated_norm", "gated"):
            raise ValueError(f"unknown Mamba2 output gate {self.gate!r}.")
        if self.num_heads % self.n_groups:
            raise ValueError(f"{self.num_heads} Mamba2 heads do not split into {self.n_groups} groups.")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


class DepthwiseConv(nn.Module):
    """The causal conv's parameters, shaped as HF's nn.Conv1d holds them (weight [channels, 1, width])."""

    def __init__(self, channels: int, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class OutputGate(nn.Module):
    """silu(z) gating of the scan output, with RMSNorm over groups of d_inner // n_groups channels (fp32 inside)
    before or after it, or none."""

    def __init__(self, cfg: Mamba2MixerConfig) -> None:
        super().__init__()
        self.kind, self.eps, self.group_size = cfg.gate, cfg.norm_eps, cfg.d_inner // cfg.n_groups
        self.weight = nn.Parameter(torch.ones(cfg.d_inner), requires_grad=False) if cfg.gate != "gated" else None

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.kind == "norm_gated":
            return ssm.gated_rms_norm(y, z, self.weight, self.eps, self.group_size)
        if self.kind == "gated":
            return y * F.silu(z)
        # Falcon-H1's order: normalized, weighted and gated in fp32, rounded once at the end
        h = y.float().unflatten(-1, (-1, self.group_size))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (self.weight * h * F.silu(z.float())).to(y.dtype)


class Mamba2Mixer(RecurrentLayer):
    """x [tokens, hidden] -> [tokens, hidden]. Parameter names are HF's (in_proj, conv1d, dt_bias, A_log, D,
    norm, out_proj), so checkpoints load by name."""

    def __init__(self, cfg: Mamba2MixerConfig) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError("the Mamba2 mixer does not support tensor parallelism yet.")
        self.cfg = cfg
        self.state_dtype = torch.get_default_dtype()  # the conv state's: the model's dtype
        heads = cfg.num_heads
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, cfg.d_inner + cfg.conv_dim + heads, cfg.in_proj_bias)
        self.conv1d = DepthwiseConv(cfg.conv_dim, cfg.conv_kernel, cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(heads), requires_grad=False)
        self.norm = OutputGate(cfg)
        self.out_proj = RowParallelLinear(cfg.d_inner, cfg.hidden_size, cfg.out_proj_bias)
        scaled = any(m != 1.0 for m in cfg.proj_multipliers)
        self.register_buffer("proj_scale", _proj_scale(cfg) if scaled else None, persistent=False)

    def state_shapes(self) -> dict[str, StateShape]:
        c = self.cfg
        return {"conv": StateShape((c.conv_dim, c.conv_kernel - 1), self.state_dtype),
                "ssm": StateShape((c.num_heads, c.head_dim, c.d_state), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.in_multiplier != 1.0:
            x = x * c.in_multiplier
        proj = self.in_proj(x)
        if self.proj_scale is not None:
            proj = proj * self.proj_scale
        z, xBC, dt = proj.split([c.d_inner, c.conv_dim, c.num_heads], dim=-1)
        y = self.run_rounds(self._mix, xBC, dt)
        return self.out_proj(self.norm(y, z))

    def _mix(self, r: StateRound, xBC: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One round: its decode rows (the first num_decodes, one token each) stepped at once, then its prefill
        chunks scanned. Returns the scan's output with D's skip, [tokens, d_inner]."""
        nd = r.num_decodes
        if nd == r.num_tokens:
            return self._decode(xBC, dt, r.slots)
        if nd == 0:
            return self._prefill(xBC, dt, r.cu_seqlens, r.slots)
        out = xBC.new_empty(xBC.shape[0], self.cfg.d_inner)
        out[:nd] = self._decode(xBC[:nd], dt[:nd], r.slots[:nd])
        out[nd:] = self._prefill(xBC[nd:], dt[nd:], r.cu_seqlens[nd:] - nd, r.slots[nd:])
        return out

    def _decode(self, xBC: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        kernels = state.pool_kernels(xBC)
        xBC = kernels.causal_conv1d_update_pool(xBC, self.states["conv"], slots, self.conv1d.weight[:, 0],
                                                self.conv1d.bias)
        x, B, C = self._split(xBC)
        # no dt clamp: HF's decode step and mamba_ssm's Mamba2.step do not apply time_step_limit
        y = kernels.ssd_state_update_pool(self.states["ssm"], slots, x, dt, self._A(), B, C, self.D, self.dt_bias)
        return y.flatten(1)

    def _prefill(self, xBC: torch.Tensor, dt: torch.Tensor, cu_seqlens: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        """Packed prefill chunks, cu_seqlens on the device (int32): Triton's kernels on CUDA, the torch varlen
        forms elsewhere (they split the batch on the host, scanning in the config's chunk length as HF does)."""
        c = self.cfg
        kernels = state.prefill_kernels(xBC)
        xBC = kernels.causal_conv1d_varlen(xBC, cu_seqlens, self.conv1d.weight[:, 0], self.conv1d.bias,
                                           self.states["conv"], slots)
        x, B, C = self._split(xBC)
        chunking = {} if kernels is not ssm else {"chunk_size": c.chunk_size}  # Triton's SSD has its own
        y = kernels.ssd_varlen(x, dt, self._A(), B, C, cu_seqlens, self.states["ssm"], slots, self.D, self.dt_bias,
                               dt_limit=c.dt_limit, **chunking)
        return y.flatten(1)

    def _split(self, xBC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output -> x [tokens, heads, head_dim], B and C [tokens, n_groups, d_state]."""
        c = self.cfg
        group_dim = c.n_groups * c.d_state
        x, B, C = xBC.split([c.d_inner, group_dim, group_dim], dim=-1)
        return (x.unflatten(-1, (c.num_heads, c.head_dim)), B.unflatten(-1, (c.n_groups, c.d_state)),
                C.unflatten(-1, (c.n_groups, c.d_state)))

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())


def _proj_scale(cfg: Mamba2MixerConfig) -> torch.Tensor:
    """in_proj's output multipliers as one vector over [z, x, B, C, dt] (Falcon-H1's mup_vector)."""
    group_dim = cfg.n_groups * cfg.d_state
    sizes = [cfg.d_inner, cfg.d_inner, group_dim, group_dim, cfg.num_heads]
    return torch.cat([torch.full((n,), m) for n, m in zip(sizes, cfg.proj_multipliers)])


