"""Qwen3-Next: Gated DeltaNet linear-attention layers interleaved with gated full-attention layers (by default
every fourth layer, `layer_types` in the config), each followed by a sparse MoE with a sigmoid-gated shared
expert (or a dense MLP on `mlp_only_layers`).

Gated DeltaNet (a `RecurrentLayer`): one projection gives q, k (per key head), v, z (per value head) and the
per-value-head b (beta = sigmoid(b)) and a (the log-decay g = -exp(A_log) * softplus(a + dt_bias)); q, k, v go
through a causal depthwise conv with SiLU (its conv state: the last w-1 inputs), then the gated delta rule
(kernels/delta_rule.py; a float32 state [H_v, d_k, d_v] per request), then an RMSNorm of each value head gated by
silu(z) (normalised first, then gated), then the output projection. The checkpoint lays in_proj_qkvz out per key
head ([q_g, k_g, v_g, z_g] for each key head g, v_g and z_g holding that head's H_v / H_k value heads) and
in_proj_ba as [b_g, a_g]; loading reorders the rows to [q | k | v | z | b | a], so the conv input is one
contiguous slice of the projection.

Tensor parallelism deals out whole key heads (with their value heads) and whole attention heads (`head_split`):
each rank's rows of every stacked part, conv channels, A_log and dt_bias are its heads'; the output projections
are row-parallel, the experts and MLPs as in the other MoE families.

Gated attention: q_proj yields per head [q_h | gate_h]; q and k are RMS-normed per head, rotated over the first
partial_rotary_factor of the head (NeoX layout), and the attention output is scaled by sigmoid(gate).

Every Qwen3-Next RMSNorm but the gated one scales by (1 + w): the parameter holds 1 + w (GemmaRMSNorm's load).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.state import StateRound
from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size
from pressroom.kernels import delta_rule, ssm
from pressroom.model.layers import state
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.fused_moe import RouterConfig
from pressroom.model.layers.linear import LinearBase, RowParallelLinear, head_split
from pressroom.model.layers.state import RecurrentLayer, StateShape
from pressroom.model.lazy_weight import materialize
from pressroom.model.models.gemma3 import GemmaRMSNorm
from pressroom.model.models.llama import LlamaMLP, RopeTables, rotary_from_config
from pressroom.model.models.moe import SparseMoeBlock, _MoeForCausalLM

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(config) -> list[str]:
    """The config's layer kinds, or every `full_attention_interval`-th layer full attention (older configs)."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    interval = getattr(config, "full_attention_interval", 4)
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(config.num_hidden_layers)]


@dataclass(frozen=True, slots=True)
class GdnShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int

    @classmethod
    def of(cls, config) -> GdnShape:
        return cls(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # the conv runs over q, k and v
        return 2 * self.key_dim + self.value_dim

    @property
    def group(self) -> int:  # value heads per key head
        return self.num_v_heads // self.num_k_heads

    def local(self, tp_size: int) -> GdnShape:
        """One rank's share: num_k_heads / tp_size key heads with their value heads."""
        if self.num_k_heads % tp_size:
            raise ValueError(f"{self.num_k_heads} linear-attention key heads cannot be split over {tp_size} ranks.")
        return GdnShape(self.num_k_heads // tp_size, self.num_v_heads // tp_size, self.head_k_dim, self.head_v_dim,
                        self.conv_width)


def reorder_qkvz(w: torch.Tensor, s: GdnShape) -> torch.Tensor:
    """in_proj_qkvz rows from per-key-head groups [q_g, k_g, v_g, z_g] to [q | k | v | z]."""
    vz = s.group * s.head_v_dim
    parts = w.reshape(s.num_k_heads, 2 * s.head_k_dim + 2 * vz, -1).split((s.head_k_dim, s.head_k_dim, vz, vz), 1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts])


def reorder_ba(w: torch.Tensor, s: GdnShape) -> torch.Tensor:
    """in_proj_ba rows from per-key-head groups [b_g, a_g] to [b | a]."""
    parts = w.reshape(s.num_k_heads, 2 * s.group, -1).split((s.group, s.group), 1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts])


def rank_rows(w: torch.Tensor, part_sizes: tuple[int, ...], tp_size: int, rank: int) -> torch.Tensor:
    """This rank's even share of the rows of each of w's stacked parts, stacked again."""
    shares = (p.narrow(0, rank * (p.shape[0] // tp_size), p.shape[0] // tp_size) for p in w.split(part_sizes))
    return torch.cat(list(shares))


def rank_rows_loader(part_sizes: tuple[int, ...]) -> Callable[..., None]:
    """A weight_loader that keeps this rank's rows of each part (the conv's q, k, v channels; A_log, dt_bias)."""
    tp_size, rank = get_tp_size(), get_tp_rank()

    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        loaded = materialize(loaded)
        if loaded.shape[0] != sum(part_sizes) or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; the model expects "
                             f"{(sum(part_sizes), *param.shape[1:])}.")
        param.data.copy_(rank_rows(loaded, part_sizes, tp_size, rank))
    return load


class GdnInProjection(LinearBase):
    """in_proj_qkvz ("qkvz") and in_proj_ba ("ba") in one matrix, rows [q | k | v | z | b | a] of this rank's
    heads (module docstring)."""

    def __init__(self, hidden_size: int, shape: GdnShape) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.full, local = shape, shape.local(self.tp_size)
        self.ba_row = local.conv_dim + local.value_dim  # where b and a start
        super().__init__(hidden_size, self.ba_row + 2 * local.num_v_heads, bias=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        s, loaded = self.full, materialize(loaded)
        if shard_id == "qkvz":
            rows, offset, reordered = s.conv_dim + s.value_dim, 0, reorder_qkvz
            parts = (s.key_dim, s.key_dim, s.value_dim, s.value_dim)
        else:
            rows, offset, reordered, parts = 2 * s.num_v_heads, self.ba_row, reorder_ba, (s.num_v_heads,) * 2
        if tuple(loaded.shape) != (rows, param.shape[1]):
            raise ValueError(f"in_proj_{shard_id} has shape {tuple(loaded.shape)}; the model expects "
                             f"{(rows, param.shape[1])}.")
        self._store_rows(param, offset, rank_rows(reordered(loaded, s), parts, self.tp_size, self.tp_rank))


class GatedRMSNorm(nn.Module):
    """Qwen3-Next's per-head output norm: RMSNorm (weight w, not 1 + w), then times silu(gate)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)  # rounded to x's dtype before the weight, as HF does
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(RecurrentLayer):
    def __init__(self, config) -> None:
        super().__init__()
        full = GdnShape.of(config)
        s = self.shape = full.local(get_tp_size())  # this rank's heads
        self.in_proj = GdnInProjection(config.hidden_size, full)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_width, groups=s.conv_dim, bias=False)
        self.conv1d.requires_grad_(False)
        self.conv1d.weight.weight_loader = rank_rows_loader((full.key_dim, full.key_dim, full.value_dim))
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads), requires_grad=False)
        for p in (self.dt_bias, self.A_log):
            p.weight_loader = rank_rows_loader((full.num_v_heads,))
        self.norm = GatedRMSNorm(s.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(full.value_dim, config.hidden_size)

    def state_shapes(self) -> dict[str, StateShape]:
        s = self.shape
        return {"conv": StateShape((s.conv_dim, s.conv_width - 1), self.conv1d.weight.dtype),
                "ssm": StateShape((s.num_v_heads, s.head_k_dim, s.head_v_dim), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        qkv, z, b, a = self.in_proj(x).split((s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads), dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log-decay, fp32
        core = self.run_rounds(self._mix, qkv, g, beta)  # [T, H_v, d_v]
        out = self.norm(core, z.reshape(-1, s.num_v_heads, s.head_v_dim))
        return self.out_proj(out.flatten(1))

    def _mix(self, r: StateRound, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """One round: the conv then the delta rule, the decode rows (the first num_decodes) by the one-step
        kernels, the rest chunked; each request's states read from and written back to its slot."""
        out = qkv.new_empty(qkv.shape[0], self.shape.num_v_heads, self.shape.head_v_dim)
        return self.decodes_then_prefills(r, out, self._decode, self._prefill, qkv, g, beta)

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        conv, pool, weight = self.states["conv"], self.states["ssm"], self.conv1d.weight.squeeze(1)
        if state.on_triton(qkv):
            from pressroom.kernels.triton import delta_rule as triton_delta_rule
            from pressroom.kernels.triton import ssm as triton_ssm
            q, k, v = self._heads(triton_ssm.causal_conv1d_update_pool(qkv, conv, slots, weight, None))
            return triton_delta_rule.fused_recurrent_decode(q, k, v, g, beta, pool, slots)
        q, k, v = self._heads(ssm.causal_conv1d_update_pool(qkv, conv, slots, weight, None))
        return delta_rule.recurrent_decode_step_pool(q, k, v, g, beta, pool, slots)

    def _prefill(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor:
        conv, pool, weight = self.states["conv"], self.states["ssm"], self.conv1d.weight.squeeze(1)
        if state.on_triton(qkv):
            from pressroom.kernels.triton.delta_rule_chunk import chunk_delta_rule_varlen
            from pressroom.kernels.triton.ssm_prefill import causal_conv1d_varlen
            q, k, v = self._heads(causal_conv1d_varlen(qkv, cu_seqlens, weight, None, conv, slots))
            return chunk_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, pool, slots)
        q, k, v = self._heads(ssm.causal_conv1d_varlen(qkv, cu_seqlens, weight, None, conv, slots))
        out, final = delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, pool.index_select(0, slots), cu_seqlens)
        pool.index_copy_(0, slots, final)
        return out

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [tokens, H_k, d_k] and v [tokens, H_v, d_v] (views) of the convolved [q | k | v]."""
        s = self.shape
        q, k, v = mixed.split((s.key_dim, s.key_dim, s.value_dim), dim=-1)
        return (q.unflatten(-1, (s.num_k_heads, s.head_k_dim)), k.unflatten(-1, (s.num_k_heads, s.head_k_dim)),
                v.unflatten(-1, (s.num_v_heads, s.head_v_dim)))


class GatedQKVLinear(LinearBase):
    """q_proj (per head [q_h | gate_h]), k_proj and v_proj (shards 0, 1, 2) in one matrix, this rank's heads only
    (`head_split`, as QKVParallelLinear)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = head_split(
            num_heads, num_kv_heads, get_tp_size(), get_tp_rank())
        self.sizes = (2 * self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim)
        super().__init__(hidden_size, sum(self.sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        d, (q_size, kv_size, _) = self.head_dim, self.sizes
        offset, size, start, rows = ((0, q_size, 2 * self.q_start * d, 2 * self.total_heads * d),
                                     (q_size, kv_size, self.kv_start * d, self.total_kv_heads * d),
                                     (q_size + kv_size, kv_size, self.kv_start * d, self.total_kv_heads * d))[shard_id]
        if tuple(loaded.shape) != (rows, *param.shape[1:]):
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; the model expects {(rows, *param.shape[1:])}.")
        self._store_rows(param, offset, loaded.narrow(0, start, size))


class GatedAttention(nn.Module):
    """Full attention whose output is scaled by sigmoid of a per-head gate that q_proj also yields."""

    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = hd = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = GatedQKVLinear(config.hidden_size, hd, config.num_attention_heads,
                                       config.num_key_value_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.sizes = self.qkv_proj.sizes
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=bias,
                                        input_slice=(self.qkv_proj.q_start * hd, self.num_heads * hd))
        self.attn = Attention(self.num_heads, hd, self.num_kv_heads, hd ** -0.5)

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q_gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim))
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = rope.rotary.rotate(qk, rope.cos, rope.sin)  # q and k heads rotated in one pass
        out = self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v.unflatten(-1, (self.num_kv_heads, -1)))
        return self.o_proj(out * torch.sigmoid(gate.flatten(1)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, kind: str, mlp: nn.Module) -> None:
        super().__init__()
        self.linear = kind == LINEAR
        if self.linear:  # the checkpoint's names: linear_attn or self_attn
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: RopeTables, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x) if self.linear else self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def rotary_dim(config) -> int:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(config.head_dim * factor)


class Qwen3NextModel(nn.Module):
    def __init__(self, config, make_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, kind, make_mlp(i))
                                    for i, kind in enumerate(layer_types(config)))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary_from_config(config, rotary_dim(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states; with `aux_layers`, also the residual stream after each of those layers."""
        x, residual = self.embed_tokens(input_ids), None
        rope = RopeTables(self.rotary, *self.rotary.cos_sin(positions))
        taps = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = self.norm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x


# checkpoint name part -> (our parameter's name part, shard id)
_PROJECTIONS = {".self_attn.q_proj.": (".self_attn.qkv_proj.", 0), ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
                ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
                ".linear_attn.in_proj_qkvz.": (".linear_attn.in_proj.", "qkvz"),
                ".linear_attn.in_proj_ba.": (".linear_attn.in_proj.", "ba")}


class Qwen3NextForCausalLM(_MoeForCausalLM):
    cuda_graphs_supported = True  # state slots are graph inputs; checked on an H100 (tests/gpu)

    def __init__(self, config) -> None:
        nn.Module.__init__(self)  # Llama's body is not built: the layers are Qwen3-Next's own
        self.config = config
        self.model = Qwen3NextModel(config, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        if c.num_experts == 0 or not self.is_sparse(layer):
            return LlamaMLP(c.hidden_size, c.intermediate_size)
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.moe_intermediate_size,
                              RouterConfig(top_k=c.num_experts_per_tok, renormalize=bool(c.norm_topk_prob)),
                              shared_intermediate=c.shared_expert_intermediate_size, gated_shared=True)

    def skips(self, name: str) -> bool:
        return name.startswith("mtp.") or super().skips(name)  # the multi-token-prediction head is not used

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        for part, (ours, shard_id) in _PROJECTIONS.items():
            if part in name:
                return name.replace(part, ours), shard_id
        return super().checkpoint_target(name)

    def checkpoint_parts(self, name: str) -> list[str]:
        parts = [name.replace(ours, part) for part, (ours, _) in _PROJECTIONS.items() if ours in name]
        return parts or super().checkpoint_parts(name)
