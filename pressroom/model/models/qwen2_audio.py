"""Qwen2-Audio: Whisper's audio encoder (whisper_encoder.py, with a 2x average pool before its final norm) and a
linear projector whose rows replace the prompt's `<|AUDIO|>` tokens in a Qwen2 decoder. Positions are the decoder's
usual ones, so decode steps are plain Qwen2 steps (CUDA graphs and the CPU's fused decode included); only steps that
carry audio rows run eagerly.

Each clip is encoded over its own log-mel frames (multimodal/processor.py's AudioProcessor crops the 30-second
window), its padding masked out of the encoder's attention keys: the rows HF computes over the padded window.
"""
from __future__ import annotations

import torch
from torch import nn

from pressroom.model.models.media_lm import MediaRowsLlama
from pressroom.model.models.qwen2_5_vl import lift_text_config
from pressroom.model.models.whisper_encoder import ClipEncoderGraphs, WhisperEncoder
from pressroom.multimodal.inputs import MediaItem


class AudioProjector(nn.Module):
    def __init__(self, audio_dim: int, text_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_dim, text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(ClipEncoderGraphs, MediaRowsLlama):
    supports_multimodal = True
    uses_mrope = False
    # the name map: the hub's (language_model.model.*, audio_tower.*) and transformers 5's (model.*)
    TOWER = ("audio_tower.", "multi_modal_projector.")
    RENAMES = (("model.language_model.", "model."), ("model.audio_tower.", "audio_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."))

    def __init__(self, config) -> None:
        lift_text_config(config, True)  # Qwen2 biases q, k and v
        super().__init__(config.text_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.audio_tower = WhisperEncoder(config.audio_config, pool=True)
        self.multi_modal_projector = AudioProjector(config.audio_config.d_model, config.text_config.hidden_size)

    # ---- the runner's multimodal interface ----

    def encode_media(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each clip's rows ([item.length, hidden]): the clips padded to the longest and run as one batch, each
        attending to its own frames only."""
        device = self.lm_head.weight.device
        mels = [m.pixel_tensor() for m in items]  # [mel bins, frames] each
        longest = max(m.shape[-1] for m in mels)
        features = torch.stack([nn.functional.pad(m, (0, longest - m.shape[-1])) for m in mels]).to(device)
        frames = torch.tensor([m.grid_thw[-1] for m in items], device=device)
        return self.split_media_rows(items, self.encode_clips(features, frames))

    def encode_clips(self, features: torch.Tensor, mel_frames: torch.Tensor) -> torch.Tensor:
        """[clips, mel bins, frames] -> [clips, pooled positions, hidden]: past a clip's own rows, padding."""
        return self.multi_modal_projector(self.audio_tower(features, mel_frames))

    @staticmethod
    def split_media_rows(items: list[MediaItem], rows: torch.Tensor) -> list[torch.Tensor]:
        return [r[:m.length] for r, m in zip(rows, items)]

    @property
    def audio_tower_for_graphs(self) -> WhisperEncoder:
        return self.audio_tower
