"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a latent KV cache, and a mixture of experts
with DeepSeek's routers, shared experts and `first_k_dense_replace` dense layers.

MLA caches one vector per token and layer: the normalised KV latent (`kv_lora_rank`) and the rotated
shared key part (`qk_rope_head_dim`). Attention runs in the absorbed form for every step: each head's
W_UK (from kv_b_proj) folds into its query, so scores read the latent directly, and the attention
output (a mix of latents) goes through each head's W_UV afterwards. To the attention backend this is
multi-query attention with one KV head whose values are the first `kv_lora_rank` dimensions of its keys.

DeepSeek rotates interleaved pairs (x[2i], x[2i+1]); the loader permutes the rope rows of q and of the
shared key to (even dims, odd dims), so the rotate-half kernels compute the same rotation.

Decode is launch-bound, so the layer runs in few launches (issue 44). The projections that read x (q_a_proj or
q_proj, kv_a_proj_with_mqa, V3.2's indexer wk) are one GEMM, `fused_qkv_a_proj`, loaded part by part from the
checkpoint's own tensors (vLLM's name). On CUDA, one Triton launch (kernels/triton/mla_prepare.py) normalises the
latent (and V3.2's indexer key), rotates every rope part (V3.2's indexer queries too), lays out the absorbed query
and writes the cache entry into its slot; the backend then attends over the cache as it is. The W_UK and W_UV
products are batched GEMMs over strided views of kv_b_proj (no per-step copies); W_UV writes o_proj's input in
place. V3.2's per-step token positions are made once a step (`sparse_plan`).

Tensor parallelism splits the attention heads evenly over the ranks, as vLLM does: q_b_proj (or q_proj) is
column-parallel by heads, each rank keeps its heads' W_UK and W_UV of kv_b_proj, and o_proj is row-parallel
(its all-reduce joins the heads; fused_qkv_a_proj holds the rank's q_proj rows over the whole latent rows). The
latent path is replicated: q_a_proj, kv_a_proj_with_mqa and their norms,
so every rank computes the same latent and caches it (one KV head, replicated), and V3.2's lightning indexer,
whose top-k is then the same on every rank. The MoE splits as Qwen-MoE's (models/moe.py): each expert's
intermediate features sliced, or whole experts per rank under expert parallelism, the partial sums all-reduced;
shared experts and dense layers split as any dense MLP.

FP8 checkpoints as DeepSeek ships them (128x128 block scales, `weight_scale_inv`; model/quantization/fp8.py)
stay in FP8 in every linear layer: MLA's fused_qkv_a_proj (q_a or q, kv_a_proj_with_mqa, V3.2 indexer's wk: a
checkpoint that left any of them unquantized keeps the fused layer dense), q_b_proj and o_proj, the dense MLPs, the
shared experts, V3.2 indexer's wq_b, and the routed experts (fp8.py's `Fp8MoeMethod`: stacked
with one scale per 128x128 block, run by kernels/triton/fused_moe_fp8.py on CUDA; under tensor parallelism each
rank's share of moe_intermediate_size must be whole blocks, else use expert parallelism). The rope reorder is
exact on them: pressroom keeps a block's scale on each of its rows, so permuting rows moves each row's scales
with it, whatever the block grid. Dequantized at load: kv_b_proj (used as per-head batched matrices in the
absorbed form, never as a linear layer; vLLM dequantizes it too, to form W_UK and W_UV).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pressroom.attention.backend import get_attention_metadata
from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.fused_moe import RouterConfig, select_experts
from pressroom.model.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.layers.rotary import RotaryEmbedding, yarn_mscale
from pressroom.model.lazy_weight import Index, LazyWeight, materialize
from pressroom.model.models.llama import LlamaMLP, RopeTables, rotary_from_config
from pressroom.model.models.moe import _MoeForCausalLM, _rank_experts
from pressroom.model.quantization.fp8 import Fp8Weight

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: the checkpoints' code keeps the default


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole (MLA's latent projections, the indexer's): the ranks compute the same
    output from the same input, with no communication."""
    tp_size = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)} where the model config implies "
                             f"{tuple(param.shape)}; the checkpoint and config.json disagree.")
        self._store_rows(param, 0, loaded)


def heads_per_rank(num_heads: int, tp_size: int) -> int:
    """The attention heads each tensor-parallel rank holds: MLA splits its heads evenly."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({tp_size}): "
                         "DeepSeek's attention splits its heads evenly over the ranks; choose a "
                         f"tensor_parallel_size that divides {num_heads}.")
    return num_heads // tp_size


@dataclass(frozen=True, slots=True)
class InputPart:
    """One projection of the attention input that LatentInputProjection stacks: its checkpoint module under
    self_attn, its output rows (all ranks'), whether tensor parallelism splits those rows by heads (q_proj), and
    whether it has a bias."""
    name: str
    rows: int
    by_heads: bool = False
    bias: bool = False


def input_parts(config, indexer: bool) -> tuple[InputPart, ...]:
    """The projections that read the attention input x, in the order their rows stack: the query's (q_a_proj, or
    q_proj without q_lora_rank), kv_a_proj_with_mqa's, then (`indexer`, V3.2) the lightning indexer's key (wk)."""
    bias = bool(getattr(config, "attention_bias", False))
    if getattr(config, "q_lora_rank", None):
        query = InputPart("q_a_proj", config.q_lora_rank, bias=bias)
    else:  # HF's q_proj has no bias whatever attention_bias says
        query = InputPart("q_proj", config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim),
                          by_heads=True)
    parts = (query, InputPart("kv_a_proj_with_mqa", config.kv_lora_rank + config.qk_rope_head_dim, bias=bias))
    return (*parts, InputPart("indexer.wk", config.index_head_dim)) if indexer else parts


class LatentInputProjection(LinearBase):
    """Every projection of the attention input x in one GEMM (vLLM's fused_qkv_a_proj): `input_parts`' rows stacked,
    each loaded from its own checkpoint tensor (the shard id is its name), the output split back by views. The
    latent parts are replicated and q_proj is split by heads, so each rank's matrix is its heads' q rows over the
    whole latent rows: exact under tensor parallelism. A part without a bias adds zeros. LoRA adapters on these
    parts are not placed (lora/adapter.py knows the qkv and gate-up stacks only) and are refused."""

    def __init__(self, in_features: int, parts: tuple[InputPart, ...]) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.parts = parts
        self.sizes = [p.rows // self.tp_size if p.by_heads else p.rows for p in parts]  # this rank's rows
        super().__init__(in_features, sum(self.sizes), any(p.bias for p in parts))
        if self.bias is not None:
            self.bias.data.zero_()

    def parts_of(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """forward's output [tokens, out_features] as each part's view (forward itself returns the one tensor, as
        every linear layer does, for the hooks that read it)."""
        return y.split(self.sizes, dim=-1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        index = next((i for i, p in enumerate(self.parts) if p.name == shard_id), None)
        if index is None:
            raise ValueError(f"{shard_id!r} is none of the projections this layer stacks "
                             f"({', '.join(p.name for p in self.parts)}).")
        part, size = self.parts[index], self.sizes[index]
        expected = (part.rows, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)} where the model config implies "
                             f"{expected}; the checkpoint and config.json disagree.")
        if part.by_heads:
            loaded = loaded.narrow(0, self.tp_rank * size, size)
        self._store_rows(param, sum(self.sizes[:index]), loaded)


def _norm_rows(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm of x's rows, a strided view of the fused projection's output: on CUDA norm.py's kernel reads the
    rows where they are (the module would take torch's unfused path for a non-contiguous x); elsewhere the
    module's own path, which copies them first."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and not norm.batch_invariant:
        from pressroom.kernels.triton.norm import rms_norm
        return rms_norm(x, norm.weight, norm.eps)
    return norm(x)


class MLAAttention(nn.Module):
    """Multi-head latent attention; under tensor parallelism this rank's `num_heads` of the model's `total_heads`
    (from `head_start`), over a latent every rank computes."""

    indexed = False  # whether the lightning indexer's key joins the input projection (SparseMLAAttention)

    def __init__(self, config) -> None:
        super().__init__()
        self.total_heads, hidden = config.num_attention_heads, config.hidden_size
        heads = self.num_heads = heads_per_rank(self.total_heads, get_tp_size())
        self.head_start = get_tp_rank() * heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        # q_a_proj (or q_proj, column-parallel over whole heads) and kv_a_proj_with_mqa: one GEMM of x
        self.fused_qkv_a_proj = LatentInputProjection(hidden, input_parts(config, self.indexed))
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, self.total_heads * (self.nope + self.rope_dim))
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        # W_UK and W_UV of this rank's heads, used as batched matrices (absorbed), never as a linear layer
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.empty(heads * (self.nope + self.v_dim), self.rank),
                                             requires_grad=False)
        self.kv_b_proj.weight.weight_loader = self._load_kv_b
        self.o_proj = RowParallelLinear(self.total_heads * self.v_dim, hidden, bias=bias)  # by heads: an even split
        self.attn = Attention(heads, self.rank + self.rope_dim, 1, self._softmax_scale(config),
                              v_head_dim=self.rank, latent=True)

    def _load_kv_b(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """kv_b_proj's rows of this rank's heads (each head's W_UK rows, then its W_UV rows)."""
        per_head = self.nope + self.v_dim
        expected = (self.total_heads * per_head, self.rank)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)} where the model config implies "
                             f"{expected}; the checkpoint and config.json disagree.")
        param.data.copy_(materialize(loaded.narrow(0, self.head_start * per_head, param.shape[0])))

    def _softmax_scale(self, config) -> float:
        scale = (self.nope + self.rope_dim) ** -0.5
        rope = _rope_parameters(config)
        if rope.get("rope_type", rope.get("type", "default")) == "yarn" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        return scale

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        _, q, kv, _ = self.inputs(x)
        if q.is_cuda and rope.rotary.rotary_dim == self.rope_dim and self.attn.attends_cached():
            mixed = self.attn.forward_cached(self._prepare_into_cache(rope, q, kv))
        else:
            query, key = self.absorbed_query_and_key(rope, q, kv)
            mixed = self.attn(query, key.unsqueeze(1))
        return self.output(mixed.view(x.shape[0], self.num_heads, self.rank))

    def _prepare_into_cache(self, rope: RopeTables, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """absorbed_query_and_key's query, its cache entry written into the layer's cache slot by the same launch
        (the backend's write_kv launch saved)."""
        from pressroom.kernels.triton.mla_prepare import mla_prepare_into_cache
        norm = self.kv_a_layernorm
        return mla_prepare_into_cache(q, self._absorb(q[..., :self.nope]), kv, norm.weight, norm.eps, rope.cos,
                                      rope.sin, None, self.attn.kv_cache[0], get_attention_metadata().slot_mapping)

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """From the one GEMM of x: the compressed query (None without q_lora_rank), the query [tokens, heads,
        nope + rope], kv_a_proj_with_mqa's output [tokens, rank + rope] (a strided view) and the indexer's key
        before its norm [tokens, index_dim] (a strided view; None unless `indexed`)."""
        query_part, kv, *index_key = self.fused_qkv_a_proj.parts_of(self.fused_qkv_a_proj(x))
        q_resid = _norm_rows(self.q_a_layernorm, query_part) if self.q_lora_rank else None
        q = self.q_b_proj(q_resid) if self.q_lora_rank else query_part
        return q_resid, q.view(x.shape[0], self.num_heads, self.nope + self.rope_dim), kv, \
            (index_key[0] if index_key else None)

    def absorbed_query_and_key(self, rope: RopeTables, q: torch.Tensor, kv: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query in latent space with its rotated rope part [tokens, heads, rank + rope], and the
        token's cache entry [tokens, rank + rope] (the normalised latent and the rotated shared key)."""
        if q.is_cuda and rope.rotary.rotary_dim == self.rope_dim:
            return self.absorbed_query_and_key_in_one_kernel(rope, q, kv)
        q_pe, latent, k_pe = self._rotated_parts(rope, q, kv)
        q_latent = self._absorb(q[..., :self.nope])
        return torch.cat((q_latent.transpose(0, 1), q_pe), dim=-1), torch.cat((latent, k_pe), dim=-1)

    def absorbed_query_and_key_in_one_kernel(self, rope: RopeTables, q: torch.Tensor, kv: torch.Tensor
                                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """absorbed_query_and_key with everything after the W_UK bmm in one Triton launch (the latent's norm, both
        rotations, both concatenations): batch-1 decode is launch-bound. Needs the rope tables to cover all
        qk_rope_head_dim dims."""
        from pressroom.kernels.triton.mla_prepare import mla_prepare
        norm = self.kv_a_layernorm
        return mla_prepare(q, self._absorb(q[..., :self.nope]), kv, norm.weight, norm.eps, rope.cos, rope.sin)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Each head's nope query [tokens, heads, nope] through its W_UK: [heads, tokens, rank]. Both operands are
        strided views (q's rows, kv_b_proj's W_UK rows of each head) that the batched GEMM reads as they are."""
        w_uk = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)[:, :self.nope]
        return torch.bmm(q_nope.transpose(0, 1), w_uk)

    def _rotated_parts(self, rope: RopeTables, q: torch.Tensor, kv: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """In torch: q's rope part rotated [tokens, heads, rope], the normalised latent [tokens, rank] and the
        rotated shared key [tokens, rope]."""
        latent, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # q's and the shared key's rope parts rotated in one pass, as one stack of heads
        pe = torch.cat((q[..., self.nope:], k_pe.unsqueeze(1)), dim=1).contiguous()
        pe = rope.rotary.rotate(pe, rope.cos, rope.sin)
        return pe[:, :self.num_heads], latent, pe[:, self.num_heads]

    def project(self, rope: RopeTables, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The compressed query (None without q_lora_rank), each head's query parts [tokens, heads, nope] and
        [tokens, heads, rope] (rotated), the normalised latent [tokens, rank] and the rotated shared key
        [tokens, rope]."""
        q_resid, q, kv, _ = self.inputs(x)
        q_pe, latent, k_pe = self._rotated_parts(rope, q, kv)
        return q_resid, q[..., :self.nope], q_pe, latent, k_pe

    def output(self, mixed: torch.Tensor) -> torch.Tensor:
        """Attention's mix of latents [tokens, heads, rank] through each head's W_UV, then o_proj. The batched GEMM
        writes each head's rows straight into their places of o_proj's input [tokens, heads * v_dim] (no
        transposing copy)."""
        tokens, heads = mixed.shape[:2]
        w_uv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)[:, self.nope:]
        out = mixed.new_empty(tokens, heads, self.v_dim)
        torch.bmm(mixed.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return self.o_proj(out.view(tokens, heads * self.v_dim))


class PerHeadMLAAttention(MLAAttention):
    """MLA run as ordinary multi-head attention (PRESSROOM_MLA_DISABLE=1, as vLLM's VLLM_MLA_DISABLE): each
    head's key and value expanded from the latent and cached per head, the values zero-padded to the key
    width (the cache has one width). For measuring what the latent cache saves; the outputs are the same."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.head_dim = self.nope + self.rope_dim
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, self.attn.scale)

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        _, q_nope, q_pe, latent, k_pe = self.project(rope, x)
        kv = torch.matmul(latent, self.kv_b_proj.weight.t()).view(tokens, heads, self.nope + self.v_dim)
        key = torch.cat((kv[..., :self.nope], k_pe.unsqueeze(1).expand(tokens, heads, self.rope_dim)), dim=-1)
        value = torch.nn.functional.pad(kv[..., self.nope:], (0, self.head_dim - self.v_dim))
        out = self.attn(torch.cat((q_nope, q_pe), dim=-1), key, value).view(tokens, heads, self.head_dim)
        return self.o_proj(out[..., :self.v_dim].reshape(tokens, heads * self.v_dim))


class DeepseekMoE(nn.Module):
    """Router (with DeepSeek-V3's correction bias where it scores by sigmoid), routed experts and the
    always-on shared experts. The router is replicated: every rank routes every token; the routed experts are this
    rank's slices or whole experts (models/moe.py's split), their partial sums all-reduced."""

    def __init__(self, config, num_experts: int, router: RouterConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.router = router
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        if router.scoring == "sigmoid":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.experts = _rank_experts(num_experts, hidden, inter)
        shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = LlamaMLP(hidden, inter * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.experts.shared_experts_of(self.shared_experts) if x.is_cuda else None
        if shared is not None:
            return self.forward_folded(x, shared)
        out = tp_all_reduce(self.experts(x, *self.route(x)))
        return out if self.shared_experts is None else out + self.shared_experts(x)  # reduced inside

    def forward_folded(self, x: torch.Tensor, shared) -> torch.Tensor:
        """forward with the shared experts as experts every token routes to, weighted 1 (`shared`:
        FusedMoE.shared_experts_of's): one pair of expert launches and one reduction for both."""
        return tp_all_reduce(self.experts(x, *self.route(x, shared.count), shared))

    def route(self, x: torch.Tensor, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's expert weights and ids [tokens, top_k + shared] (select_experts')."""
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return select_experts(self.gate(x), self.router, bias, shared)


class DeepseekV2ForCausalLM(_MoeForCausalLM):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.model.fused_decode = False  # the C decode stack knows Llama attention only

    def _num_experts(self) -> int:
        c = self.config
        return getattr(c, "n_routed_experts", None) or c.num_experts

    def router_config(self) -> RouterConfig:
        c = self.config
        method = getattr(c, "topk_method", None) or "greedy"
        grouped = method == "group_limited_greedy"
        # DeepSeek-V2's router never renormalises its top-k weights
        return RouterConfig(top_k=c.num_experts_per_tok, scoring="softmax", renormalize=False,
                            num_groups=c.n_group if grouped else 1, topk_groups=c.topk_group if grouped else 1,
                            group_score="max", routed_scaling_factor=c.routed_scaling_factor)

    def make_mlp(self, layer: int) -> nn.Module | None:
        c = self.config
        if layer < (getattr(c, "first_k_dense_replace", 0) or 0):
            return None
        return DeepseekMoE(c, self._num_experts(), self.router_config())

    def make_attention(self, layer: int) -> nn.Module:
        if os.environ.get("PRESSROOM_MLA_DISABLE") == "1":
            return PerHeadMLAAttention(self.config)
        return MLAAttention(self.config)

    def make_rotary(self) -> RotaryEmbedding:
        return rotary_from_config(self.config, self.config.qk_rope_head_dim)

    def rope_interleaved(self) -> bool:
        return True

    def input_parts(self) -> tuple[InputPart, ...]:
        """The projections each layer's fused_qkv_a_proj stacks (`input_parts`)."""
        return input_parts(self.config, indexer=False)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """MLA's projections of x load into fused_qkv_a_proj (the shard id: the part's name); the others as they
        are (Llama's q/k/v stacking does not apply)."""
        if ".self_attn." not in name:
            return super().checkpoint_target(name)
        layer, _, rest = name.partition(".self_attn.")
        module, _, kind = rest.rpartition(".")
        if any(p.name == module for p in self.input_parts()):
            return f"{layer}.self_attn.fused_qkv_a_proj.{kind}", module
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        if ".self_attn." not in name:
            return super().checkpoint_parts(name)
        layer, _, rest = name.partition(".self_attn.")
        module, _, kind = rest.rpartition(".")
        if module != "fused_qkv_a_proj":
            return [name]
        return [f"{layer}.self_attn.{p.name}.{kind}" for p in self.input_parts() if kind == "weight" or p.bias]

    def to_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """benchmarks/gpu.py's HF copy: each fused_qkv_a_proj split back into its parts (views), rope rows in the
        checkpoint's order. Tensor parallelism 1 (the bench's)."""
        out = {}
        for name, tensor in state.items():
            layer, _, rest = name.partition(".self_attn.fused_qkv_a_proj.")
            if not rest:
                out[name] = tensor
                continue
            parts = self.input_parts()
            for part, piece in zip(parts, tensor.split([p.rows for p in parts], dim=0), strict=True):
                if rest == "weight" or part.bias:
                    part_name = f"{layer}.self_attn.{part.name}.{rest}"
                    out[part_name] = self.to_checkpoint_layout(part_name, piece)
        return out

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return (self.deinterleave_rope(name, t) for name, t in self._main_model(weights))

    def _main_model(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint without its multi-token-prediction layers (numbered after the last decoder
        layer; the MTP drafter reads them itself). FP8 weights arrive joined with their scales by the FP8
        method: a scale tensor seen here had no method to read it."""
        layers = self.config.num_hidden_layers
        for name, tensor in weights:
            if name.endswith(("weight_scale_inv", "weight_scale")):
                raise ValueError(f"{name}: this checkpoint stores FP8 block-quantized weights, but its config.json "
                                 "has no quantization_config (quant_method 'fp8', weight_block_size) to read them.")
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                continue
            yield name, tensor

    def deinterleave_rope(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Rows of an interleaved rope part reordered to (even dims, odd dims): q's per head, the shared
        key's after the latent."""
        rope = self.config.qk_rope_head_dim
        return name, self._reorder_rope_rows(name, tensor, torch.cat((torch.arange(0, rope, 2),
                                                                       torch.arange(1, rope, 2))))

    def to_checkpoint_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter in the checkpoint's row order (the rope rows interleaved again), for copying out."""
        rope = self.config.qk_rope_head_dim
        return self._reorder_rope_rows(name, tensor, torch.arange(rope).view(2, -1).t().reshape(-1))

    def _reorder_rope_rows(self, name: str, tensor, order: torch.Tensor):
        """`tensor` (a checkpoint's, lazy or read, or a parameter of any rank) with its rope rows taken in `order`."""
        if not self.rope_interleaved():
            return tensor
        rows = self._rope_row_order(name, tensor.shape[0], order)
        if rows is None:
            return tensor
        if isinstance(tensor, LazyWeight):  # still unread: a rank's loader reads only the rows of its heads
            return _rows_in_order(tensor, rows)
        if isinstance(tensor, Fp8Weight):  # kept in FP8: rows move with their scales, lazy again for the loader
            return tensor.take_rows(rows).lazy()
        return tensor[rows]

    def _rope_row_order(self, name: str, num_rows: int, order: torch.Tensor) -> torch.Tensor | None:
        """The weight's rows in their new order, with the rope rows of each q head (of `num_rows` / head_dim heads:
        the checkpoint's or a rank's) or of the shared key (after the latent) taken in `order`; None for a weight
        without rope rows. Each head's rows stay within the head, so the order commutes with the split by heads."""
        c = self.config
        rope, nope = c.qk_rope_head_dim, c.qk_nope_head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            head = torch.cat((torch.arange(nope), nope + order))
            return (torch.arange(num_rows // (nope + rope))[:, None] * (nope + rope) + head).reshape(-1)
        if ".self_attn.kv_a_proj_with_mqa." in name:  # its weight and any bias
            return torch.cat((torch.arange(c.kv_lora_rank), c.kv_lora_rank + order))
        return None


def _rows_in_order(weight: LazyWeight, rows: torch.Tensor) -> LazyWeight:
    """`weight` with its rows taken in the order `rows`, still unread. Reading rows [r0, r1) of it reads only the
    stored rows they come from (a rank's heads of a per-head reorder: just those heads' rows), then reorders them."""
    def read(index: Index):
        (r0, r1), *others = index
        wanted = rows[r0:r1]
        first = int(wanted.min())
        part = weight.narrow(0, first, int(wanted.max()) + 1 - first)
        for dim, (start, stop) in enumerate(others, start=1):
            part = part.narrow(dim, start, stop - start)
        loaded = part.load()  # a tensor, or an Fp8Weight kept in FP8 (rows move with their scales)
        local = wanted - first
        return loaded.take_rows(local) if isinstance(loaded, Fp8Weight) else loaded[local]

    return LazyWeight(tuple(weight.shape), weight.dtype, read)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def router_config(self) -> RouterConfig:
        c = self.config
        return RouterConfig(top_k=c.num_experts_per_tok, scoring="sigmoid", renormalize=bool(c.norm_topk_prob),
                            num_groups=c.n_group or 1, topk_groups=c.topk_group or 1, group_score="top2_sum",
                            routed_scaling_factor=c.routed_scaling_factor)

    def rope_interleaved(self) -> bool:
        return bool(getattr(self.config, "rope_interleave", True))


class LightningIndexer(nn.Module):
    """DSA's indexer (DeepSeek-V3.2): its own small keys per token (kept in the layer's cache after the
    latent) and per-query head weights; a query's score for a past token is the weighted sum over the
    indexer heads of relu(q . k), and attention reads only the `index_topk` best tokens. Its key projection (wk)
    is part of the attention's fused input projection; `keys` takes its output."""

    def __init__(self, config) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.weight_scale = self.heads ** -0.5  # the head weights' scale
        # replicated, not split by heads: each rank picks the same tokens from the same scores
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.heads * self.dim)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.k_norm.requires_grad_(False)
        # never quantized in DeepSeek's FP8 checkpoints (vLLM builds it with quant_config=None): a plain linear
        # layer, which no quantization method takes
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)
        self.weights_proj.requires_grad_(False)

    def keys(self, k: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        """wk's output [tokens, dim] normed and rotated (rotate-half, on the first qk_rope_head_dim dimensions)."""
        k = self.k_norm(k).unsqueeze(1).contiguous()
        return rope.rotary.rotate(k, rope.cos, rope.sin).squeeze(1)

    def queries(self, q_resid: torch.Tensor, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries [tokens, heads, dim] and head weights [tokens, heads], both in the model's dtype; the
        weights are still to be scaled by `weight_scale` in fp32 (`select` does it, the GPU's scoring kernel too)."""
        return rope.rotary.rotate(self.unrotated_queries(q_resid), rope.cos, rope.sin), self.weights_proj(x)

    def unrotated_queries(self, q_resid: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, dim] before their rotation (on CUDA the prepare kernel rotates them in place)."""
        return self.wq_b(q_resid).view(-1, self.heads, self.dim).contiguous()

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """For queries at `positions` (`queries`' outputs) over a context's keys [context, dim]: each query's chosen
        tokens [queries, k] (k = min(index_topk, context)) and whether each is causal (a query near the start
        has fewer than k past tokens)."""
        # the checkpoints' own order of operations: a near-tie at the k-th place must fall the same way
        scores = torch.relu(torch.matmul(q.float(), keys.float().t()) * self.dim ** -0.5)  # [queries, heads, context]
        index = torch.matmul((weights.float() * self.weight_scale).unsqueeze(1), scores).squeeze(1)
        causal = torch.arange(keys.shape[0]) <= positions[:, None]
        index = index.masked_fill(~causal, float("-inf"))
        chosen = index.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return chosen, causal.gather(1, chosen)


@dataclass(frozen=True, slots=True)
class SparsePlan:
    """A step's token_req and token_pos (kernels/triton/dsa.py's `token_positions`) for `tokens` query rows: the
    first sparse layer makes them, the others read them (one set of launches a step, not one a layer).
    `captured`: made while a CUDA graph was being captured (so the graph remakes them at each replay)."""
    tokens: int
    captured: bool
    token_req: torch.Tensor
    token_pos: torch.Tensor


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def sparse_plan(meta, tokens: int) -> SparsePlan:
    """The step's SparsePlan, kept in the metadata's per-step `plan` slot: device tensors only, no host sync. The
    graph runner runs a forward eagerly (compiling) and then captures one with the same metadata: a plan made
    outside the capture is made again inside it, else the graph would replay the compile run's positions."""
    from pressroom.kernels.triton import dsa
    plan, capturing = meta.plan, _capturing()
    if isinstance(plan, SparsePlan) and plan.tokens == tokens and plan.captured == capturing:
        return plan
    if plan is not None and not isinstance(plan, SparsePlan):
        raise ValueError(f"the step's metadata already holds another plan ({type(plan).__name__}).")
    positions = dsa.token_positions(meta.query_start_loc_device, meta.seq_lens, tokens)
    meta.plan = SparsePlan(tokens, capturing, *positions)
    return meta.plan


class SparseMLAAttention(MLAAttention):
    """MLA reading only the tokens the lightning indexer picks for each query (DeepSeek Sparse Attention).
    The layer writes its cache and attends itself (torch on the CPU, Triton on CUDA): the attention gathers
    k latents per query, so its cost grows with index_topk, not with the context (the indexer still scores
    every past token, over its small keys); with a context of at most index_topk tokens it equals dense MLA."""

    indexed = True

    def __init__(self, config) -> None:
        if not getattr(config, "q_lora_rank", None):
            raise ValueError("DeepSeek sparse attention needs q_lora_rank: its indexer reads the compressed query.")
        super().__init__(config)
        self.indexer = LightningIndexer(config)
        self.attn = Attention(self.num_heads, self.rank + self.rope_dim, 1, self.attn.scale, v_head_dim=self.rank,
                              latent=True, extra_dim=self.indexer.dim)

    def forward(self, rope: RopeTables, x: torch.Tensor) -> torch.Tensor:
        q_resid, q, kv, index_key = self.inputs(x)
        meta = get_attention_metadata()
        if x.is_cuda:
            return self.output(self._sparse_on_gpu(rope, q, kv, index_key, q_resid, x, meta))
        index_q, index_w = self.indexer.queries(q_resid, x, rope)
        query, key = self.absorbed_query_and_key(rope, q, kv)
        entry = torch.cat((key, self.indexer.keys(index_key, rope)), dim=-1)  # what the cache keeps
        return self.output(self._sparse_on_cpu(query, entry, index_q, index_w, meta))

    def _sparse_on_gpu(self, rope: RopeTables, q: torch.Tensor, kv: torch.Tensor, index_key: torch.Tensor,
                       q_resid: torch.Tensor, x: torch.Tensor, meta) -> torch.Tensor:
        """Triton: the absorbed query made, the cache entry (latent, shared key, indexer key) written into the
        cache and the indexer's queries rotated in one launch, the step's token positions made once, device tensors
        only, so decode steps replay from CUDA graphs."""
        from pressroom.attention.triton_backend import target_programs
        from pressroom.kernels.triton import dsa
        from pressroom.kernels.triton.mla_prepare import IndexerInputs, mla_prepare_into_cache
        cache = self.attn.kv_cache[0]
        norm, k_norm = self.kv_a_layernorm, self.indexer.k_norm
        index_q, index_w = self.indexer.unrotated_queries(q_resid), self.indexer.weights_proj(x)
        indexer = IndexerInputs(index_key, k_norm.weight, k_norm.bias, k_norm.eps, queries=index_q)
        query = mla_prepare_into_cache(q, self._absorb(q[..., :self.nope]), kv, norm.weight, norm.eps, rope.cos,
                                       rope.sin, indexer, cache, meta.slot_mapping)
        plan = sparse_plan(meta, query.shape[0])
        chosen = dsa.choose_positions(index_q, index_w, cache, meta.block_tables, plan.token_req, plan.token_pos,
                                      self.rank + self.rope_dim, self.indexer.topk, self.indexer.weight_scale)
        mixed = query.new_empty(*query.shape[:2], self.rank)
        return dsa.sparse_mla_attention(query, cache, meta.block_tables, plan.token_req, plan.token_pos, chosen,
                                        self.attn.scale, mixed, self.rank,
                                        target_programs=target_programs(query.device))

    def _sparse_on_cpu(self, query: torch.Tensor, entry: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
                       meta) -> torch.Tensor:
        """Torch, request by request over the host's query starts."""
        cache = self.attn.kv_cache.view(-1, entry.shape[-1])
        cache.index_copy_(0, meta.slot_mapping, entry.to(cache.dtype))
        mixed = query.new_empty(*query.shape[:2], self.rank)
        loc, lens = meta.query_start_loc, meta.seq_lens_host
        block_size = self.attn.kv_cache.shape[2]
        for i in range(len(loc) - 1):
            start, end, context = loc[i], loc[i + 1], lens[i]
            if start == end:
                continue
            pos = torch.arange(context)
            past = cache[meta.block_tables[i][pos // block_size] * block_size + pos % block_size]
            positions = torch.arange(context - (end - start), context)
            chosen, causal = self.indexer.select(index_q[start:end], index_w[start:end],
                                                 past[:, self.rank + self.rope_dim:], positions)
            keys = past[:, :self.rank + self.rope_dim][chosen].to(query.dtype)  # [queries, k, rank + rope]
            scores = torch.einsum("qhd,qkd->qhk", query[start:end].float(), keys.float()) * self.attn.scale
            probs = scores.masked_fill(~causal[:, None, :], float("-inf")).softmax(dim=-1)
            mixed[start:end] = torch.einsum("qhk,qkr->qhr", probs, keys[..., :self.rank].float()).to(query.dtype)
        return mixed


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return SparseMLAAttention(self.config)

    def input_parts(self) -> tuple[InputPart, ...]:
        return input_parts(self.config, indexer=True)

    def rope_interleaved(self) -> bool:
        return True  # V3.2's MLA always rotates interleaved pairs; its indexer rotates halves
