"""Kimi Linear: Kimi Delta Attention (KDA) layers interleaved with multi-head latent attention (MLA) layers that
use no position embedding, and DeepSeek-V3's mixture of experts (sigmoid router, grouped top-k, a shared expert)
after `first_k_dense_replace` dense layers. `config.layer_types` says which layers are KDA ("linear_attention").

A KDA layer keeps two states per request: the short causal conv's last inputs (q, k and v convolved as one stack
of channels, as HF stacks the checkpoint's q/k/v_conv1d) and the delta rule's fp32 matrix per head. Its per-channel
forget gate is g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b(x)); the delta rule's output
goes through an RMSNorm gated by sigmoid(g_b(g_a(x))), then o_proj.

The MLA layers are DeepSeek's absorbed MLA with the shared key part left unrotated (the checkpoints' "NoPE").
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.state import StateRound
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.kernels import delta_rule, ssm
from pressroom.model.layers import state
from pressroom.model.layers.fused_moe import RouterConfig, select_experts
from pressroom.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pressroom.model.layers.state import RecurrentLayer, StateShape
from pressroom.model.lazy_weight import materialize
from pressroom.model.models.deepseek import DeepseekMoE, DeepseekV3ForCausalLM, MLAAttention
from pressroom.model.models.llama import RopeTables

_SOFTPLUS_LINEAR_ABOVE = 20.0  # HF's softplus returns x itself above this

# KDA checkpoint tensor -> (our parameter, shard); the in_proj rows stack q, k, v, f_a, g_a, b
_KDA_STACKED = {"q_proj": ("in_proj", 0), "k_proj": ("in_proj", 1), "v_proj": ("in_proj", 2),
                "f_a_proj": ("in_proj", 3), "g_a_proj": ("in_proj", 4), "b_proj": ("in_proj", 5),
                "q_conv1d": ("conv", 0), "k_conv1d": ("conv", 1), "v_conv1d": ("conv", 2)}
_KDA_NAME = re.compile(r"\.self_attn\.(" + "|".join(_KDA_STACKED) + r")\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class NoRotation:
    """The rotary interface without a rotation: Kimi's MLA leaves the shared key part as it is."""
    rotary_dim = 0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        empty = positions.new_empty((positions.shape[0], 0), dtype=torch.float32)
        return empty, empty

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x


class NoPEMLAAttention(MLAAttention):
    def _softmax_scale(self, config) -> float:
        return (self.nope + self.rope_dim) ** -0.5  # no rope, so no YaRN rescaling either


class StackedConvWeight(nn.Module):
    """The depthwise conv weight [3 * qkv_dim, width] of q, k and v, each loaded from its own checkpoint tensor
    ([qkv_dim, 1, width])."""

    def __init__(self, part_channels: int, width: int) -> None:
        super().__init__()
        self.part_channels = part_channels
        self.weight = nn.Parameter(torch.empty(3 * part_channels, width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        part = materialize(loaded)
        if part.shape != (self.part_channels, 1, param.shape[1]):
            raise ValueError(f"conv weight has shape {tuple(part.shape)}; the model expects "
                             f"{(self.part_channels, 1, param.shape[1])}.")
        param.data[shard_id * self.part_channels:(shard_id + 1) * self.part_channels].copy_(part.squeeze(1))


def _load_reshaped(param: nn.Parameter, loaded: Any) -> None:
    tensor = materialize(loaded)
    if tensor.numel() != param.numel():
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}; the model expects {tuple(param.shape)}.")
    param.data.copy_(tensor.reshape(param.shape))


class KimiDeltaAttention(RecurrentLayer):
    def __init__(self, config) -> None:
        super().__init__()
        if get_tp_size() > 1:  # heads, conv channels and states are not split across ranks
            raise ValueError("Kimi Linear does not run with tensor parallelism yet; use tensor_parallel_size=1.")
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.eps = config.rms_norm_eps
        # one GEMM for every projection of x: q, k, v, the forget gate's and output gate's low ranks, beta
        self.in_proj = MergedColumnParallelLinear(
            hidden, [self.qkv_dim] * 3 + [self.head_dim, self.head_dim, self.num_heads])
        self.conv = StackedConvWeight(self.qkv_dim, config.linear_conv_kernel_dim)
        self.f_b_proj = ColumnParallelLinear(self.head_dim, self.qkv_dim)
        self.g_b_proj = ColumnParallelLinear(self.head_dim, self.qkv_dim)
        # fp32 as HF keeps them: the gate is computed in fp32
        self.A_log = nn.Parameter(torch.empty(1, 1, self.num_heads, 1, dtype=torch.float32), requires_grad=False)
        self.A_log.weight_loader = _load_reshaped  # Moonshot's checkpoints store (1, 1, heads, 1), fla's (heads,)
        self.dt_bias = nn.Parameter(torch.empty(self.qkv_dim, dtype=torch.float32), requires_grad=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim), requires_grad=False)
        self.o_proj = RowParallelLinear(self.qkv_dim, hidden)

    def state_shapes(self) -> dict[str, StateShape]:
        conv = self.conv.weight
        return {"conv": StateShape((conv.shape[0], conv.shape[1] - 1), conv.dtype),
                "recurrent": StateShape((self.num_heads, self.head_dim, self.head_dim), torch.float32)}

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        qkv, f_a, g_a, b = self.in_proj(x).split([3 * self.qkv_dim, self.head_dim, self.head_dim, self.num_heads],
                                                 dim=-1)
        g = self.forget_gate(self.f_b_proj(f_a))
        beta = torch.sigmoid(b)
        mixed = self.run_rounds(self._mix, qkv, g, beta)
        out = self._gated_norm(mixed, self.g_b_proj(g_a).view(tokens, self.num_heads, self.head_dim))
        return self.o_proj(out.view(tokens, self.qkv_dim))

    def forget_gate(self, f: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay [tokens, heads, head_dim] in fp32, as HF computes it."""
        g = (f.float() + self.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        softplus = torch.where(g > _SOFTPLUS_LINEAR_ABOVE, g, torch.log(1.0 + torch.exp(g)))
        return -torch.exp(self.A_log.float().view(self.num_heads, 1)) * softplus

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's channels times sigmoid(gate), fp32 throughout, rounded once at the end."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float()
        return (h * torch.sigmoid(gate.float())).to(x.dtype)

    def _mix(self, r: StateRound, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """One round: conv then delta rule, the decode rows (first) by the one-step kernels, the rest chunked."""
        out = qkv.new_empty(qkv.shape[0], self.num_heads, self.head_dim)
        return self.decodes_then_prefills(r, out, self._decode, self._prefill, qkv, g, beta)

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        conv, states = self.states["conv"], self.states["recurrent"]
        if state.on_triton(qkv):
            from pressroom.kernels.triton import delta_rule as triton_delta_rule
            from pressroom.kernels.triton import ssm as triton_ssm
            q, k, v = self._heads(triton_ssm.causal_conv1d_update_pool(qkv, conv, slots, self.conv.weight, None))
            return triton_delta_rule.fused_recurrent_decode(q, k, v, g, beta, states, slots)
        q, k, v = self._heads(ssm.causal_conv1d_update_pool(qkv, conv, slots, self.conv.weight, None))
        return delta_rule.recurrent_decode_step_pool(q, k, v, g, beta, states, slots)

    def _prefill(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor:
        conv, states = self.states["conv"], self.states["recurrent"]
        if state.on_triton(qkv):
            from pressroom.kernels.triton.delta_rule_chunk import chunk_delta_rule_varlen
            from pressroom.kernels.triton.ssm_prefill import causal_conv1d_varlen
            q, k, v = self._heads(causal_conv1d_varlen(qkv, cu_seqlens, self.conv.weight, None, conv, slots))
            return chunk_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, states, slots)
        q, k, v = self._heads(ssm.causal_conv1d_varlen(qkv, cu_seqlens, self.conv.weight, None, conv, slots))
        out, final = delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, states.index_select(0, slots), cu_seqlens)
        states.index_copy_(0, slots, final)
        return out

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [tokens, heads, head_dim] (views) of the convolved stack."""
        return qkv.view(qkv.shape[0], 3, self.num_heads, self.head_dim).unbind(1)


class KimiMoE(DeepseekMoE):
    """DeepSeek-V3's experts and router, the router in fp32 as HF keeps it (weight and correction bias): in bf16
    the scores of close experts would round together and the choice among them would differ."""

    def __init__(self, config, num_experts: int, router: RouterConfig) -> None:
        super().__init__(config, num_experts, router)
        self.gate.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x.float(), self.gate.weight), self.router,
                                      self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    cuda_graphs_supported = True  # state slots are graph inputs; checked on an H100 (tests/gpu)
    expert_names = ("w1", "w3", "w2")

    def is_kda(self, layer: int) -> bool:
        return self.config.layer_types[layer] == "linear_attention"

    def make_attention(self, layer: int) -> nn.Module:
        return KimiDeltaAttention(self.config) if self.is_kda(layer) else NoPEMLAAttention(self.config)

    def make_mlp(self, layer: int) -> nn.Module | None:
        if self.config.mlp_layer_types[layer] == "dense":
            return None
        return KimiMoE(self.config, self._num_experts(), self.router_config())

    def make_rotary(self) -> NoRotation:
        return NoRotation()

    def rope_interleaved(self) -> bool:
        return False  # nothing is rotated

    # ---- the name map: feed-forward blocks as `mlp` (HF saves dense ones as block_sparse_moe too), KDA stacks

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return ((name.replace(".block_sparse_moe.", ".mlp."), t) for name, t in super().checkpoint_tensors(weights))

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        m = _KDA_NAME.search(name)
        if m is not None and self._in_kda_layer(name):
            param, shard = _KDA_STACKED[m.group(1)]
            return f"{name[:m.start()]}.self_attn.{param}.weight", shard
        return super().checkpoint_target(name)

    def checkpoint_parts(self, name: str) -> list[str]:
        if self._in_kda_layer(name):
            for param in ("in_proj", "conv"):
                stacked = f".self_attn.{param}.weight"
                if name.endswith(stacked):
                    prefix = name.removesuffix(stacked)
                    return [f"{prefix}.self_attn.{part}.weight" for part, (p, _) in _KDA_STACKED.items() if p == param]
        return super().checkpoint_parts(name)

    def _in_kda_layer(self, name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and ".self_attn." in name and self.is_kda(int(m.group(1)))

