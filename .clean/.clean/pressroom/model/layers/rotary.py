"""Rotary position embedding (NeoX / HF "rotate_half" layout) with Llama-3, linear and YaRN scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from pressroom.kernels import cpu


def _inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies, and the factor cos and sin are scaled by (YaRN's attention factor; else 1)."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        return _llama3_inv_freq(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(inv, rotary_dim, base, scaling), _yarn_attention_factor(scaling)
    if kind not in ("default", "linear"):
        raise ValueError(f"rope scaling type {kind!r} is not supported yet.")
    return inv, 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek: the all-dims part moves into the softmax scale
        return yarn_mscale(s["factor"], mscale) / yarn_mscale(s["factor"], mscale_all_dim)
    return yarn_mscale(s["factor"])


def _yarn_inv_freq(inv: torch.Tensor, rotary_dim: int, base: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that turn many times over the original context keep their value (extrapolation),
    slow ones are divided by the factor (interpolation), with a linear ramp between the dimensions where
    beta_fast and beta_slow rotations fit into the original context."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


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
        inv, magnitude = _inv_freq(rotary_dim, base, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
            positions = positions / scaling["factor"]
        freqs = torch.outer(positions, inv)
        self.register_buffer("cos", freqs.cos() * magnitude, persistent=False)
        self.register_buffer("sin", freqs.sin() * magnitude, persistent=False)

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
        if self.rotary_dim < x.shape[-1]:
            out = torch.cat((out, x[..., self.rotary_dim:]), dim=-1)
        return out
