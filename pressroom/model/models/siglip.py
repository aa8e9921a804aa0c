"""SigLIP's vision tower (HF's SiglipVisionModel, no pooling head): patch embeddings with a learned position per
patch (no class token), pre-norm ViT blocks (the same blocks and checkpoint names as CLIP's, so llava.py's are
reused) and a final LayerNorm. Gemma 3 reads its last hidden state; a fixed image size (no position
interpolation)."""
from __future__ import annotations

import torch
from torch import nn

from pressroom.model.models.llava import ClipEncoder


class SiglipEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"SigLIP got {patches.shape[1]} patches an image; its positions cover "
                             f"{self.position_embedding.num_embeddings} (the config's image_size).")
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """[images, channels, height, width] pixels -> [images, patches, hidden] (the last hidden state)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = ClipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
