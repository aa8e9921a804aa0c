"""The attention layer models call: it reads the step's metadata and its own cache slice."""
from __future__ import annotations

import torch
from torch import nn

from pressroom.attention.backend import AttentionBackend, get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.backend.forward(q, k, v, self.kv_cache, get_attention_metadata(), self.scale)
        return out.flatten(1)
