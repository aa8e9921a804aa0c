"""The CPU's decode fast path: a whole decode step in one C call instead of a dozen or more Python calls per
layer. `CpuDecodeStack`: a Llama-family model with 4-bit weights (kernels/csrc/decode_stack.c);
`Gemma3DecodeStack`: Gemma 3 with GGML-quantized projections, a GGUF kept as shipped
(kernels/csrc/gemma3_stack.c).

They apply to steps whose tokens are all decodes (one new token per sequence; for the 4-bit stack at most
INT4_MAX_ROWS of them, or VNNI_MAX_ROWS where every matrix keeps a byte panel) on a model whose projections all
kept their quantized form, on one rank (the 4-bit stack also hands a drafter the outputs of the layers it reads;
Gemma 3's taps none, so its drafting steps go layer by layer); every other step takes the layer-by-layer path.
Both paths run the same kernels in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pressroom.attention.backend import AttentionMetadata, get_attention_metadata
from pressroom.attention.torch_ref import decode_row_plan
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.kernels import cpu
from pressroom.model.layers.activation import GeluTanhAndMul
from pressroom.model.layers.quant import INT4_MAX_ROWS, VNNI_MAX_ROWS, GgmlRows, GgmlStack, NibbleMatrix


class DecodeStack(Protocol):
    max_tokens: int | None

    @staticmethod
    def supports(model) -> bool: ...

    @classmethod
    def build(cls, model) -> DecodeStack | None: ...

    def is_current(self, model) -> bool: ...

    def takes(self, tokens: int) -> bool: ...


def current_stack(model, kind: type[DecodeStack], input_ids: torch.Tensor) -> DecodeStack | None:
    """The model's stack of `kind` for this step, or None where the step or the model cannot take it. The model
    keeps its answer in `fused_decode` (None: not asked yet) and its stack in `_decode_stack`, rebuilt when the
    KV cache is rebound."""
    if model.fused_decode is False or not applies(get_attention_metadata(), input_ids, kind.max_tokens,
                                                  kind.short_queries):
        return None
    if model.fused_decode is None:
        model.fused_decode = kind.supports(model)
        if not model.fused_decode:
            return None
    if model._decode_stack is None or not model._decode_stack.is_current(model):
        model._decode_stack = kind.build(model)
    stack = model._decode_stack
    return stack if stack is not None and stack.takes(input_ids.shape[0]) else None


@dataclass(slots=True)
class _FusedStack:
    """What both stacks hold beside their layer table: the fp32 tensors the table points into (`held`), the
    final norm, and the step's fixed shapes."""
    held: list[torch.Tensor]
    final_norm: torch.Tensor
    cache_ptr: int  # layer 0's cache when built: a rebound cache needs new pointers
    shape: dict[str, int]  # DECODE_DIM_FIELDS except tokens and max_blocks
    eps: float
    scale: float

    def is_current(self, model) -> bool:
        """Whether layer 0's KV cache is still the one the table's pointers were taken from."""
        cache = model.layers[0].self_attn.attn.kv_cache
        return cache is not None and cache.data_ptr() == self.cache_ptr

    def takes(self, tokens: int) -> bool:
        return True


@dataclass(slots=True)
class CpuDecodeStack(_FusedStack):
    max_tokens = VNNI_MAX_ROWS  # the panels' rows; a stack without them takes INT4_MAX_ROWS (`takes`)
    short_queries = True  # a verification of drafts runs as rows too (a drafting step at batch 1)
    layer_ptrs: torch.Tensor  # int64 [layers, DECODE_LAYER_FIELDS]
    token_limit: int  # the most tokens a step may have: the row kernels' or, with every panel, the panels'

    def takes(self, tokens: int) -> bool:
        return tokens <= self.token_limit

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
        caches = _bound_caches(model)
        if caches is None:
            return None
        held: list[torch.Tensor] = []
        rows = [_layer_pointers(layer, held) for layer in model.layers]
        attn = model.layers[0].self_attn
        shape = _shape(model, caches[0])
        final_norm = _fp32(model.norm.weight, held)
        limit = min(linear.int4.max_rows for layer in model.layers for linear in _linears(layer))
        return cls(held, final_norm, caches[0].data_ptr(), shape, model.norm.eps, attn.attn.scale,
                   layer_ptrs=torch.tensor(rows, dtype=torch.int64), token_limit=limit)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """x: the embedded tokens [tokens, hidden]; returns the final-normed hidden states, fp32, and with
        `aux_layers` (a drafter's conditioning) the output of each of those layers too, in that order."""
        tokens = x.shape[0]
        x = x.to(torch.float32, copy=True).contiguous()  # written in place
        tables, lens = step_rows(meta, tokens, short_queries=True)
        dims = _dims(self.shape, tokens, tables.shape[1])
        taps = tap_at = None
        if aux_layers:
            taps = torch.empty(len(aux_layers), tokens, x.shape[1])
            tap_at = torch.full((self.layer_ptrs.shape[0],), -1, dtype=torch.int64)
            tap_at[list(aux_layers)] = torch.arange(len(aux_layers))
        out = cpu.decode_stack(x, self.layer_ptrs, self.final_norm, cos.contiguous(), sin.contiguous(),
                               meta.slot_mapping.contiguous(), tables, lens, dims, self.eps, self.scale, taps,
                               tap_at)
        return (out, list(taps.unbind(0))) if aux_layers else out


def _bound_caches(model) -> list[torch.Tensor] | None:
    """Every layer's KV cache, or None while one is not bound (or not a contiguous fp32/bf16 tensor)."""
    caches = [layer.self_attn.attn.kv_cache for layer in model.layers]
    if any(c is None or not c.is_contiguous() or c.dtype not in (torch.float32, torch.bfloat16) for c in caches):
        return None
    return caches


def _shape(model, cache: torch.Tensor) -> dict[str, int]:
    """The shape vector's fixed fields for a model and its layer-0 cache."""
    attn = model.layers[0].self_attn
    return {"hidden": model.norm.weight.shape[0], "heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
            "head_dim": attn.head_dim, "inter": model.layers[0].mlp.gate_up_proj.output_sizes[0],
            "block_size": cache.shape[2], "cache_bf16": int(cache.dtype == torch.bfloat16)}


def _dims(shape: dict[str, int], tokens: int, max_blocks: int) -> torch.Tensor:
    """The stacks' shape vector (DECODE_DIM_FIELDS' order)."""
    return torch.tensor([tokens, shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["inter"],
                         shape["block_size"], max_blocks, shape["cache_bf16"]], dtype=torch.int64)


def applies(meta: AttentionMetadata, input_ids: torch.Tensor, max_tokens: int | None = INT4_MAX_ROWS,
            short_queries: bool = False) -> bool:
    """A step of decodes only (at most max_tokens tokens, None: any number), with the CPU's int64 index
    tensors; with `short_queries`, also short queries after a cached context (a verification of drafts)."""
    tokens = input_ids.shape[0]
    return (not meta.layer_by_layer and input_ids.device.type == "cpu" and 0 < tokens <= (max_tokens or tokens)
            and meta.block_tables.dtype == torch.int64 and meta.seq_lens.dtype == torch.int64
            and meta.slot_mapping.dtype == torch.int64 and step_rows(meta, tokens, short_queries) is not None)


def step_rows(meta: AttentionMetadata, tokens: int, short_queries: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each token's block table and context length when every token of the step is a row of the decode
    kernel, else None. A single-token decode is its sequence's row. A short query after a cached context
    (`short_queries`) is split as the attention backend splits it (attention/torch_ref.py): its token j attends
    to the context up to and including itself, which is the causal mask, and its cache slots are written before
    any row attends."""
    if meta.num_decodes == tokens and meta.num_decode_tokens == tokens:
        return meta.block_tables[:tokens].contiguous(), meta.seq_lens[:tokens].contiguous()
    if not short_queries:
        return None
    plan = decode_row_plan(meta)
    if plan.chunks or plan.num_rows != tokens:  # a prefill chunk rides along
        return None
    return plan.tables.contiguous(), plan.lens.contiguous()


def _linears(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _eligible(layer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):  # a mixture of experts
        return False
    linears = _linears(layer)
    return (attn.q_norm is None and all(isinstance(l.int4, NibbleMatrix) for l in linears)
            and all(l.bias is None for l in linears[1:]) and attn.o_proj.tp_size == 1)


def _fp32(t: torch.Tensor, held: list[torch.Tensor]) -> torch.Tensor:
    t = t.detach().to(torch.float32).contiguous()
    held.append(t)
    return t


def _layer_pointers(layer, held: list[torch.Tensor]) -> list[int]:
    attn = layer.self_attn
    ptrs = {"ln1": _fp32(layer.input_layernorm.weight, held).data_ptr(),
            "ln2": _fp32(layer.post_attention_layernorm.weight, held).data_ptr(),
            "qkv_bias": 0 if attn.qkv_proj.bias is None else _fp32(attn.qkv_proj.bias, held).data_ptr(),
            "k_cache": attn.attn.kv_cache[0].data_ptr(), "v_cache": attn.attn.kv_cache[1].data_ptr()}
    for prefix, linear in zip(("qkv", "o", "gu", "down"), _linears(layer)):
        w: NibbleMatrix = linear.int4
        ptrs |= {f"{prefix}_q": w.qs.data_ptr(), f"{prefix}_d": w.scale.data_ptr(), f"{prefix}_m": w.min.data_ptr()}
        panel = w.panel
        ptrs |= {f"{prefix}_p": 0 if panel is None else panel.panel.data_ptr(),
                 f"{prefix}_pd": 0 if panel is None else panel.d.data_ptr(),
                 f"{prefix}_pm": 0 if panel is None else panel.m.data_ptr()}
    return [ptrs[name] for name in cpu.DECODE_LAYER_FIELDS]


# --- Gemma 3 over GGML forms -------------------------------------------------------------------------------


def _gemma3_linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _gemma3_norms(layer) -> tuple:
    attn = layer.self_attn
    return (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)


def _gemma3_eligible(layer) -> bool:
    """Every projection in its GGML form (at most the C kernels' runs of types), no biases, GELU-tanh."""
    forms = [linear.ggml for linear in _gemma3_linears(layer)]
    return (all(isinstance(f, GgmlRows) or isinstance(f, GgmlStack) and len(f.parts) <= cpu.GGML_MAX_PARTS
                for f in forms)
            and all(linear.bias is None and linear.tp_size == 1 for linear in _gemma3_linears(layer))
            and isinstance(layer.mlp.act, GeluTanhAndMul))


@dataclass(slots=True)
class Gemma3DecodeStack(_FusedStack):
    """Gemma 3's decode step in one C call (kernels/csrc/gemma3_stack.c) over its GGML forms."""
    max_tokens = None  # the GGML kernels take any number of rows
    short_queries = False  # single-token decodes only
    layer_table: torch.Tensor  # int64 [layers, gemma3_layer_fields]: pointers into `held` and the weights

    @staticmethod
    def supports(model) -> bool:
        """Whether a Gemma3Model's layers can take this path at all (asked once)."""
        if not cpu.available() or not model.layers or get_tp_size() > 1:
            return False
        attn = model.layers[0].self_attn
        if any(r.rotary_dim != attn.head_dim for r in (model.rotary_local, model.rotary_global)):
            return False
        norms = [n for layer in model.layers for n in _gemma3_norms(layer)] + [model.norm]
        scales = {layer.self_attn.attn.scale for layer in model.layers}
        return (all(_gemma3_eligible(layer) for layer in model.layers) and len({n.eps for n in norms}) == 1
                and len(scales) == 1)

    @classmethod
    def build(cls, model) -> Gemma3DecodeStack | None:
        """The layer table for a supported Gemma3Model; None while its caches are not bound."""
        caches = _bound_caches(model)
        if caches is None:
            return None
        held: list[torch.Tensor] = []
        table = torch.stack([_gemma3_layer_row(layer, held) for layer in model.layers])
        attn = model.layers[0].self_attn
        shape = _shape(model, caches[0])
        return cls(held, _fp32(model.norm.weight, held), caches[0].data_ptr(), shape, model.norm.eps, attn.attn.scale,
                   layer_table=table)

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], meta: AttentionMetadata,
            ggml: bool = False) -> torch.Tensor:
        """x: the scaled embeddings [tokens, hidden]; rope: the local (cos, sin), then the global; returns the
        final-normed hidden states, fp32. ggml: llama.cpp's arithmetic around the products (Gemma3Model's
        `ggml_numerics`)."""
        tokens = x.shape[0]
        x = x.to(torch.float32, copy=True).contiguous()  # written in place
        tables = meta.block_tables[:tokens].contiguous()
        dims = _dims(self.shape, tokens, tables.shape[1])
        return cpu.gemma3_decode_stack(x, self.layer_table, self.final_norm, tuple(t.contiguous() for t in rope),
                                       meta.slot_mapping.contiguous(), tables, meta.seq_lens[:tokens].contiguous(),
                                       dims, self.eps, self.scale, ggml)


def _gemma3_layer_row(layer, held: list[torch.Tensor]) -> torch.Tensor:
    attn = layer.self_attn.attn
    norms = [_fp32(n.weight, held).data_ptr() for n in _gemma3_norms(layer)]
    scalars = [*norms, attn.kv_cache[0].data_ptr(), attn.kv_cache[1].data_ptr(), attn.sliding_window or 0,
               int(not layer.local)]
    matrices = [linear.ggml.c_matrix() for linear in _gemma3_linears(layer)]
    return torch.cat([torch.tensor(scalars, dtype=torch.int64), *matrices])
