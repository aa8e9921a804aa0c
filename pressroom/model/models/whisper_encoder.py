"""Whisper's audio encoder: shared by Whisper itself (transcription) and by models whose audio tower is Whisper's
(Qwen2-Audio: the same layers, then a 2x average pool before the final norm). Its input, HF's log-mel features, is
multimodal/audio_features.py's (re-exported here). The encoder takes [clips, mel bins, frames]: two
convolutions (the second halves the frames), learned positions, pre-norm transformer layers. Whisper runs the full
padded window (3000 frames) with no mask; `mel_frames` masks each clip's padding out of the attention's keys, so a clip
cropped to its own frames (plus the two frames the convolutions read past them) gives the rows HF computes over the
padded window, at a fraction of the cost."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.multimodal.audio_features import (  # noqa: F401 — re-exported: the features beside their encoder
    SAMPLE_RATE,
    LogMel,
    WhisperFeatures,
    conv_frames,
    crop_frames,
    pooled_frames,
    resample,
)

_ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# ---- the encoder ----

class WhisperAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x: [clips, positions, dim]; key_mask: [clips, 1, 1, positions], True where a key is the clip's."""
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = WhisperAttention(dim, config.encoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, config.encoder_ffn_dim), nn.Linear(config.encoder_ffn_dim, dim)
        self.act = _ACTS[config.activation_function]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Whisper's encoder (checkpoint names as HF's: conv1, conv2, embed_positions, layers.*, layer_norm).
    `pool`: a 2x average pool over positions before the final norm (Qwen2-Audio's audio tower)."""

    def __init__(self, config: Any, pool: bool = False) -> None:
        super().__init__()
        dim = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, dim)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(dim)
        self.pool = pool  # (scale_embedding is in the config but HF never applies it)

    @property
    def window_frames(self) -> int:
        """Mel frames of the full window the positions cover (3000: 30 s)."""
        return 2 * self.embed_positions.num_embeddings

    def forward(self, features: torch.Tensor, mel_frames: torch.Tensor | None = None) -> torch.Tensor:
        """features: [clips, mel bins, frames]; `mel_frames` ([clips]): each clip's own frames (None: every frame
        is one, as Whisper runs its padded window). Returns [clips, positions (halved again with `pool`), dim];
        rows past a clip's own (`pooled_frames`) are padding."""
        frames = features.shape[-1]
        if conv_frames(frames) > self.embed_positions.num_embeddings:
            raise ValueError(f"{frames} mel frames exceed the encoder's window of {self.window_frames}.")
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[:x.shape[1]]
        key_mask = None
        if mel_frames is not None:
            valid = (mel_frames.to(x.device) - 1) // 2 + 1
            key_mask = (torch.arange(x.shape[1], device=x.device)[None, :] < valid[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        if self.pool:
            x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)


# ---- CUDA graphs (worker/encoder_graphs.py): clips padded to the full window, a bucket a number of clips ----

class ClipEncoderGraphs:
    """The encoder-graph interface for a model whose tower is `audio_tower_for_graphs`: a bucket's unit is the mel
    frame, and every clip is padded to the full window, so a bucket holds `bucket // window` clips of one fixed
    shape. Padding clips have one frame (their rows are dropped; no clip attends across clips). The model gives
    `encode_clips(features, mel_frames)` -> [clips, rows, width] and `split_media_rows`."""

    def _clip_window(self) -> tuple[int, int, torch.Tensor]:
        encoder = self.audio_tower_for_graphs
        return encoder.window_frames, encoder.conv1.in_channels, encoder.conv1.weight

    def media_patches(self, items: list) -> int:
        return len(items) * self._clip_window()[0]

    def encoder_graph_buckets(self, buckets: list[int]) -> list[int]:
        """The configured patch counts as whole windows (bucket // window clips; those under one window dropped)."""
        window = self._clip_window()[0]
        return sorted({b // window * window for b in buckets if b >= window})

    def encoder_graph_inputs(self, items: list, patches: int) -> dict[str, torch.Tensor] | None:
        window, bins, weight = self._clip_window()
        clips = patches // window
        mels = [m.pixel_tensor() for m in items]
        if len(items) > clips or any(m.shape != (bins, m.shape[-1]) or m.shape[-1] > window for m in mels):
            return None
        inputs = self.encoder_graph_example(patches)
        for i, (mel, item) in enumerate(zip(mels, items)):
            inputs["features"][i, :, :mel.shape[-1]] = mel.to(device=weight.device, dtype=weight.dtype)
            inputs["mel_frames"][i] = item.grid_thw[-1]
        return inputs

    def encoder_graph_example(self, patches: int) -> dict[str, torch.Tensor]:
        window, bins, weight = self._clip_window()
        clips = patches // window
        return {"features": torch.zeros(clips, bins, window, dtype=weight.dtype, device=weight.device),
                "mel_frames": torch.ones(clips, dtype=torch.int64, device=weight.device)}

    def encoder_graph_forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.encode_clips(inputs["features"], inputs["mel_frames"])
