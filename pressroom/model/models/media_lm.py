"""What the models that place a media tower's rows in a text model's embeddings share: the forward that places them
(Llama-shaped text models: LLaVA, Qwen2-Audio) and the name map of hub and transformers checkpoints, whose tower
tensors load as they are named (Gemma 3 too)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pressroom.model.models.llama import LlamaForCausalLM, RopeTables
from pressroom.multimodal.inputs import MediaRows

# A vision tower's checkpoints: the hub's (language_model.model.*, vision_tower.vision_model.*) and transformers'
VISION_TOWER = ("vision_tower.", "multi_modal_projector.")
VISION_RENAMES = (("model.language_model.", "model."), ("model.vision_tower.vision_model.", "vision_tower."),
                  ("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
                  ("model.multi_modal_projector.", "multi_modal_projector."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


class TowerNameMap:
    """A mixin before the text model's class. RENAMES: checkpoint prefixes -> ours (the first that matches);
    TOWER: our prefixes whose tensors load as named (no stacked or split projections)."""
    RENAMES: tuple[tuple[str, str], ...] = ()
    TOWER: tuple[str, ...] = ()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            old = next((old for old, _ in self.RENAMES if name.startswith(old)), None)
            if old is not None:
                name = dict(self.RENAMES)[old] + name[len(old):]
            yield name, tensor

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        return (name, None) if name.startswith(self.TOWER) else super().checkpoint_target(name)

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name] if name.startswith(self.TOWER) else super().checkpoint_parts(name)


class MediaRowsLlama(TowerNameMap, LlamaForCausalLM):
    """A Llama-shaped text model whose step may carry media rows: they replace their tokens' embeddings."""

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
