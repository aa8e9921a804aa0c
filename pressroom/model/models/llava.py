"""LLaVA: a fixed-size vision tower (CLIP's ViT) whose hidden states at one layer (`vision_feature_layer`, class
token dropped under the "default" selection) go through a two-layer projector into a Llama-family decoder, where
they replace the prompt's image tokens. Positions are the decoder's usual ones, so decode steps are plain Llama
steps (CUDA graphs and the CPU's fused decode included); only steps that carry image rows run eagerly."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.model.models.media_lm import VISION_RENAMES, VISION_TOWER, MediaRowsLlama
from pressroom.model.models.qwen2_5_vl import lift_text_config
from pressroom.multimodal.inputs import MediaItem

_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu, "silu": F.silu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class ClipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class ClipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = _ACTS[act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        eps = getattr(config, "layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = ClipAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = ClipMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, kernel_size=patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2 + 1, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(config) for _ in range(config.num_hidden_layers))


class ClipVisionModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        eps = getattr(config, "layer_norm_eps", 1e-5)
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=eps)  # (sic: CLIP's checkpoint name)
        self.encoder = ClipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)  # loaded; LLaVA reads an earlier layer

    def hidden_states(self, pixels: torch.Tensor, wanted: list[int]) -> list[torch.Tensor]:
        """HF's hidden_states[i] for each i in `wanted` (0: the embeddings after pre_layrnorm, i: layer i - 1's
        output; negative from the end), running no layer past the last one asked for."""
        count = len(self.encoder.layers) + 1
        wanted = [i % count for i in wanted]
        states = {0: self.pre_layrnorm(self.embeddings(pixels))}
        x = states[0]
        for i, layer in enumerate(self.encoder.layers[:max(wanted)]):
            x = states[i + 1] = layer(x)
        return [states[i] for i in wanted]


class MultiModalProjector(nn.Module):
    def __init__(self, in_dim: int, dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, dim, bias=bias), nn.Linear(dim, dim, bias=bias)
        self.act = _ACTS[act]

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MediaRowsLlama):
    supports_multimodal = True
    uses_mrope = False
    TOWER, RENAMES = VISION_TOWER, VISION_RENAMES

    def __init__(self, config) -> None:
        vision = config.vision_config
        if getattr(vision, "model_type", "") != "clip_vision_model":
            raise ValueError(f"LLaVA with a {getattr(vision, 'model_type', '?')} tower is not supported yet "
                             "(CLIP's is).")
        lift_text_config(config, True if config.text_config.model_type == "qwen2" else None)
        super().__init__(config.text_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        layer = config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.vision_tower = ClipVisionModel(vision)
        self.multi_modal_projector = MultiModalProjector(
            vision.hidden_size * len(self.feature_layers), config.text_config.hidden_size, config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)))

    # ---- the runner's multimodal interface ----

    def encode_media(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each image's rows ([item.length, hidden]), every image in one batch through the tower."""
        device = self.lm_head.weight.device
        dtype = self.vision_tower.embeddings.patch_embedding.weight.dtype
        pixels = torch.cat([m.pixel_tensor() for m in items]).to(device=device, dtype=dtype)
        states = self.vision_tower.hidden_states(pixels, self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        rows = self.multi_modal_projector(torch.cat(states, dim=-1))
        return [r for r in rows]

    def skips(self, name: str) -> bool:
        return name.endswith("position_ids") or super().skips(name)

