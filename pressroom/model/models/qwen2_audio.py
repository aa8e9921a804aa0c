"""Qwen2-Audio: Whisper's audio encoder (whisper_encoder.py, with a 2x average pool before its final norm) and a
linear projector whose rows replace the prompt's `<|AUDIO|>` tokens in a Qwen2 decoder. Positions are the decoder's
usual ones, so decode steps are plain Qwen2 steps (CUDA graphs and the CPU's fused decode included); only steps that
carry audio rows run eagerly.

Each clip is encoded over its own log-mel frames (multimodal/processor.py's AudioProcessor crops the 30-second
window), its padding masked out of the encoder's attention keys: the rows HF computes over the padded window.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pressroom.model.models.llama import LlamaForCausalLM, RopeTables
from pressroom.model.models.qwen2_5_vl import lift_text_config
from pressroom.model.models.whisper_encoder import WhisperEncoder
from pressroom.multimodal.inputs import MediaItem, MediaRows


class AudioProjector(nn.Module):
    def __init__(self, audio_dim: int, text_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_dim, text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(LlamaForCausalLM):
    supports_multimodal = True
    uses_mrope = False

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
        rows = self.multi_modal_projector(self.audio_tower(features, frames))
        return [r[:m.length] for r, m in zip(rows, items)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = (),
                media: MediaRows | None = None):
        if media is None:
            return super().forward(input_ids, positions, aux_layers)
        text = self.model
        x = text.embed_tokens(input_ids).index_copy(0, media.index, media.rows.to(text.embed_tokens.weight.dtype))
        rope = RopeTables(text.rotary, *text.rotary.cos_sin(positions))
        residual, taps = None, {}
        for i, layer in enumerate(text.layers):
            x, residual = layer(rope, x, residual)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = text.norm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x

    # ---- the name map: the hub's (language_model.model.*, audio_tower.*) and transformers 5's (model.*) ----

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            yield name, tensor

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        return (name, None) if name.startswith(_TOWER) else super().checkpoint_target(name)

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name] if name.startswith(_TOWER) else super().checkpoint_parts(name)


_TOWER = ("audio_tower.", "multi_modal_projector.")
_RENAMES = [("model.language_model.", "model."), ("model.audio_tower.", "audio_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head.")]
