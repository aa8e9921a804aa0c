"""DFlash2's block drafter: K draft slots in one forward pass, conditioned on the target's own features.

Inputs: the residual stream of a few target layers at the last verified context positions (fused
into the drafter's width), and the anchor, the newest verified token (the target's embedding of it,
added to K learned slot embeddings). Each layer lets the block attend to the context and to itself
with no causal mask (every slot sees every other), then mixes neighbouring slots with a grouped
dynamic depthwise convolution,

    out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c],   t < kernel,

whose per-slot weights `delta` are computed from the slot itself (one set per channel group g(c)).
The target's frozen LM head turns the slots into logits; `selector.py` picks the path through each
slot's top-M candidates. Not wired into a proposer yet, and not trained yet (`pressroom train-drafter`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class DFlash2Config:
    block_size: int = 8  # K: draft slots per forward pass
    target_layers: tuple[int, ...] = (1, 15, 28)  # whose residual stream is the context
    num_layers: int = 1
    num_heads: int = 8
    conv_kernel_size: int = 3
    conv_group_size: int = 64  # channels that share one dynamic weight
    top_m: int = 8  # selector candidates per slot
    rank: int = 32  # selector transition rank

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_layers < 1 or self.conv_kernel_size < 1 or not self.target_layers:
            raise ValueError("DFlash2Config needs block_size, num_layers, conv_kernel_size >= 1 and target layers.")


class GroupedDynamicConv(nn.Module):
    def __init__(self, width: int, kernel: int, group_size: int) -> None:
        super().__init__()
        if width % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide the width {width}.")
        self.kernel, self.group_size = kernel, group_size
        base = torch.zeros(kernel, width)
        base[0] = 1.0  # starts as the identity: the slot itself
        self.base = nn.Parameter(base)
        self.delta = nn.Linear(width, kernel * (width // group_size))
        nn.init.zeros_(self.delta.weight)
        nn.init.zeros_(self.delta.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, K, width] -> the same shape; slot i mixes slots i - kernel + 1 .. i."""
        b, k, width = x.shape
        delta = self.delta(x).view(b, k, self.kernel, width // self.group_size)
        weights = self.base + delta.repeat_interleave(self.group_size, dim=-1)  # [b, K, kernel, width]
        padded = F.pad(x, (0, 0, self.kernel - 1, 0))  # zeros before the first slot
        shifted = torch.stack([padded[:, self.kernel - 1 - t:self.kernel - 1 - t + k] for t in range(self.kernel)],
                              dim=2)  # [b, K, kernel, width]: shifted[:, i, t] = x[:, i - t]
        return (weights * shifted).sum(dim=2)


class BlockLayer(nn.Module):
    def __init__(self, width: int, cfg: DFlash2Config) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.attn_norm = nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.conv_norm = nn.RMSNorm(width)
        self.conv = GroupedDynamicConv(width, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_norm = nn.RMSNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))

    def forward(self, block: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        """block: [b, K, w]; context: [b, C, w] with context_mask [b, C] (False: padding)."""
        b, k, w = block.shape
        h = self.attn_norm(torch.cat([context, block], dim=1))
        q, key, value = self.qkv(h).chunk(3, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, w // self.heads).transpose(1, 2)

        visible = torch.cat([context_mask, torch.ones(b, k, dtype=torch.bool, device=block.device)], dim=1)
        o = F.scaled_dot_product_attention(heads(q[:, -k:]), heads(key), heads(value),
                                           attn_mask=visible[:, None, None, :])  # no causal mask inside the block
        block = block + self.out(o.transpose(1, 2).reshape(b, k, w))
        block = block + self.conv(self.conv_norm(block))
        return block + self.mlp(self.mlp_norm(block))


class DFlash2Drafter(nn.Module):
    def __init__(self, width: int, cfg: DFlash2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fuse = nn.Linear(len(cfg.target_layers) * width, width, bias=False)
        self.slots = nn.Parameter(torch.randn(cfg.block_size, width) * 0.02)
        self.layers = nn.ModuleList(BlockLayer(width, cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(width)

    def forward(self, features: torch.Tensor, context_mask: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """features: [b, C, layers * w] target features of the last C verified positions (mask False for
        padding); anchor: [b, w] the target's embedding of the newest verified token. Returns [b, K, w],
        one hidden state per draft slot, for the target's LM head."""
        context = self.fuse(features)
        block = anchor[:, None, :] + self.slots
        for layer in self.layers:
            block = layer(block, context, context_mask)
        return self.norm(block)
