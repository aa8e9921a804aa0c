"""Nemotron-H (HF model_type "nemotron_h"): a stack of single-mixer blocks, each `x + mixer(RMSNorm(x))`, whose
mixer is by the config's layers_block_type (hybrid_override_pattern): Mamba2 ("M", linear_attention), attention
without any position embedding ("*", full_attention), a ReLU² MLP ("-", mlp), or a mixture of ReLU² experts with a
sigmoid router and a shared expert ("E", moe; Nemotron-3 Nano).

Checkpoints (the originals and HF's save_pretrained alike) name the body `backbone` and store each expert's
matrices apart (they load into FusedMoE's stacked w13, up alone: the experts have no gate half, and w2);
multi-token-prediction layers (`mtp.`) are not loaded.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels.moe_activation import Relu2
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.fused_moe import DOWN, UP, FusedMoE, RouterConfig, select_experts
from pressroom.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pressroom.model.layers.mamba2_mixer import Mamba2Mixer, Mamba2MixerConfig
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.weights import expected_names, load_named_weights


def mixer_config(config) -> Mamba2MixerConfig:
    if config.mamba_hidden_act != "silu":
        raise ValueError(f"Nemotron-H's Mamba2 conv activation {config.mamba_hidden_act!r} is not supported.")
    return Mamba2MixerConfig(
        hidden_size=config.hidden_size, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
        n_groups=config.n_groups, d_state=config.ssm_state_size, conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size, conv_bias=bool(config.use_conv_bias), in_proj_bias=bool(config.use_bias),
        out_proj_bias=bool(config.use_bias), norm_eps=config.layer_norm_epsilon, gate="norm_gated",
        dt_limit=tuple(float(t) for t in config.time_step_limit))


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class NemotronHMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHAttention(nn.Module):
    """Grouped-query attention with no position embedding (the Mamba2 layers carry the order) and no biases."""

    def __init__(self, config) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        input_slice=(self.qkv_proj.q_start * head_dim, self.num_heads * head_dim))
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v))


class NemotronHRouter(nn.Module):
    """Sigmoid scores of an fp32 linear; the correction bias steers the choice only."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class NemotronHMoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        c = config
        latent = c.moe_latent_size
        self.router = RouterConfig(top_k=c.num_experts_per_tok, scoring="sigmoid", renormalize=bool(c.norm_topk_prob),
                                   num_groups=c.n_group, topk_groups=c.topk_group,
                                   routed_scaling_factor=float(c.routed_scaling_factor))
        self.gate = NemotronHRouter(c.hidden_size, c.n_routed_experts)
        # every expert whole on every rank: the Mamba2 layers refuse tensor parallelism anyway
        self.experts = FusedMoE(c.n_routed_experts, latent or c.hidden_size, c.moe_intermediate_size,
                                activation=Relu2())
        self.shared_experts = NemotronHMLP(c.hidden_size, c.moe_shared_expert_intermediate_size, bool(c.mlp_bias))
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent is not None:
            self.fc1_latent_proj = ColumnParallelLinear(c.hidden_size, latent, bool(c.mlp_bias))
            self.fc2_latent_proj = RowParallelLinear(latent, c.hidden_size, bool(c.mlp_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.router, self.gate.e_score_correction_bias)
        if self.fc1_latent_proj is None:
            routed = self.experts(x, weights, ids)
        else:
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids))
        return routed + self.shared_experts(x)


def make_mixer(config, kind: str) -> nn.Module:
    if kind == "linear_attention":
        return Mamba2Mixer(mixer_config(config))
    if kind == "full_attention":
        return NemotronHAttention(config)
    if kind == "mlp":
        return NemotronHMLP(config.hidden_size, config.intermediate_size, bool(config.mlp_bias))
    if kind == "moe":
        return NemotronHMoE(config)
    raise ValueError(f"unknown Nemotron-H layer type {kind!r}.")


class NemotronHBlock(nn.Module):
    def __init__(self, config, layer: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = make_mixer(config, config.layers_block_type[layer])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add of the previous block fused into this block's norm."""
        if residual is None:
            x, residual = self.norm(x), x
        else:
            x, residual = self.norm(x, residual)
        return self.mixer(x), residual


class NemotronHModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, i) for i in range(len(config.layers_block_type)))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        x, residual = self.embeddings(input_ids), None
        taps = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = self.norm_f(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x


_QKV = {".q_proj.": "q", ".k_proj.": "k", ".v_proj.": "v"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_EXPERT_PARTS = {"up_proj": ("w13", UP), "down_proj": ("w2", DOWN)}  # FusedMoE's stacked parameter and part
_HF_BODY = re.compile(r"^backbone\.")
_MTP = re.compile(r"(^|\.)mtp\.")  # HF skips these too (its _keys_to_ignore_on_load_unexpected)


class NemotronHForCausalLM(nn.Module):
    # its decode forward reads nothing on the host: the Mamba2 decode kernels, attention, the router
    # (route_topk, or torch's grouped top-k) and the fused experts take device tensors and host shapes only
    cuda_graphs_supported = True  # state slots are graph inputs; checked on an H100 (tests/gpu)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.backbone = NemotronHModel(config)
        # its own weights whatever tie_word_embeddings says: HF's NemotronH never ties the head (and saves it)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """`positions` go unused: no layer has a position embedding."""
        return self.backbone(input_ids, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- the name map (model/weights.py) ----

    def skips(self, name: str) -> bool:
        return _MTP.search(name) is not None

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        for part, shard in _QKV.items():
            if part in name:
                return name.replace(part, ".qkv_proj."), shard
        m = _EXPERT.search(name)
        if m is not None:
            param, part = _EXPERT_PARTS[m.group(2)]
            return f"{name[:m.start()]}.experts.{param}", (part, int(m.group(1)))
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        if ".qkv_proj." in name:
            return [name.replace(".qkv_proj.", part) for part in _QKV]
        for proj, (param, _) in _EXPERT_PARTS.items():
            if name.endswith(f".experts.{param}"):
                block = name.removesuffix(f".{param}")
                return [f"{block}.{e}.{proj}.weight" for e in range(self.config.n_routed_experts)]
        return [name]

    def to_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """bench gpu's HF names -> HF's NemotronH module names: the body `model`, not the checkpoints' `backbone`;
        the stacked experts' w13 holds the up matrices alone (no gate half)."""
        return {_HF_BODY.sub("model.", name).replace(".experts.gate_up_proj", ".experts.up_proj"): t
                for name, t in state.items()}

    def expected_weights(self) -> set[str]:
        return expected_names(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy checkpoint tensors into parameters one by one; returns the checkpoint names used."""
        return load_named_weights(self, weights)
