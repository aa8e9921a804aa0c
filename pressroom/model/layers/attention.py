"""The attention layer models call: it reads the step's metadata and its own cache slice."""
from __future__ import annotations

import torch
from torch import nn

from pressroom.attention.backend import AttentionBackend, get_attention_metadata


class Attention(nn.Module):
    """`latent` (multi-head latent attention): the cache holds one vector per token and KV head, the keys,
    and the values are their first `v_head_dim` dimensions, so the cache has one plane, not two."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 v_head_dim: int | None = None, latent: bool = False, extra_dim: int = 0,
                 sliding_window: int | None = None) -> None:
        """`extra_dim`: values a latent cache keeps per token after the keys (DSA's indexer keys), which
        only the layer that owns them reads; `sliding_window`: a query at position p sees keys at positions
        > p - sliding_window only (HF's and llama.cpp's convention), None: every earlier key."""
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.v_head_dim = v_head_dim or head_dim
        self.latent, self.extra_dim = latent, extra_dim
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.block_size = 0  # tokens per block of kv_cache, set with it
        self.backend: AttentionBackend | None = None

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1 if self.latent else 2, num_blocks, block_size, self.num_kv_heads, self.head_dim + self.extra_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None, see_ahead: torch.Tensor | None = None) -> torch.Tensor:
        """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim], v [tokens, kv_heads, v_head_dim]
        (latent: None, the values are k's first v_head_dim dimensions) -> [tokens, heads * v_head_dim];
        `sinks` [heads]: gpt-oss's per-head logit in the softmax's denominator (the backend's contract);
        `see_ahead` [tokens] int64: keys past its own each query token also sees, all in the step (Gemma 3's
        image tokens: the rest of their image); None: causal. Only backends with `sees_ahead` take it."""
        if self.latent:
            v = k[..., :self.v_head_dim]
        meta = get_attention_metadata()
        if see_ahead is not None:
            if not getattr(self.backend, "sees_ahead", False):
                raise ValueError(f"{type(self.backend).__name__} has no bidirectional span mask (Gemma 3's image "
                                 "tokens).")
            out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, sinks,
                                       see_ahead=see_ahead)
        else:
            out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, sinks)
        return out.flatten(1)

    def attends_cached(self) -> bool:
        """Whether the backend can attend over entries the layer wrote into its cache itself (`forward_cached`)."""
        return hasattr(self.backend, "attend_cached")

    def forward_cached(self, q: torch.Tensor) -> torch.Tensor:
        """forward for a layer that wrote this step's entries into its cache itself (MLA's prepare kernel):
        q [tokens, heads, head_dim] -> [tokens, heads * v_head_dim]."""
        out = self.backend.attend_cached(q, self.kv_cache, get_attention_metadata(), self.scale, self.v_head_dim,
                                         self.sliding_window)
        return out.flatten(1)
