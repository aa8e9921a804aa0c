"""Mixture-of-experts: the router's expert choice and the experts' SwiGLU MLPs over the chosen tokens.

`select_experts` turns router logits into each token's top-k experts and their weights, for the router
variants real checkpoints use: softmax top-k with or without renormalising (Mixtral, Qwen2/3-MoE), and
sigmoid scores with a correction bias, grouped top-k and a routed scaling factor (DeepSeek-V3, GLM-4.5,
Kimi). `FusedMoE` holds the experts' weights stacked ([experts, 2 * inter, hidden] for gate and up,
[experts, hidden, inter] for down) for the range of experts this rank owns, and computes only the
experts some token chose: the tokens are sorted by expert, each expert runs once over its rows. A
quantization method may hold the experts instead (`set_quant_method`: a `MoeMethod`, model/quantization/: MXFP4 and
NVFP4 in fp4.py, DeepSeek's FP8 blocks in fp8.py), in its own form and with its own kernels.
Options for gpt-oss: expert biases (`w13_bias` [experts, 2 * inter], `w2_bias` [experts, hidden]) and its
clamped SwiGLU (kernels/moe_activation.py) in place of SwiGLU. For Nemotron-H: experts with no gate half
(activation `Relu2`): `w13` holds only the up matrices [experts, inter, hidden], relu(up)² feeds down.

Shared experts on CUDA (`shared_experts_of`): a block's dense shared MLP joins the routed experts' Triton kernels as
extra experts every token routes to (ids num_experts ..; select_experts appends them with their weights), read in
place from the MLP's weights: one pair of launches for routed and shared. The CPU keeps the MLP as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels.moe_activation import ClampedSwiglu, Relu2, gated
from pressroom.model.layers.activation import SiluAndMul
from pressroom.model.layers.deferred import held_weight
from pressroom.model.lazy_weight import materialize
from pressroom.model.quantization.base import MoeMethod

if TYPE_CHECKING:  # the Triton module loads where its kernels run
    from pressroom.kernels.triton.fused_moe import SharedExperts

# A stacked parameter's part: gate (w1), up (w3) and down (w2), as Mixtral names them.
GATE, UP, DOWN = "w1", "w3", "w2"


@dataclass(slots=True, frozen=True)
class RouterConfig:
    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True  # the chosen weights sum to one
    num_groups: int = 1  # grouped top-k: experts in groups, only the best topk_groups groups compete
    topk_groups: int = 1
    group_score: str = "top2_sum"  # a group's score: its two best experts' sum (DeepSeek-V3) or its "max" (V2)
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown router scoring {self.scoring!r}; use 'softmax' or 'sigmoid'.")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"unknown group score {self.group_score!r}; use 'top2_sum' or 'max'.")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_group ({self.topk_groups}) is larger than n_group ({self.num_groups}).")


def select_experts(logits: torch.Tensor, cfg: RouterConfig, correction_bias: torch.Tensor | None = None,
                   shared: int = 0, shared_gate: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts ([tokens, top_k + shared], int64 or, on CUDA, int32) and their weights (fp32). The
    correction bias (sigmoid routers) steers which experts are chosen, never their weights. `shared`: that many
    shared experts appended to every token (ids experts .. experts + shared - 1), weighted 1, or sigmoid(x . gate)
    with `shared_gate` (x, gate weight [1, hidden]: Qwen2-MoE's)."""
    if logits.is_cuda:  # one Triton launch instead of a handful (grouped routers: a dozen) of torch ones
        from pressroom.kernels.triton.fused_moe import route_topk
        return route_topk(logits, cfg.top_k, cfg.scoring == "sigmoid", cfg.renormalize, cfg.routed_scaling_factor,
                          correction_bias, shared, shared_gate, router_groups(cfg))
    weights, ids = select_experts_torch(logits, cfg, correction_bias)
    return with_shared(weights, ids, logits.shape[1], shared, shared_gate)


def router_groups(cfg: RouterConfig) -> tuple[int, int, bool] | None:
    """route_topk's `groups` for a grouped router (None for one group)."""
    return None if cfg.num_groups == 1 else (cfg.num_groups, cfg.topk_groups, cfg.group_score == "top2_sum")


def with_shared(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, shared: int,
                shared_gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts' top-k with `shared` shared experts appended (see select_experts)."""
    if not shared:
        return weights, ids
    tokens = ids.shape[0]
    if shared_gate is None:
        gate = torch.ones(tokens, 1, dtype=weights.dtype, device=weights.device)
    else:
        x, w = shared_gate
        gate = torch.sigmoid(x.float() @ w.float().reshape(-1, 1))
    extra = torch.arange(num_experts, num_experts + shared, dtype=ids.dtype, device=ids.device)
    return torch.cat((weights, gate.expand(tokens, shared)), dim=1), torch.cat((ids, extra.expand(tokens, -1)), dim=1)


def select_experts_torch(logits: torch.Tensor, cfg: RouterConfig, correction_bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        best = 2 if cfg.group_score == "top2_sum" else 1
        choice = _mask_unchosen_groups(choice, cfg.num_groups, cfg.topk_groups, best)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
    return weights * cfg.routed_scaling_factor, ids


def _mask_unchosen_groups(choice: torch.Tensor, num_groups: int, topk_groups: int, best: int) -> torch.Tensor:
    """A group's score is the sum of its `best` best experts (DeepSeek-V3: 2, V2: 1, the max); experts
    outside the best `topk_groups` groups cannot be chosen."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(min(best, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


class FusedMoE(nn.Module):
    """The routed experts of one layer. `expert_range` ([start, end) of the global expert ids): the experts
    this rank holds; a token routed elsewhere contributes nothing here (expert parallelism sums ranks).
    `inter_shard` (rank, ranks): the slice of every expert's intermediate features this rank holds (tensor
    parallelism: each rank's output is a partial sum, too). `bias`: each expert's gate/up and down projections add
    a bias (gpt-oss); `activation`: the clamped SwiGLU instead of SwiGLU (gpt-oss), or `Relu2` for experts with
    no gate half (Nemotron-H: w13 holds the up matrices alone, [experts, inter, hidden])."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 expert_range: tuple[int, int] | None = None, inter_shard: tuple[int, int] = (0, 1),
                 bias: bool = False, activation: ClampedSwiglu | Relu2 | None = None) -> None:
        super().__init__()
        start, end = expert_range or (0, num_experts)
        if not 0 <= start < end <= num_experts:
            raise ValueError(f"expert range [{start}, {end}) is not inside the model's {num_experts} experts.")
        rank, ranks = inter_shard
        if intermediate % ranks:
            raise ValueError(f"the experts' {intermediate} intermediate features do not split over {ranks} ranks; "
                             "try expert parallelism (enable_expert_parallel).")
        self.num_experts, self.start, self.end = num_experts, start, end
        self.owns_all = (start, end) == (0, num_experts)
        self.full_intermediate = intermediate
        intermediate //= ranks
        self.hidden, self.intermediate, self.inter_start = hidden, intermediate, rank * intermediate
        local = end - start
        self.gated = not isinstance(activation, Relu2)
        w13_rows = 2 * intermediate if self.gated else intermediate
        # stand-ins while the loader defers them (layers/deferred.py): a quantization method may hold them instead
        self.w13 = held_weight(local, w13_rows, hidden)
        self.w2 = held_weight(local, hidden, intermediate)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.activation = activation
        self.w13_bias = self.w2_bias = None
        if bias:  # zeros: a rank holding a slice of the inputs of down adds no share of its bias (see bias_loader)
            self.w13_bias = nn.Parameter(torch.zeros(local, w13_rows), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(local, hidden), requires_grad=False)
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.bias_loader
        self.quant_method: MoeMethod | None = None

    def set_quant_method(self, method: MoeMethod) -> None:
        """Before loading: hand the experts to a quantization method (model/quantization/)."""
        if not self.gated:  # the quantized kernels all read a gate half
            raise ValueError(f"{type(method).__name__} cannot hold experts with no gate half (ReLU² experts, "
                             "Nemotron-H); leave them dense.")
        self.quant_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[str, int]) -> None:
        """One expert's gate, up or down matrix, as the checkpoint has it ([out, in]); experts outside
        this rank's range are skipped unread, and of the others only this rank's slice is read."""
        part, expert = shard
        i = self._local_index(expert)
        if i is None:
            return
        inter, full = self.intermediate, self.full_intermediate
        expected = (self.hidden, full) if part == DOWN else (full, self.hidden)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert}'s {part} has shape {tuple(loaded.shape)} where the model config "
                             f"implies {expected}; the checkpoint and config.json disagree.")
        if part == DOWN:
            self._store("w2", i, 0, loaded.narrow(1, self.inter_start, inter))
        else:
            self._store("w13", i, self._up_row(part, expert), loaded.narrow(0, self.inter_start, inter))

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[str, int]) -> None:
        """One expert's gate, up or down bias ([out]). Down's bias is added once per token-expert pair: by the
        rank holding the first slice of the intermediate features (the others' partial sums add none)."""
        part, expert = shard
        i = self._local_index(expert)
        if i is None:
            return
        expected = (self.hidden,) if part == DOWN else (self.full_intermediate,)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert}'s {part} bias has shape {tuple(loaded.shape)} where the model config "
                             f"implies {expected}; the checkpoint and config.json disagree.")
        inter = self.intermediate
        if part == DOWN:
            if self.inter_start == 0:
                param.data[i].copy_(materialize(loaded))
            return
        row = self._up_row(part, expert)
        param.data[i, row:row + inter].copy_(materialize(loaded.narrow(0, self.inter_start, inter)))

    def _up_row(self, part: str, expert: int) -> int:
        """Where a gate or up part begins in w13's rows: gate first, then up; experts with no gate half hold up
        alone."""
        if self.gated:
            return 0 if part == GATE else self.intermediate
        if part == GATE:
            raise ValueError(f"expert {expert} has a gate matrix, but the model's experts have no gate half.")
        return 0

    def _local_index(self, expert: int) -> int | None:
        """Checkpoint expert `expert`'s place among this rank's experts; None where another rank holds it."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} does not exist: the model has {self.num_experts}.")
        return expert - self.start if self.start <= expert < self.end else None

    def _store(self, param: str, expert: int, row: int, loaded) -> None:
        """Rows [row, row + n) of local expert `expert`'s `param`, read now; a quantization method's, if it takes
        them."""
        loaded = materialize(loaded)
        if self.quant_method is not None and self.quant_method.store_rows(self, param, expert, row, loaded):
            return
        getattr(self, param).data[expert].narrow(0, row, loaded.shape[0]).copy_(loaded)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's (-1: an expert another rank holds); folded shared experts' ids (from
        num_experts on) follow this rank's routed experts."""
        if self.owns_all:
            return ids
        routed = torch.where((ids >= self.start) & (ids < self.end), ids - self.start, -1)
        return torch.where(ids >= self.num_experts, ids - self.num_experts + (self.end - self.start), routed)

    def shared_experts_of(self, mlp: nn.Module | None) -> SharedExperts | None:
        """The block's dense shared MLP (gate_up_proj, SiluAndMul, down_proj: Llama's) as a kernels/triton/fused_moe.py
        SharedExperts these experts' kernels fold in; None where they cannot: quantized, biased or hooked (LoRA)
        layers on either side, other activations, or a width on this rank that is not whole experts."""
        if mlp is None or not self._foldable_experts() or not isinstance(getattr(mlp, "act", None), SiluAndMul):
            return None
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if not all(_plain_dense(layer, self.w13) for layer in (gate_up, down)):
            return None
        width = down.weight.shape[1]
        if width % self.intermediate or gate_up.weight.shape != (2 * width, self.hidden) \
                or down.weight.shape[0] != self.hidden:
            return None
        from pressroom.kernels.triton.fused_moe import SharedExperts
        return SharedExperts(gate_up.weight, down.weight, width // self.intermediate)

    def _foldable_experts(self) -> bool:
        return (self.quant_method is None and self.gated and self.activation is None and self.w13_bias is None
                and self.w2_bias is None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: SharedExperts | None = None) -> torch.Tensor:
        """x [tokens, hidden]; weights and ids [tokens, top_k] from select_experts; `shared` (CUDA): the
        SharedExperts that shared_experts_of gave, whose ids select_experts appended."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, weights, ids)
        if x.is_cuda and not self.gated:
            from pressroom.kernels.triton.fused_moe import fused_moe_relu2
            return fused_moe_relu2(x.contiguous(), self.w13, self.w2, weights, self.local_ids(ids),
                                   all_local=self.owns_all, w1_bias=self.w13_bias, w2_bias=self.w2_bias)
        if x.is_cuda or shared is not None:
            return self.forward_triton(x, weights, ids, shared)
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        sorted_ids = flat_ids[order]
        tokens = order // ids.shape[1]
        scale = weights.reshape(-1)[order]
        experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        begin = 0
        for expert, count in zip(experts.tolist(), counts.tolist()):
            rows = slice(begin, begin + count)
            begin += count
            if not self.start <= expert < self.end:
                continue
            local = expert - self.start
            idx = tokens[rows]
            y = F.linear(self._activated(x[idx], local), self.w2[local], _row(self.w2_bias, local))
            out.index_add_(0, idx, y * scale[rows].unsqueeze(1).to(y.dtype))
        return out

    def forward_triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       shared: SharedExperts | None = None) -> torch.Tensor:
        """The Triton kernels (CUDA; the CPU under TRITON_INTERPRET=1): buffers sized by tokens * top_k whatever the
        routing, so the memory profile covers any, and no host sync."""
        from pressroom.kernels.triton.fused_moe import fused_moe
        return fused_moe(x.contiguous(), self.w13, self.w2, weights, self.local_ids(ids), all_local=self.owns_all,
                         w13_bias=self.w13_bias, w2_bias=self.w2_bias, activation=self.activation, shared=shared)

    def _activated(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Local expert `expert`'s first projection of x through its activation: what its down projection reads."""
        projected = F.linear(x, self.w13[expert], _row(self.w13_bias, expert))
        if not self.gated:
            return self.activation(projected)
        gate, up = projected.chunk(2, dim=-1)
        return gated(gate, up, self.activation)


def _plain_dense(layer: nn.Module | None, like: torch.Tensor) -> bool:
    """A linear layer holding a plain weight of `like`'s dtype and device, without bias, quantized forms or hooks."""
    if layer is None or getattr(layer, "bias", None) is not None or layer._forward_hooks or layer._forward_pre_hooks:
        return False
    if any(getattr(layer, form, None) is not None for form in ("quant_method", "ggml", "int4", "onednn")):
        return False
    weight = layer.weight
    return weight.dim() == 2 and weight.dtype == like.dtype and weight.device == like.device and weight.stride(1) == 1


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]
