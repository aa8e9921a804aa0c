"""Falcon-H1 (HF model_type "falcon_h1"): every layer runs attention (with rope) and a Mamba2 mixer side by side on
the same normed input and adds both to the residual, then a SwiGLU MLP. Its muP multipliers are applied where HF
applies them: the embedding, the attention's input and keys and its output, the mixer's input, each part of
in_proj's output (mup_vector) and its output, the MLP's gate and its output, and the logits.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels.ssm import DT_LIMIT
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pressroom.model.layers.mamba2_mixer import Mamba2Mixer, Mamba2MixerConfig
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.models.llama import RopeTables, rotary_from_config
from pressroom.model.weights import expected_names, load_named_weights


def mixer_config(config) -> Mamba2MixerConfig:
    if config.hidden_act != "silu":
        raise ValueError(f"Falcon-H1's activation {config.hidden_act!r} is not supported.")
    d_inner = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    gate = "gated"
    if config.mamba_rms_norm:
        gate = "gated_norm" if config.mamba_norm_before_gate else "norm_gated"
    return Mamba2MixerConfig(
        hidden_size=config.hidden_size, num_heads=config.mamba_n_heads, head_dim=d_inner // config.mamba_n_heads,
        n_groups=config.mamba_n_groups, d_state=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size, conv_bias=bool(config.mamba_conv_bias),
        in_proj_bias=bool(config.mamba_proj_bias), out_proj_bias=bool(config.projectors_bias),
        norm_eps=config.rms_norm_eps, gate=gate,
        dt_limit=tuple(float(t) for t in config.time_step_limit or DT_LIMIT),
        in_multiplier=float(config.ssm_in_multiplier), proj_multipliers=tuple(map(float, config.ssm_multipliers)))


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class FalconH1Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = bool(config.attention_bias)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias,
                                        input_slice=(self.qkv_proj.q_start * head_dim, self.num_heads * head_dim))
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim ** -0.5)
        self.in_multiplier = float(config.attention_in_multiplier)
        self.key_multiplier = float(config.key_multiplier)
        self.out_multiplier = float(config.attention_out_multiplier)

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        heads = self.qkv_proj(_scaled(x, self.in_multiplier)).view(-1, self.num_heads + 2 * self.num_kv_heads,
                                                                    self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        qk = rope.rotary.rotate(torch.cat([q, _scaled(k, self.key_multiplier)], dim=1), rope.cos, rope.sin)
        out = self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v)
        return _scaled(self.o_proj(out), self.out_multiplier)


class FalconH1MLP(nn.Module):
    """SwiGLU with muP multipliers on the gate (before its activation) and on the output."""

    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(config.mlp_bias)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        self.gate_multiplier, self.down_multiplier = map(float, config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return _scaled(self.down_proj(up * F.silu(_scaled(gate, self.gate_multiplier))), self.down_multiplier)


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(mixer_config(config))
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)
        self.self_attn = FalconH1Attention(config)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FalconH1MLP(config)

    def forward(self, rope: RopeTables, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add of the previous layer's MLP fused into this layer's first norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = _scaled(self.mamba(x), self.ssm_out_multiplier) + self.self_attn(rope, x)
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual


class FalconH1Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary_from_config(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        x, residual = _scaled(self.embed_tokens(input_ids), self.embedding_multiplier), None
        rope = RopeTables(self.rotary, *self.rotary.cos_sin(positions))
        taps = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = self.final_layernorm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x


# checkpoint name part -> (our stacked parameter, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class FalconH1ForCausalLM(nn.Module):
    cuda_graphs_supported = True  # state slots are graph inputs; checked on an H100 (tests/gpu)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = FalconH1Model(config)
        self.lm_head_multiplier = float(config.lm_head_multiplier)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _scaled(self.lm_head(hidden), self.lm_head_multiplier)

    # ---- the name map (model/weights.py) ----

    def skips(self, name: str) -> bool:
        """Rope tables, a tied head's copy, and a saved mup_vector (the mixer builds it from the config, as HF does)."""
        return ("rotary_emb.inv_freq" in name or name.endswith(".mup_vector")
                or (self.tie_word_embeddings and name == "lm_head.weight"))

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        for part, (stacked, shard_id) in _STACKED.items():
            if part in name:
                return name.replace(part, stacked), shard_id
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name.replace(stacked, part) for part, (stacked, _) in _STACKED.items() if stacked in name] or [name]

    def expected_weights(self) -> set[str]:
        return expected_names(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded = load_named_weights(self, weights)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
            loaded.add("lm_head.weight")
        return loaded
