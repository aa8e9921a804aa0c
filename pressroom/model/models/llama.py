"""The Llama family on one set of layers: Llama 2/3, Mistral, SmolLM2, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pressroom.attention.backend import get_attention_metadata
from pressroom.model.layers import cpu_decode
from pressroom.model.layers.activation import SiluAndMul
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.layers.rotary import RotaryEmbedding
from pressroom.model.weights import expected_names, load_named_weights


@dataclass(slots=True)
class RopeTables:
    rotary: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor


def rotary_from_config(config, rotary_dim: int | None = None) -> RotaryEmbedding:
    """The config's rope (base and scaling) over `rotary_dim` dimensions (default: its head_dim)."""
    rope = getattr(config, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or (rope if rope.get("rope_type", "default") != "default" else None)
    dim = rotary_dim or _head_dim(config)
    return RotaryEmbedding(dim, dim, config.max_position_embeddings, base, scaling)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = _head_dim(config)
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads, n_kv, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False,
                                        input_slice=(self.qkv_proj.q_start * self.head_dim,
                                                     self.num_heads * self.head_dim))
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

    def forward(self, rope: RopeTables, x: torch.Tensor, see_ahead: torch.Tensor | None = None) -> torch.Tensor:
        """`see_ahead`: keys past its own each token also sees (Attention.forward's; None: causal)."""
        return self.o_proj(self.attend(rope, self.qkv_proj(x), see_ahead))

    def attend(self, rope: RopeTables, qkv: torch.Tensor, see_ahead: torch.Tensor | None = None) -> torch.Tensor:
        """What runs between the projections: qkv [tokens, (heads + 2 kv heads) * head_dim] -> the attention
        output [tokens, heads * head_dim]."""
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = heads[:, :self.num_heads + self.num_kv_heads], heads[:, self.num_heads + self.num_kv_heads:]
        if self.q_norm is not None and qk.is_cuda:  # one launch for both norms, no concatenation
            from pressroom.kernels.triton.norm import qk_rms_norm
            qk = qk_rms_norm(qk, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps)
        elif self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = rope.rotary.rotate(qk, rope.cos, rope.sin)  # q and k heads rotated in one pass
        return self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v, see_ahead=see_ahead)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: nn.Module | None = None) -> None:
        """`act`: the gated activation over [gate | up] (default: SwiGLU's)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = act if act is not None else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


# One-token decode steps on CUDA through the fused GEMVs (LlamaDecoderLayer._takes_small_step says when); the one
# off switch, for tests that compare the two paths.
SMALL_STEP_GEMV = True


def dense_on_one_rank(linear: LinearBase, dtype: torch.dtype) -> bool:
    """Whether `linear` is a plain dense weight of `dtype` on one rank: no quantized or prepacked form, no
    batch-invariant switch, no hook (LoRA's updates are forward hooks)."""
    return (linear.quant_method is None and linear.weight.dtype == dtype and _plain_on_one_rank(linear))


def fp8_rows_on_one_rank(linear: LinearBase) -> bool:
    """Whether `linear` is an FP8 weight with one scale a row (Fp8LinearMethod's per-channel form, whose small steps
    are weight-only) on one rank, with nothing else the fused GEMVs would skip."""
    from pressroom.model.quantization.fp8 import FP8, Fp8LinearMethod
    scale = getattr(linear, "weight_scale", None)
    return (isinstance(linear.quant_method, Fp8LinearMethod) and linear.weight.dtype == FP8 and scale is not None
            and scale.dim() == 2 and scale.shape[1] == 1 and _plain_on_one_rank(linear))


def _plain_on_one_rank(linear: LinearBase) -> bool:
    return (linear.ggml is None and linear.int4 is None and linear.onednn is None and not linear.batch_invariant
            and linear.tp_size == 1 and not linear._forward_hooks and not linear._forward_pre_hooks)


def _row_scales(linear: LinearBase) -> torch.Tensor | None:
    """An FP8 layer's scales as the fused GEMVs take them (one a row); None for a dense weight."""
    return linear.weight_scale.reshape(-1) if linear.quant_method is not None else None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: bool, mlp: nn.Module | None = None, attn: nn.Module | None = None) -> None:
        """`mlp`: the feed-forward block (default: the dense SwiGLU MLP), e.g. a mixture of experts;
        `attn`: the attention block (default: Llama's), e.g. multi-head latent attention."""
        super().__init__()
        self.self_attn = attn if attn is not None else LlamaAttention(config, qk_norm)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual):
        if self._takes_small_step(x):
            return self._forward_small(rope, x, residual)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_small(self, rope, x, residual):
        """forward in four GEMV launches around attention: each RMSNorm in the prologue of the projection after
        it (qkv, gate_up), SwiGLU in down's; the same rounding as the modules' kernels (kernels/triton/gemv.py)."""
        from pressroom.kernels.triton import gemv
        attn, mlp, norm = self.self_attn, self.mlp, self.input_layernorm
        qkv, residual = gemv.norm_gemv(x, norm.weight, norm.eps, attn.qkv_proj.weight, residual, attn.qkv_proj.bias,
                                       scale=_row_scales(attn.qkv_proj))
        x = gemv.gemv(attn.attend(rope, qkv), attn.o_proj.weight, attn.o_proj.bias, scale=_row_scales(attn.o_proj))
        norm = self.post_attention_layernorm
        gate_up, residual = gemv.norm_gemv(x, norm.weight, norm.eps, mlp.gate_up_proj.weight, residual,
                                           mlp.gate_up_proj.bias, scale=_row_scales(mlp.gate_up_proj))
        down = mlp.down_proj
        return gemv.silu_mul_gemv(gate_up, down.weight, down.bias, scale=_row_scales(down)), residual

    def _takes_small_step(self, x: torch.Tensor) -> bool:
        """A step of at most GEMV_MAX_TOKENS tokens (one: where the fused kernels were measured to win) on CUDA
        through Llama's own blocks, each weight dense bf16/fp16 or FP8 with row scales on one rank, with nothing
        (another quantized form, a batch-invariant switch, LoRA's hooks) that the fused kernels would skip;
        everything else takes the modules' forwards."""
        if not (SMALL_STEP_GEMV and x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
            return False
        from pressroom.kernels.triton.gemv import GEMV_MAX_TOKENS
        attn, mlp = self.self_attn, self.mlp
        return (x.shape[0] <= GEMV_MAX_TOKENS and type(attn) is LlamaAttention and type(mlp) is LlamaMLP
                and type(mlp.act) is SiluAndMul and not mlp.act.batch_invariant
                and all(type(n) is RMSNorm and not n.batch_invariant
                        for n in (self.input_layernorm, self.post_attention_layernorm))
                and all(dense_on_one_rank(linear, x.dtype) or fp8_rows_on_one_rank(linear)
                        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))


class LlamaModel(nn.Module):
    def __init__(self, config, qk_norm: bool, make_mlp: Callable[[int], nn.Module | None] | None = None,
                 make_attention: Callable[[int], nn.Module | None] | None = None,
                 rotary: RotaryEmbedding | None = None) -> None:
        """`make_mlp(layer index)`, `make_attention(layer index)`: that layer's feed-forward and attention
        blocks, None for Llama's; `rotary`: the position embedding (default: from the config's head_dim)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qk_norm, make_mlp(i) if make_mlp else None,
                              make_attention(i) if make_attention else None)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary or rotary_from_config(config)
        # CPU decode steps in one C call (layers/cpu_decode.py); built at the first step that can use it.
        self.fused_decode: bool | None = None  # None: not yet asked whether the layers support it
        self._decode_stack: cpu_decode.CpuDecodeStack | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states; with `aux_layers` (a drafter's conditioning), also the output of each of those
        layers (the residual stream, HF's hidden_states[i + 1]), in that order."""
        x, residual = self.embed_tokens(input_ids), None
        rope = RopeTables(self.rotary, *self.rotary.cos_sin(positions))
        stack = self._fused_decode_stack(input_ids)
        if stack is not None:
            out = stack.run(x, rope.cos, rope.sin, get_attention_metadata(), aux_layers)
            if aux_layers:
                return out[0].to(x.dtype), [t.to(x.dtype) for t in out[1]]
            return out.to(x.dtype)
        taps = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = self.norm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x

    def _fused_decode_stack(self, input_ids: torch.Tensor) -> cpu_decode.CpuDecodeStack | None:
        return cpu_decode.current_stack(self, cpu_decode.CpuDecodeStack, input_ids)


# checkpoint name part -> (our stacked parameter, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    cuda_graphs_supported = True  # its forward has no host sync or data-dependent control flow

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qk_norm, self.make_mlp, self.make_attention, self.make_rotary())
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """A layer's feed-forward block where it is not the dense MLP (mixture-of-experts families)."""
        return None

    def make_attention(self, layer: int) -> nn.Module | None:
        """A layer's attention block where it is not Llama's (multi-head latent attention)."""
        return None

    def make_rotary(self) -> RotaryEmbedding | None:
        """The rotary embedding where the config's head_dim does not say it (None: from the config)."""
        return None

    # ---- the name map (model/weights.py) ----

    def skips(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        for part, (stacked, shard_id) in _STACKED.items():
            if part in name:
                return name.replace(part, stacked), shard_id
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        return [name.replace(stacked, part) for part, (stacked, _) in _STACKED.items() if stacked in name] or [name]

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors as the name map reads them (a family may split fused ones or reorder rows)."""
        return weights

    def expected_weights(self) -> set[str]:
        """Every checkpoint tensor name this model needs."""
        return expected_names(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy checkpoint tensors into parameters one by one; returns the checkpoint names used."""
        loaded = load_named_weights(self, self.checkpoint_tensors(weights))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
            loaded.add("lm_head.weight")
        return loaded


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
