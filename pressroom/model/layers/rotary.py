"""Rotary position embedding (NeoX / HF "rotate_half" layout) with Llama-3 and linear scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from pressroom.kernels import cpu


def _inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        inv = _llama3_inv_freq(inv, scaling)
    elif kind not in ("default", "linear"):
        raise ValueError(f"rope scaling type {kind!r} is not supported yet.")
    return inv


def _llama3_inv_freq(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv = _inv_freq(rotary_dim, base, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
            positions = positions / scaling["factor"]
        freqs = torch.outer(positions, inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token fp32 tables [tokens, rotary_dim / 2], looked up once per step for every layer."""
        return self.cos[positions], self.sin[positions]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim], q and k heads may come stacked; rotated in place where a kernel can."""
        if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            if x.is_cuda:
                from pressroom.kernels.triton.rotary import rotary_
                return rotary_(x, cos, sin, self.rotary_dim)
            if cpu.supports(x):
                return cpu.rotary_(x, cos, sin, self.rotary_dim)
        return self.rotate_reference(x, cos, sin)

    def rotate_reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        rot = x[..., :self.rotary_dim]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim < self.head_dim:
            out = torch.cat((out, x[..., self.rotary_dim:]), dim=-1)
        return out
