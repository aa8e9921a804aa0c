"""Mixture-of-experts families on the Llama layers: Mixtral, Qwen2-MoE (a sigmoid-gated shared expert)
and Qwen3-MoE (q/k norm). Attention is the Llama family's; the feed-forward block of each sparse layer is
a router, FusedMoE over the routed experts and, where the family has one, a shared expert (on CUDA folded into the
routed experts' kernels: FusedMoE.shared_experts_of)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from pressroom.distributed.parallel_state import expert_parallel, get_tp_rank, get_tp_size, tp_all_reduce
from pressroom.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE, RouterConfig, select_experts
from pressroom.model.models.llama import LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:  # the Triton module loads where its kernels run
    from pressroom.kernels.triton.fused_moe import SharedExperts


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, intermediate: int, router: RouterConfig,
                 shared_intermediate: int = 0, gated_shared: bool = False, router_bias: bool = False,
                 **expert_options) -> None:
        """`router_bias`: the router's logits have a bias (gpt-oss); `expert_options`: FusedMoE's (gpt-oss's expert
        biases and activation)."""
        super().__init__()
        self.router = router
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)  # replicated: every rank routes every token
        self.gate.requires_grad_(False)
        self.experts = _rank_experts(num_experts, hidden, intermediate, **expert_options)
        self.shared_expert = LlamaMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = None
        if gated_shared:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.experts.shared_experts_of(self.shared_expert) if x.is_cuda else None
        if shared is not None:
            return self.forward_folded(x, shared)
        weights, ids = select_experts(self.gate(x), self.router)
        out = tp_all_reduce(self.experts(x, weights, ids))  # each rank's experts, or slices of them
        if self.shared_expert is not None:  # tensor-parallel as a dense MLP: reduced inside
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def forward_folded(self, x: torch.Tensor, shared: SharedExperts) -> torch.Tensor:
        """forward with the shared expert folded into the routed experts' kernels (`shared`: shared_experts_of's),
        its sigmoid gate a routing weight: one pair of expert launches and one reduction for both."""
        gate = None if self.shared_expert_gate is None else (x, self.shared_expert_gate.weight)
        weights, ids = select_experts(self.gate(x), self.router, shared=shared.count, shared_gate=gate)
        return tp_all_reduce(self.experts(x, weights, ids, shared))


def _rank_experts(num_experts: int, hidden: int, intermediate: int, **options) -> FusedMoE:
    """This rank's experts: with expert parallelism a contiguous range of whole experts (as even as they go),
    otherwise every expert's slice of intermediate features. `options`: FusedMoE's (gpt-oss's biases and
    activation)."""
    tp, rank = get_tp_size(), get_tp_rank()
    if not expert_parallel():
        return FusedMoE(num_experts, hidden, intermediate, inter_shard=(rank, tp), **options)
    if num_experts < tp:
        raise ValueError(f"{num_experts} experts cannot be spread over {tp} ranks; turn expert parallelism off.")
    base, extra = divmod(num_experts, tp)
    start = rank * base + min(rank, extra)
    return FusedMoE(num_experts, hidden, intermediate, expert_range=(start, start + base + (rank < extra)), **options)


# checkpoint expert tensor -> (FusedMoE parameter, part); an expert's bias (gpt-oss) loads into that parameter's _bias
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|bias)$")
_PARTS = {"gate_proj": ("w13", GATE), "up_proj": ("w13", UP), "down_proj": ("w2", DOWN),
          "w1": ("w13", GATE), "w3": ("w13", UP), "w2": ("w2", DOWN)}


class _MoeForCausalLM(LlamaForCausalLM):
    """Shared loading: per-expert checkpoint tensors stack into the layer's FusedMoE parameters."""
    block_name = "mlp"  # the checkpoint's name for a layer's feed-forward block
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def is_sparse(self, layer: int) -> bool:
        c = self.config
        step = getattr(c, "decoder_sparse_step", 1) or 1
        return layer not in (getattr(c, "mlp_only_layers", None) or []) and (layer + 1) % step == 0

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        name = name.replace(f".{self.block_name}.", ".mlp.")
        m = _EXPERT.search(name)
        if m is None:
            return super().checkpoint_target(name)
        param, part = _PARTS[m.group(2)]
        bias = "_bias" if m.group(3) == "bias" else ""
        return name[:m.start()] + f".experts.{param}{bias}", (part, int(m.group(1)))

    def checkpoint_parts(self, name: str) -> list[str]:
        for param, names in (("w13", self.expert_names[:2]), ("w2", self.expert_names[2:])):
            for stacked, kind in ((f".experts.{param}", "weight"), (f".experts.{param}_bias", "bias")):
                if name.endswith(stacked):
                    block = name.removesuffix(stacked).replace(".mlp", f".{self.block_name}")
                    return [f"{block}.experts.{e}.{n}.{kind}" for e in range(self._num_experts()) for n in names]
        return [p.replace(".mlp.", f".{self.block_name}.") if ".gate." in p else p
                for p in super().checkpoint_parts(name)]

    def _num_experts(self) -> int:
        c = self.config
        return getattr(c, "num_local_experts", None) or c.num_experts


class MixtralForCausalLM(_MoeForCausalLM):
    block_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        return SparseMoeBlock(c.hidden_size, c.num_local_experts, c.intermediate_size,
                              RouterConfig(top_k=c.num_experts_per_tok, renormalize=True))


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module | None:
        c = self.config
        if not self.is_sparse(layer):
            return None
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.moe_intermediate_size,
                              RouterConfig(top_k=c.num_experts_per_tok, renormalize=bool(c.norm_topk_prob)),
                              shared_intermediate=c.shared_expert_intermediate_size, gated_shared=True)


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    qk_norm = True

    def make_mlp(self, layer: int) -> nn.Module | None:
        c = self.config
        if not self.is_sparse(layer):
            return None
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.moe_intermediate_size,
                              RouterConfig(top_k=c.num_experts_per_tok, renormalize=bool(c.norm_topk_prob)))
