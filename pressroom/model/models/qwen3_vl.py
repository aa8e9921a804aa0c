"""Qwen3-VL: Qwen2.5-VL's design with a plainer tower and a Qwen3 decoder. The tower: a biased patch embedding
plus a learned position table resized (bilinear, corners aligned) to each image's grid, full attention blocks with
LayerNorm and a GELU MLP, the patch merger, and DeepStack: mergers at a few tower layers whose rows are added to the
first decoder layers' outputs at the image tokens. The decoder: Qwen3's (q/k norms) with interleaved M-RoPE.

The encoder's rows for an image are [merged | deepstack 1 | ... | deepstack n] side by side, so the encoder cache
and chunked prefill carry the DeepStack features with the embeddings (qwen2_5_vl.py's forward adds them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.model.models.qwen2_5_vl import (
    BlockDiagonal,
    PatchEmbed,
    Qwen2_5_VLForConditionalGeneration,
    Segments,
    VisionAttention,
    frame_bounds,
    pad_rows,
    padded_frame_ids,
)

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = _ACTS[act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = Qwen3VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """`postshuffle_norm` (DeepStack's mergers): the norm runs over the merged row, else over each patch."""

    def __init__(self, config, postshuffle_norm: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.width if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle_norm else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(config.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, postshuffle_norm=False)
        self.deepstack_layers = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(config, postshuffle_norm=True)
                                                   for _ in self.deepstack_layers)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Every image's rows, [merged | DeepStack features ...] side by side."""
        device = pixels.device
        cos, sin = self._rotary(grids, device)
        return self._run(pixels, self._position_embeddings(grids), cos, sin, Segments(frame_bounds(grids), device))

    def _run(self, pixels: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             frames) -> torch.Tensor:
        x = self.patch_embed(pixels) + positions.to(pixels.dtype)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_layers:
                deep.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)

    # ---- fixed shapes (encoder CUDA graphs): patches padded to a bucket ----

    def padded_inputs(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]], patches: int
                      ) -> dict[str, torch.Tensor] | None:
        """`static_forward`'s inputs padded to `patches` rows (None: more patches than that); padding patches
        form frames of their own, after the real ones (qwen2_5_vl.py's VisionTransformer.padded_inputs)."""
        if pixels.shape[0] > patches:
            return None
        device = pixels.device
        cos, sin = self._rotary(grids, device)
        return {"pixels": pad_rows(pixels, patches),
                "positions": pad_rows(self._position_embeddings(grids).to(pixels.dtype), patches),
                "cos": pad_rows(cos, patches), "sin": pad_rows(sin, patches),
                "frame_ids": padded_frame_ids(grids, patches, device)}

    def static_forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._run(inputs["pixels"], inputs["positions"], inputs["cos"], inputs["sin"],
                         BlockDiagonal(inputs["frame_ids"]))

    def _merge_order(self, grid: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] per-patch values in the processor's merge-block order, repeated for each frame."""
        m = self.merge
        blocks = grid.view(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
        return blocks.repeat(t, 1)

    def _position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        out = []
        for t, h, w in grids:
            resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
            out.append(self._merge_order(resized, t, h, w))
        return torch.cat(out)

    def _rotary(self, grids: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
            rows.append(self._merge_order(hw, t, h, w))
        pos = torch.cat(rows).to(device)
        freqs = pos[..., None].float() * self.inv_freq.to(device)
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    qk_norm = True
    text_attention_bias = None  # as the config says (Qwen3: none)
    interleaved_mrope = True

    def make_vision_tower(self, vision_config) -> nn.Module:
        return Qwen3VisionTransformer(vision_config)
