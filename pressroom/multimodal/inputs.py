"""One media item of a prompt as it travels from the front-end to the model runner (a plain message: it crosses
the core's process boundary, msgspec or pickle, so it holds bytes rather than tensors)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class MediaItem:
    """An image, video or audio clip the encoder turns into `length` embedding rows, which replace the prompt's
    placeholder tokens `offset` to `offset + length`."""
    modality: str  # "image", "video" or "audio"
    hash: str  # content hash (the decoded media and the processor's settings): encoder cache and prefix-cache key
    offset: int  # first placeholder token in the prompt
    length: int  # placeholder tokens, the encoder's output rows
    pixels: bytes  # the processor's output (row-major): an image's patches, a clip's log-mel frames [bins, frames]
    pixels_shape: tuple[int, ...]
    pixels_dtype: str = "float32"
    # patches along time, height and width (Qwen-VL); a clip's (1, 1, its own mel frames), the rest padding
    grid_thw: tuple[int, int, int] = (1, 1, 1)
    # its placeholder run is attended bidirectionally (Gemma 3's images): a prefill chunk never ends inside it
    bidirectional: bool = False
    # a video's seconds per temporal patch (temporal_patch_size / sampled fps): M-RoPE's time axis (Qwen2.5-VL)
    seconds_per_grid: float = 0.0
    # the encoder's output rows where they do not replace the placeholder (Whisper's clip, read by cross-attention:
    # its frames / 2); 0: `length`
    encoder_rows: int = 0

    @property
    def encoder_cost(self) -> int:
        """Rows the encoder computes for this item: what it costs the step's encoder budget."""
        return self.encoder_rows or self.length

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end

    def pixel_tensor(self) -> torch.Tensor:
        array = np.frombuffer(self.pixels, dtype=np.dtype(self.pixels_dtype)).reshape(self.pixels_shape)
        return torch.from_numpy(array.copy())


def media_overlapping(items: list[MediaItem] | None, start: int, end: int) -> list[MediaItem]:
    """The items whose placeholder runs meet tokens [start, end)."""
    return [m for m in items or () if m.overlaps(start, end)]


@dataclass(frozen=True, slots=True)
class MediaRows:
    """A step's media rows for the model's forward: `rows[i]` belongs at flat token `index[i]` (its first
    hidden-size columns replace that token's embedding; a model whose encoder gives more, DeepStack's per-layer
    features, reads them too)."""
    index: torch.Tensor  # [n] int64, on the model's device
    rows: torch.Tensor  # [n, width]


def bidirectional_runs(items: list[MediaItem] | None) -> list[tuple[int, int]]:
    """[start, end) of a prompt's runs attended bidirectionally: its items so marked, adjacent ones merged into one
    run (HF's token_type_ids runs: images with no token between them form one block)."""
    runs: list[tuple[int, int]] = []
    for item in sorted((m for m in items or () if m.bidirectional), key=lambda m: m.offset):
        if runs and runs[-1][1] == item.offset:
            runs[-1] = (runs[-1][0], item.end)
        else:
            runs.append((item.offset, item.end))
    return runs
