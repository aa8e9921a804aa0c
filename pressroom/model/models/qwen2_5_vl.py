"""Qwen2.5-VL: a ViT over dynamic-resolution patches (windowed and full attention blocks, 2D rotary, a patch merger)
whose output rows replace the prompt's image tokens, and the Qwen2 decoder with M-RoPE (three position rows, time,
height and width, rotating sections of each head).

The runner calls `encode_media` for the images a step needs (their rows are kept in its encoder cache),
`mrope_positions` once per request (a prompt's three position rows and the offset its generated tokens take), and
`forward` with the step's media rows (multimodal/inputs.py's MediaRows) and the [3, tokens] positions.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pressroom.model.layers.rotary import RotaryEmbedding
from pressroom.model.models.llama import LlamaForCausalLM, RopeTables
from pressroom.multimodal.inputs import MediaItem, MediaRows

_TEXT_ATTRS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
               "rms_norm_eps", "intermediate_size", "num_key_value_heads")


def lift_text_config(hf_config: Any, attention_bias: bool | None = True) -> None:
    """The language model's shape on the top-level config too, where the engine reads it (vocab size, context).
    `attention_bias`: set on the text config (Qwen2 biases q, k and v); None: as the config says."""
    text = hf_config.text_config
    if attention_bias is not None:
        text.attention_bias = attention_bias
    for name in _TEXT_ATTRS:
        if getattr(hf_config, name, None) is None and getattr(text, name, None) is not None:
            setattr(hf_config, name, getattr(text, name))
    hf_config.sliding_window = None  # Qwen2.5-VL's text layers attend fully (use_sliding_window false)


# ---- the vision tower ----

class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        """x: [patches, dim]; each patch attends to the patches of its segment (an image, a frame or a window)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segments.attend(q, k, v).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config, bias: bool = False) -> None:
        """`bias`: Qwen3-VL's patch projection has one, Qwen2.5-VL's not."""
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=self.shape[1:],
                              stride=self.shape[1:], bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [patches, C * T * P * P] as the processor flattens them -> [patches, hidden]."""
        x = pixels.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.width = context_dim * merge * merge
        self.ln_q = VisionRMSNorm(context_dim)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.merge, self.patch_size, self.window_size = config.spatial_merge_size, config.patch_size, config.window_size
        self.full_blocks = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels: every image's patches back to back; returns their merged rows, in the same order."""
        device = pixels.device
        window_index, window_bounds = self._window_index(grids)
        cos, sin = self._rotary(grids, device)
        full_bounds = frame_bounds(grids)
        return self._run(pixels, window_index.to(device), torch.argsort(window_index).to(device), cos, sin,
                         Segments(full_bounds, device), Segments(window_bounds, device))

    def _run(self, pixels: torch.Tensor, window_index: torch.Tensor, window_order: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, full, windows) -> torch.Tensor:
        """The tower over patches (padded or not) whose windows and frames `windows` and `full` attend within."""
        unit = self.merge * self.merge
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[window_index].reshape(n, -1)
        cos = cos.view(n // unit, unit, -1)[window_index].reshape(n, -1)
        sin = sin.view(n // unit, unit, -1)[window_index].reshape(n, -1)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.full_blocks else windows)
        return self.merger(x)[window_order]

    # ---- fixed shapes (encoder CUDA graphs): patches padded to a bucket ----

    def window_runs(self, patches: int) -> int:
        """Attention windows a bucket of `patches` holds: twice its patches in whole windows (a window at an
        image's edge is partial), at least 16 (each small image has a window of its own)."""
        return max(16, 2 * patches // self._window_patches())

    def _window_patches(self) -> int:
        side = self.window_size // self.merge // self.patch_size
        return side * side * self.merge * self.merge

    def padded_inputs(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]], patches: int
                      ) -> dict[str, torch.Tensor] | None:
        """`static_forward`'s inputs with the images' patches padded to `patches` rows, every tensor's shape
        fixed by `patches` alone; None where they do not fit (more patches or windows than the bucket holds).
        Padding patches sit after the real ones, in no window and in frames of their own: no real patch
        attends to them, and the merged rows they make come after the real ones."""
        n, unit = pixels.shape[0], self.merge * self.merge
        window_index, window_bounds = self._window_index(grids)
        runs = self.window_runs(patches)
        if n > patches or len(window_bounds) - 1 > runs:
            return None
        device = pixels.device
        rows = torch.arange(n // unit, patches // unit)  # padding merged rows keep their place
        window_index = torch.cat([window_index, rows])
        cos, sin = self._rotary(grids, device)
        return {"pixels": pad_rows(pixels, patches), "window_index": window_index.to(device),
                "window_order": torch.argsort(window_index).to(device),
                "cos": pad_rows(cos, patches), "sin": pad_rows(sin, patches),
                "frame_ids": padded_frame_ids(grids, patches, device),
                **StaticSegments.plan(window_bounds, runs, self._window_patches(), patches, device)}

    def static_forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tower at `padded_inputs`' fixed shapes (what a CUDA graph captures): [patches / merge^2, out]."""
        windows = StaticSegments(inputs["run_index"], inputs["run_mask"], inputs["run_scatter"])
        return self._run(inputs["pixels"], inputs["window_index"], inputs["window_order"], inputs["cos"],
                         inputs["sin"], BlockDiagonal(inputs["frame_ids"]), windows)

    def _rotary(self, grids: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (h, w) angles, in the processor's merge-block order: [patches, head_dim] cos and sin."""
        m = self.merge
        rows = []
        for t, h, w in grids:
            hh = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            ww = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            rows.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
        pos = torch.cat(rows).to(device)
        freqs = pos[..., None].float() * self.inv_freq.to(device)  # [patches, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()

    def _window_index(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, np.ndarray]:
        """The order that puts each attention window's merged rows together, and the windows' patch bounds."""
        side = self.window_size // self.merge // self.patch_size  # merged rows per window side
        unit = self.merge * self.merge
        order, bounds, base = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).view(t, gh, gw)
            pad_h, pad_w = side - gh % side, side - gw % side
            padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
            nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
            windows = padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
            sizes = (windows >= 0).sum(-1).reshape(-1)
            flat = windows.reshape(-1)
            order.append(flat[flat >= 0] + base)
            bounds.extend((bounds[-1] + np.cumsum(sizes.numpy()) * unit).tolist())
            base += t * gh * gw
        return torch.cat(order), np.unique(np.asarray(bounds))


class Segments:
    """Packed patch runs [bounds[i], bounds[i + 1]) that attend within themselves, gathered into one padded batch
    (keys past a run's end masked): memory grows with runs x longest run squared, not with all patches squared
    as a block-diagonal mask over the whole pack would."""

    def __init__(self, bounds: np.ndarray, device) -> None:
        lengths = np.diff(np.asarray(bounds))
        self.single = len(lengths) == 1
        offsets = np.arange(lengths.max())
        valid = offsets[None] < lengths[:, None]
        self.index = torch.from_numpy(np.where(valid, np.asarray(bounds)[:-1, None] + offsets, 0)).to(device)
        self.valid = torch.from_numpy(valid).to(device)
        self.key_mask = None if valid.all() else self.valid[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [patches, heads, head_dim] -> [patches, heads, head_dim]."""
        if self.single:
            return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
                                                  ).transpose(0, 1)
        q, k, v = (t[self.index].transpose(1, 2) for t in (q, k, v))  # [runs, heads, longest, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.key_mask)
        return out.transpose(1, 2)[self.valid]


def frame_bounds(grids: list[tuple[int, int, int]]) -> np.ndarray:
    """Each frame's (an image is one) patch bounds, back to back: the runs full attention stays within."""
    return np.cumsum([0] + [h * w for t, h, w in grids for _ in range(t)])


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, rows - x.shape[0]))


def padded_frame_ids(grids: list[tuple[int, int, int]], patches: int, device) -> torch.Tensor:
    """Each patch's frame number; each padding patch a frame of its own (negative), so it attends to itself only."""
    lengths = np.diff(frame_bounds(grids))
    ids = np.repeat(np.arange(len(lengths)), lengths)
    pad = -1 - np.arange(patches - len(ids))
    return torch.from_numpy(np.concatenate([ids, pad])).to(device)


class BlockDiagonal:
    """Full attention within each frame at a fixed shape: one pass over all the patches, a key counting where its
    frame is the query's. Costs patches^2 whatever the frames, so it serves the bucketed (graph) path only, for
    the few full-attention blocks; Segments is the eager path's."""

    def __init__(self, frame_ids: torch.Tensor) -> None:
        self.mask = frame_ids[:, None] == frame_ids[None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, patches, head_dim]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)[0].transpose(0, 1)


class StaticSegments:
    """Segments at a fixed shape: `runs` x `longest` gathered slots whatever the images. A slot past its run's end
    (whole runs past the last, too) is masked as a key and its output written to a dump row past the patches;
    padding patches are in no run (their attention output is 0). Tensors from `plan`, which a CUDA graph reads."""

    def __init__(self, index: torch.Tensor, key_mask: torch.Tensor, scatter: torch.Tensor) -> None:
        self.index, self.key_mask, self.scatter = index, key_mask, scatter

    @staticmethod
    def plan(bounds: np.ndarray, runs: int, longest: int, patches: int, device) -> dict[str, torch.Tensor]:
        """run_index [runs, longest] (patch of each slot; 0 where none), run_mask [runs, 1, 1, longest] (a slot's
        key counts; each run's first always, so no row is masked whole), run_scatter [runs * longest] (where
        each slot's output goes; `patches`, the dump row, where none)."""
        lengths = np.zeros(runs, dtype=np.int64)
        starts = np.zeros(runs, dtype=np.int64)
        lengths[:len(bounds) - 1], starts[:len(bounds) - 1] = np.diff(bounds), np.asarray(bounds)[:-1]
        offsets = np.arange(longest)
        valid = offsets[None] < lengths[:, None]
        index = np.where(valid, starts[:, None] + offsets, 0)
        mask = valid | (offsets[None] == 0)
        scatter = np.where(valid, index, patches).reshape(-1)
        return {"run_index": torch.from_numpy(index).to(device),
                "run_mask": torch.from_numpy(mask)[:, None, None, :].to(device),
                "run_scatter": torch.from_numpy(scatter).to(device)}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, heads, dim = q.shape
        g = [t[self.index].transpose(1, 2) for t in (q, k, v)]  # [runs, heads, longest, head_dim]
        out = F.scaled_dot_product_attention(*g, attn_mask=self.key_mask).transpose(1, 2).reshape(-1, heads, dim)
        return q.new_zeros(n + 1, heads, dim).index_copy_(0, self.scatter, out)[:n]


# ---- M-RoPE ----

class MRotaryEmbedding(RotaryEmbedding):
    """Rotary tables whose frequency sections read the time, height and width position rows in turn."""

    def __init__(self, head_dim: int, max_position: int, base: float, sections: list[int],
                 interleaved: bool = False) -> None:
        """`interleaved` (Qwen3-VL): frequencies take t, h, w in turn (h and w up to 3x their sections' sizes),
        else (Qwen2.5-VL) each section is a contiguous run of frequencies."""
        super().__init__(head_dim, head_dim, max_position, base)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} must add up to head_dim / 2 = {head_dim // 2}.")
        if interleaved:
            j = torch.arange(head_dim // 2)
            section_of = torch.where((j % 3 == 1) & (j < 3 * sections[1]), 1, 0)
            section_of = torch.where((j % 3 == 2) & (j < 3 * sections[2]), 2, section_of)
        else:
            section_of = torch.from_numpy(np.repeat(np.arange(3), sections))  # numpy: builds on the meta device too
        self.register_buffer("section_of", section_of, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        cols = torch.arange(self.section_of.shape[0], device=positions.device)
        rows = positions[self.section_of]  # [head_dim / 2, tokens]: each frequency's position row
        return self.cos[rows, cols[:, None]].T.contiguous(), self.sin[rows, cols[:, None]].T.contiguous()


def mrope_positions(token_count: int, items: list[MediaItem], merge: int, tokens_per_second: float = 1.0
                    ) -> tuple[np.ndarray, int]:
    """HF's get_rope_index for one prompt: text runs count on from the last position; an image's rows take
    (start + t, start + row, start + column), and the text after it starts past its larger side. A video's time
    row steps by tokens_per_second x its seconds per temporal patch, truncated (in float32, as HF's tensors do).
    Returns the [3, tokens] positions and the offset every later position takes (generated tokens: position +
    offset)."""
    out = np.empty((3, token_count), dtype=np.int64)
    pos = at = 0
    for item in sorted(items, key=lambda m: m.offset):
        text = item.offset - at
        out[:, at:item.offset] = np.arange(pos, pos + text)
        pos += text
        t, h, w = item.grid_thw[0], item.grid_thw[1] // merge, item.grid_thw[2] // merge
        grid = np.stack(np.meshgrid(_time_steps(item, t, tokens_per_second), np.arange(h), np.arange(w),
                                    indexing="ij")).reshape(3, -1)
        out[:, item.offset:item.end] = grid + pos
        pos += max(h, w)
        at = item.end
    out[:, at:] = np.arange(pos, pos + token_count - at)
    delta = int(out.max()) + 1 - token_count if token_count else 0
    return out, delta


def _time_steps(item: MediaItem, t: int, tokens_per_second: float) -> np.ndarray:
    """A grid's time positions: 0..t-1 for an image, each temporal patch's time in M-RoPE steps for a video."""
    if item.modality != "video":
        return np.arange(t)
    interval = np.float32(tokens_per_second) * np.float32(item.seconds_per_grid)
    return (np.arange(t, dtype=np.float32) * interval).astype(np.int64)


# ---- the model ----

class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    # decode graphs: a step of text positions only gets M-RoPE's equal rows as one (multimodal/step_inputs.py),
    # plain RoPE, which the graphs take; a step with media rows or image positions runs eagerly
    cuda_graphs_supported = True
    supports_multimodal = True
    uses_mrope = True
    text_attention_bias: bool | None = True  # Qwen2's q, k and v biases
    interleaved_mrope = False

    def __init__(self, config) -> None:
        lift_text_config(config, self.text_attention_bias)
        self.vl_config = config
        super().__init__(config.text_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.visual = self.make_vision_tower(config.vision_config)
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        # M-RoPE time steps per second of video (Qwen2.5-VL; Qwen3-VL writes timestamps into the prompt instead)
        self.tokens_per_second = float(getattr(config.vision_config, "tokens_per_second", 1) or 1)

    def make_vision_tower(self, vision_config) -> nn.Module:
        return VisionTransformer(vision_config)

    def make_rotary(self) -> RotaryEmbedding:
        text = self.vl_config.text_config
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        sections = rope.get("mrope_section") or [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]
        base = rope.get("rope_theta", getattr(text, "rope_theta", 1000000.0))
        return MRotaryEmbedding(head_dim, text.max_position_embeddings, base, list(sections),
                                bool(rope.get("mrope_interleaved", self.interleaved_mrope)))

    # ---- the runner's multimodal interface ----

    def encode_media(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each item's embedding rows ([item.length, hidden]), every item (images and videos alike: a video is a
        grid of t temporal patches) in one pass of the vision tower."""
        rows = self.visual(self._pixels(items), [m.grid_thw for m in items])
        return self.split_media_rows(items, rows)

    def _pixels(self, items: list[MediaItem]) -> torch.Tensor:
        device = self.lm_head.weight.device
        dtype = self.visual.patch_embed.proj.weight.dtype
        return torch.cat([m.pixel_tensor() for m in items]).to(device=device, dtype=dtype)

    def split_media_rows(self, items: list[MediaItem], rows: torch.Tensor) -> list[torch.Tensor]:
        """Each item's rows of the tower's output for `items` (a padded output's extra rows after them dropped)."""
        lengths = [m.length for m in items]
        return list(rows[:sum(lengths)].split(lengths))

    # ---- encoder CUDA graphs (worker/encoder_graphs.py): the tower at patch counts fixed per bucket ----

    @staticmethod
    def media_patches(items: list[MediaItem]) -> int:
        """The tower's input rows for `items` (what a bucket must hold)."""
        return sum(m.pixels_shape[0] for m in items)

    def encoder_graph_inputs(self, items: list[MediaItem], patches: int) -> dict[str, torch.Tensor] | None:
        """The tower's inputs for `items` padded to a bucket of `patches` (None: they do not fit it)."""
        return self.visual.padded_inputs(self._pixels(items), [m.grid_thw for m in items], patches)

    def encoder_graph_example(self, patches: int) -> dict[str, torch.Tensor]:
        """Inputs of the bucket's shapes for capture: the smallest image (2 x 2 merged rows), zeros, padded."""
        side = 2 * self.merge
        pixels = torch.zeros(side * side, self.visual.patch_embed.proj.weight[0].numel(),
                             dtype=self.visual.patch_embed.proj.weight.dtype, device=self.lm_head.weight.device)
        return self.visual.padded_inputs(pixels, [(1, side, side)], patches)

    def encoder_graph_forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tower on `encoder_graph_inputs` (what a CUDA graph captures): every row of the bucket."""
        return self.visual.static_forward(inputs)

    def mrope_positions(self, num_prompt_tokens: int, items: list[MediaItem]) -> tuple[np.ndarray, int]:
        return mrope_positions(num_prompt_tokens, items, self.merge, self.tokens_per_second)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = (),
                media: MediaRows | None = None):
        """`positions`: [tokens], or [3, tokens] M-RoPE rows; `media`: the step's media rows, which replace the
        embeddings of the placeholder tokens they belong at."""
        text = self.model
        x = text.embed_tokens(input_ids)
        width = x.shape[-1]
        if media is not None:
            x = x.index_copy(0, media.index, media.rows[:, :width].to(x.dtype))
        rope = RopeTables(text.rotary, *text.rotary.cos_sin(positions))
        residual, taps = None, {}
        for i, layer in enumerate(text.layers):
            x, residual = layer(rope, x, residual)
            if media is not None and media.rows.shape[1] > (i + 1) * width:
                x = self.add_layer_features(x, media, i, width)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = text.norm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x

    def add_layer_features(self, x: torch.Tensor, media: MediaRows, layer: int, width: int) -> torch.Tensor:
        """DeepStack (Qwen3-VL): the tower's features for decoder layer `layer`, added to its output at the media
        tokens (the columns after the embedding's, one hidden width per layer)."""
        features = media.rows[:, (layer + 1) * width:(layer + 2) * width]
        return x.index_add(0, media.index, features.to(x.dtype))

    # ---- the name map: HF 5's names (model.language_model., model.visual.) and the hub's (model., visual.) ----

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith("model.visual."):
                name = name[len("model."):]
            yield name, tensor

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        return (name, None) if name.startswith("visual.") else super().checkpoint_target(name)

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name] if name.startswith("visual.") else super().checkpoint_parts(name)
