"""Whisper's audio encoder and its log-mel features: shared by Whisper itself (transcription) and by models whose
audio tower is Whisper's (Qwen2-Audio: the same layers, then a 2x average pool before the final norm).

Features are HF's `WhisperFeatureExtractor` (the model folder's settings: 16 kHz, 30-second windows, 80 or 128 mel
bins), so the encoder sees the numbers HF's processor gives it. The encoder takes [clips, mel bins, frames]: two
convolutions (the second halves the frames), learned positions, pre-norm transformer layers. Whisper runs the full
padded window (3000 frames) with no mask; `lengths` masks each clip's padding out of the attention's keys, so a clip
cropped to its own frames (plus the two frames the convolutions read past them) gives the rows HF computes over the
padded window, at a fraction of the cost."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 16_000  # what every Whisper-family feature extractor reads

_ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# ---- features ----

def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples from `rate` to `target` Hz through PyAV's resampler (FFmpeg's libswresample)."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if rate == target or samples.size == 0:
        return samples
    import av
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    frame.pts = None
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]  # the filter's tail
    return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)


@dataclass(frozen=True, slots=True)
class LogMel:
    """A clip's log-mel features over the extractor's whole window and how many frames are the clip's own."""
    features: np.ndarray  # [mel bins, window frames] float32
    frames: int  # frames of the clip; the rest is the window's padding


class WhisperFeatures:
    """The model folder's WhisperFeatureExtractor: 16 kHz mono samples -> log-mel frames (100 a second)."""

    def __init__(self, model_path: str) -> None:
        from transformers import WhisperFeatureExtractor
        self.hf = WhisperFeatureExtractor.from_pretrained(model_path)
        self.sampling_rate = int(self.hf.sampling_rate)
        self.max_samples = int(self.hf.n_samples)  # one window; HF truncates longer clips to it

    def fingerprint(self) -> bytes:
        """The settings the features depend on (a media hash's prefix)."""
        return repr(sorted((k, repr(v)) for k, v in self.hf.to_dict().items() if k != "mel_filters")).encode()

    def __call__(self, samples: np.ndarray) -> LogMel:
        """`samples`: mono float32 at `sampling_rate`, at most `max_samples` (the caller truncates as HF does)."""
        batch = self.hf(samples, sampling_rate=self.sampling_rate, padding="max_length", return_attention_mask=True,
                        return_tensors="np")
        features = np.ascontiguousarray(batch["input_features"][0], dtype=np.float32)
        return LogMel(features, int(batch["attention_mask"][0].sum()))


def conv_frames(mel_frames: int) -> int:
    """Encoder positions after the stride-2 convolution."""
    return (mel_frames - 1) // 2 + 1


def pooled_frames(mel_frames: int) -> int:
    """Rows after the convolution and a 2x average pool (Qwen2-Audio's rows per clip, HF's count)."""
    return (conv_frames(mel_frames) - 2) // 2 + 1


def crop_frames(mel_frames: int, window_frames: int) -> int:
    """Mel frames an encoder with key masks needs of a clip: its own and the two its last positions' convolutions
    read past them (within the window)."""
    return min(mel_frames + 2, window_frames)


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
