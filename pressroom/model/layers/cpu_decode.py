"""The CPU's decode fast path: a whole decode step of a Llama-family model with 4-bit weights in one C
call (kernels/csrc/decode_stack.c) instead of about a dozen Python calls per layer.

It applies to steps whose tokens are all decodes (one new token per sequence, at most INT4_MAX_ROWS of
them) on a model whose projections all kept their 4-bit form, on one rank, without q/k norms or drafter
taps; every other step takes the layer-by-layer path. Both paths run the same kernels in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.kernels import cpu
from pressroom.model.layers.quant import INT4_MAX_ROWS, NibbleMatrix


@dataclass(slots=True)
class CpuDecodeStack:
    layer_ptrs: torch.Tensor  # int64 [layers, DECODE_LAYER_FIELDS]
    held: list[torch.Tensor]  # fp32 copies the pointers refer to (a bf16 model's norm weights)
    final_norm: torch.Tensor
    cache_ptr: int  # layer 0's cache when built: a rebound cache needs new pointers
    shape: dict[str, int]  # DECODE_DIM_FIELDS except tokens and max_blocks
    eps: float
    scale: float

    @staticmethod
    def supports(model) -> bool:
        """Whether a LlamaModel's layers can take this path at all (asked once)."""
        if not cpu.available() or not model.layers or model.rotary.rotary_dim != model.layers[0].self_attn.head_dim:
            return False
        if get_tp_size() > 1:  # the C stack has no all-reduce between its layers
            return False
        norms = [n for l in model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
        return all(_eligible(layer) for layer in model.layers) and len({n.eps for n in [*norms, model.norm]}) == 1

    @classmethod
    def build(cls, model) -> CpuDecodeStack | None:
        """The pointer table for a supported LlamaModel; None while its caches are not bound."""
        caches = [layer.self_attn.attn.kv_cache for layer in model.layers]
        if any(c is None or not c.is_contiguous() or c.dtype not in (torch.float32, torch.bfloat16) for c in caches):
            return None
        held: list[torch.Tensor] = []
        rows = [_layer_pointers(layer, held) for layer in model.layers]
        attn = model.layers[0].self_attn
        shape = {"hidden": model.norm.weight.shape[0], "heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
                 "head_dim": attn.head_dim, "inter": model.layers[0].mlp.gate_up_proj.output_sizes[0],
                 "block_size": caches[0].shape[2], "cache_bf16": int(caches[0].dtype == torch.bfloat16)}
        final_norm = _fp32(model.norm.weight, held)
        return cls(torch.tensor(rows, dtype=torch.int64), held, final_norm, caches[0].data_ptr(), shape,
                   model.norm.eps, attn.attn.scale)

    def is_current(self, model) -> bool:
        cache = model.layers[0].self_attn.attn.kv_cache
        return cache is not None and cache.data_ptr() == self.cache_ptr

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the embedded tokens [tokens, hidden]; returns the final-normed hidden states, fp32."""
        tokens = x.shape[0]
        x = x.to(torch.float32, copy=True).contiguous()  # written in place
        tables = meta.block_tables[:tokens].contiguous()
        dims = torch.tensor([tokens, self.shape["hidden"], self.shape["heads"], self.shape["kv_heads"],
                             self.shape["head_dim"], self.shape["inter"], self.shape["block_size"],
                             tables.shape[1], self.shape["cache_bf16"]], dtype=torch.int64)
        return cpu.decode_stack(x, self.layer_ptrs, self.final_norm, cos.contiguous(), sin.contiguous(),
                                meta.slot_mapping.contiguous(), tables, meta.seq_lens[:tokens].contiguous(),
                                dims, self.eps, self.scale)


def applies(meta: AttentionMetadata, input_ids: torch.Tensor) -> bool:
    """A step of decodes only, few enough for the 4-bit kernels, with the CPU's int64 index tensors."""
    tokens = input_ids.shape[0]
    return (input_ids.device.type == "cpu" and 0 < tokens <= INT4_MAX_ROWS and meta.num_decodes == tokens
            and meta.num_decode_tokens == tokens and meta.block_tables.dtype == torch.int64
            and meta.seq_lens.dtype == torch.int64 and meta.slot_mapping.dtype == torch.int64)


def _eligible(layer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):  # a mixture of experts
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (attn.q_norm is None and all(isinstance(l.int4, NibbleMatrix) for l in linears)
            and all(l.bias is None for l in linears[1:]) and attn.o_proj.tp_size == 1)


def _fp32(t: torch.Tensor, held: list[torch.Tensor]) -> torch.Tensor:
    t = t.detach().to(torch.float32).contiguous()
    held.append(t)
    return t


def _layer_pointers(layer, held: list[torch.Tensor]) -> list[int]:
    attn, mlp = layer.self_attn, layer.mlp
    ptrs = {"ln1": _fp32(layer.input_layernorm.weight, held).data_ptr(),
            "ln2": _fp32(layer.post_attention_layernorm.weight, held).data_ptr(),
            "qkv_bias": 0 if attn.qkv_proj.bias is None else _fp32(attn.qkv_proj.bias, held).data_ptr(),
            "k_cache": attn.attn.kv_cache[0].data_ptr(), "v_cache": attn.attn.kv_cache[1].data_ptr()}
    for prefix, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gu", mlp.gate_up_proj),
                           ("down", mlp.down_proj)):
        w: NibbleMatrix = linear.int4
        ptrs |= {f"{prefix}_q": w.qs.data_ptr(), f"{prefix}_d": w.scale.data_ptr(), f"{prefix}_m": w.min.data_ptr()}
    return [ptrs[name] for name in cpu.DECODE_LAYER_FIELDS]
