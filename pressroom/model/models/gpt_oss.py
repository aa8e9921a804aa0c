"""gpt-oss (GptOssForCausalLM): Llama's layer shape with

- attention: q/k/v/o with biases, GQA, learned per-head sinks (a logit in each softmax's denominator, with no
  value: `Attention(..., sinks)`), sliding-window and full layers as `config.layer_types` says (window
  `config.sliding_window`), YaRN rope shared by both kinds;
- a mixture of experts in every layer: a router with a bias, the top-k logits softmaxed (HF: top-k, then softmax
  over those k; the same weights as a softmax over all experts renormalised over the chosen k), experts with
  gate/up and down biases and the clamped SwiGLU (kernels/moe_activation.py).

Checkpoints: HF's names. Experts ship fused: dense as `experts.gate_up_proj` [experts, hidden, 2 * inter] (x @ W,
gate and up columns interleaved: gate the even ones), `experts.down_proj` [experts, inter, hidden], their biases
`gate_up_proj_bias` [experts, 2 * inter] (interleaved too) and `down_proj_bias` [experts, hidden]; or MXFP4
(`*_blocks` / `*_scales`, model/quantization/mxfp4.py reads them as each expert's gate, up and down). Both are
read as each expert's matrices, lazily, so a tensor-parallel rank reads only its slices.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pressroom.kernels.moe_activation import ClampedSwiglu
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.fused_moe import RouterConfig
from pressroom.model.layers.linear import RowParallelLinear
from pressroom.model.lazy_weight import LazyWeight, materialize
from pressroom.model.models.llama import LlamaAttention, RopeTables
from pressroom.model.models.moe import SparseMoeBlock, _MoeForCausalLM

SLIDING = "sliding_attention"
_HF_ROUTER, _ROUTER = ".mlp.router.", ".mlp.gate."  # HF's name for the router, SparseMoeBlock's


class GptOssAttention(LlamaAttention):
    def __init__(self, config, layer_type: str) -> None:
        super().__init__(config, qk_norm=False)  # q, k, v biased through config.attention_bias
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True,
                                        input_slice=(self.qkv_proj.q_start * self.head_dim,
                                                     self.num_heads * self.head_dim))
        window = config.sliding_window if layer_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5,
                              sliding_window=window)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)  # this rank's heads'
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: Any) -> None:
        if tuple(loaded.shape) != (self.qkv_proj.total_heads,):
            raise ValueError(f"sinks of shape {tuple(loaded.shape)}; the model has one per attention head.")
        param.data.copy_(materialize(loaded.narrow(0, self.qkv_proj.q_start, self.num_heads)))

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        heads = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = heads[:, :self.num_heads + self.num_kv_heads], heads[:, self.num_heads + self.num_kv_heads:]
        qk = rope.rotary.rotate(qk, rope.cos, rope.sin)
        return self.o_proj(self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v, self.sinks))


class GptOssForCausalLM(_MoeForCausalLM):
    applies_sliding_window = True  # its sliding layers mask by window: contexts may run past it

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        act = ClampedSwiglu(getattr(c, "swiglu_alpha", 1.702), getattr(c, "swiglu_limit", 7.0))
        return SparseMoeBlock(c.hidden_size, c.num_local_experts, c.intermediate_size,
                              RouterConfig(top_k=c.num_experts_per_tok, renormalize=True), router_bias=True, bias=True,
                              activation=act)

    def make_attention(self, layer: int) -> nn.Module:
        return GptOssAttention(self.config, _layer_types(self.config)[layer])

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        return super().checkpoint_target(name.replace(_HF_ROUTER, _ROUTER))

    def checkpoint_parts(self, name: str) -> list[str]:
        return [p.replace(_ROUTER, _HF_ROUTER) for p in super().checkpoint_parts(name)]

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return per_expert(weights)

    def to_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """bench gpu's HF names (stacked experts as `experts.gate_up_proj` [experts, 2 * inter, hidden], gate rows
        then up rows) -> HF's gpt-oss: the router's name, fused experts as x @ W with gate and up interleaved."""
        out = {}
        for name, tensor in state.items():
            name = name.replace(_ROUTER, _HF_ROUTER)
            if name.endswith(".experts.gate_up_proj"):
                tensor = _interleave(tensor).transpose(1, 2)
            elif name.endswith(".experts.down_proj"):
                tensor = tensor.transpose(1, 2)
            elif name.endswith(".experts.w13_bias"):
                name, tensor = name.replace(".w13_bias", ".gate_up_proj_bias"), _interleave(tensor)
            elif name.endswith(".experts.w2_bias"):
                name = name.replace(".w2_bias", ".down_proj_bias")
            out[name] = tensor
        return out


def _interleave(stacked: torch.Tensor) -> torch.Tensor:
    """[experts, gate rows then up rows, ...] -> gate and up rows alternating (gate first), as HF stores them."""
    gate, up = stacked.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # HF's default: sliding first, alternating
        types = [SLIDING if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
    return list(types)


# HF's fused expert tensors -> (per-expert name parts, parity of the columns each takes: None for all)
_FUSED = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}
_FUSED_NAME = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


def per_expert(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """HF's fused dense experts (and the biases an MXFP4 checkpoint ships beside its blocks) as each expert's
    matrices [out, in] and biases [out] under per-expert names; everything else as it comes."""
    for name, tensor in weights:
        m = _FUSED_NAME.match(name)
        if m is None:
            yield name, tensor
            continue
        stem, fused, bias = m.groups()
        stacked = _lazy(tensor)
        expected = 2 if bias else 3
        if stacked.dim() != expected:
            raise ValueError(f"{name} has shape {tuple(stacked.shape)}; gpt-oss's fused experts are "
                             f"{expected}-dimensional.")
        for expert in range(stacked.shape[0]):
            for part, parity in _FUSED[fused]:
                if bias:
                    yield f"{stem}.{expert}.{part}.bias", _expert_bias(stacked, expert, parity)
                else:
                    yield f"{stem}.{expert}.{part}.weight", _expert_matrix(stacked, expert, parity)


def _lazy(tensor: Any) -> LazyWeight:
    if isinstance(tensor, LazyWeight):
        return tensor
    return LazyWeight(tuple(tensor.shape), tensor.dtype, lambda index: tensor[tuple(slice(a, b) for a, b in index)])


def _columns(parity: int | None) -> tuple[int, int]:
    """(step, first) of the interleaved columns a part takes: gate the even ones, up the odd ones."""
    return (1, 0) if parity is None else (2, parity)


def _expert_matrix(stacked: LazyWeight, expert: int, parity: int | None) -> LazyWeight:
    """Expert `expert`'s [out, in] from HF's [experts, in, out] (x @ W), its even or odd output columns only."""
    _, inputs, outputs = stacked.shape
    step, first = _columns(parity)
    one = stacked.narrow(0, expert, 1)

    def read(index) -> torch.Tensor:
        (r0, r1), (c0, c1) = index
        part = one.narrow(1, c0, c1 - c0).narrow(2, step * r0, step * (r1 - r0)).load()
        return part[0, :, first::step].t().contiguous()

    return LazyWeight((outputs // step, inputs), stacked.dtype, read)


def _expert_bias(stacked: LazyWeight, expert: int, parity: int | None) -> LazyWeight:
    """Expert `expert`'s bias [out] from [experts, out], its even or odd entries only."""
    step, first = _columns(parity)
    one = stacked.narrow(0, expert, 1)

    def read(index) -> torch.Tensor:
        ((r0, r1),) = index
        return one.narrow(1, step * r0, step * (r1 - r0)).load()[0, first::step].contiguous()

    return LazyWeight((stacked.shape[1] // step,), stacked.dtype, read)
