"""MXFP4 weights (`--quantization mxfp4`, or a checkpoint with `quantization_config.quant_method: "mxfp4"`):
weight-only, activations stay in their dtype. The layer methods and their kernels are fp4.py's.

Online: each linear layer and each layer's experts load dense (this rank's slice), then are quantized in blocks of
32 inputs (kernels/mxfp4.py): E2M1 values packed two per byte (the even input in the low nibble), one E8M0 scale
per block, 4.25 bits a weight.

Checkpoints, gpt-oss's form (HF transformers' integrations/mxfp4.py reads the same): a parameter P ships as
`P_blocks` uint8 [..., rows, cols / 32, 16] (a block's 32 values in 16 bytes, low nibble first) and `P_scales` uint8
E8M0 [..., rows, cols / 32]. A linear layer's weight is `X.weight_blocks` / `X.weight_scales`; per-expert matrices
are the same under the model's expert names (`experts.{e}.gate_proj.weight_blocks`, Mixtral's `w1`); gpt-oss's
fused experts are `experts.gate_up_proj_blocks` [experts, 2 * inter, hidden / 32, 16] with gate and up rows
interleaved (gate the even rows, as GptOssExperts splits them) and `experts.down_proj_blocks` [experts, hidden,
inter / 32, 16]. They are read without dequantizing, a rank only its rows and blocks. Modules the config's
`modules_to_not_convert` names (gpt-oss: attention, router, embeddings, LM head) stay dense.

gpt-oss's expert biases (`experts.*_proj_bias`, dense beside the blocks) pass through to models/gpt_oss.py.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pressroom.kernels import mxfp4 as kernels
from pressroom.model.lazy_weight import LazyWeight
from pressroom.model.quantization.base import loads_into
from pressroom.model.quantization.fp4 import Fp4LinearMethod, Fp4Method, Fp4MoeMethod, Fp4Weight, lazy_fp4

_FUSED = (".experts.gate_up_proj", ".experts.down_proj")  # gpt-oss's stacked experts


class Mxfp4LinearMethod(Fp4LinearMethod):
    fmt = "mxfp4"


class Mxfp4Method(Fp4Method):
    name = "mxfp4"
    linear_method = Mxfp4LinearMethod

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        self.kept_dense = list((checkpoint_config or {}).get("modules_to_not_convert") or [])

    def loads_as(self, model: nn.Module, name: str, tensors: dict[str, LazyWeight]) -> Iterable[tuple[str, Any]]:
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in tensors:
            return ()
        if not name.endswith("_blocks"):
            return ((name, tensors[name]),)
        base = name.removesuffix("_blocks")
        if base + "_scales" not in tensors:
            raise ValueError(f"{name} has no {base}_scales beside it to scale its MXFP4 blocks.")
        blocks, scales = tensors[name], tensors[base + "_scales"]
        if base.endswith(_FUSED):
            return _fused_experts(model, base, blocks, scales)
        return ((base, _lazy_blocks(blocks, scales, None, loads_into(model, base, _HOLDERS), base)),)


def _fused_experts(model: nn.Module, base: str, blocks: LazyWeight, scales: LazyWeight):
    """gpt-oss's stacked experts as the per-expert matrices the model loads: gate_up's even rows are expert e's
    gate, its odd rows its up."""
    gate, up, down = getattr(model, "expert_names", ("gate_proj", "up_proj", "down_proj"))
    if blocks.dim() != 4:
        raise ValueError(f"{base}_blocks has shape {tuple(blocks.shape)}; gpt-oss's experts are [experts, rows, "
                         "blocks, 16].")
    stem, proj = base.rsplit(".", 1)
    parts = ((gate, 0), (up, 1)) if proj == "gate_up_proj" else ((down, None),)
    for expert in range(blocks.shape[0]):
        for part, parity in parts:
            name = f"{stem}.{expert}.{part}.weight"
            keep = loads_into(model, name, _HOLDERS)
            yield name, _lazy_blocks(blocks.narrow(0, expert, 1), scales.narrow(0, expert, 1), parity, keep, name)


def _lazy_blocks(blocks: LazyWeight, scales: LazyWeight, parity: int | None, keep: bool, name: str) -> LazyWeight:
    """`*_blocks` / `*_scales` ([rows, n, 16] / [rows, n], or one expert's [1, ...] of either) as one lazy weight of
    the dense shape; `parity`: only the even (0) or odd (1) rows, gpt-oss's interleaved gate and up."""
    lead = blocks.dim() - 3
    rows, n_blocks = blocks.shape[lead], blocks.shape[lead + 1]
    if blocks.shape[-1] != kernels.BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{name}: MXFP4 blocks of shape {tuple(blocks.shape)} with scales {tuple(scales.shape)}; "
                         f"expected [..., rows, blocks, {kernels.BLOCK // 2}] with scales [..., rows, blocks].")
    step, first = (1, 0) if parity is None else (2, parity)

    def read(r0: int, r1: int, b0: int, b1: int) -> Fp4Weight:
        span = (step * r0, step * (r1 - r0))
        b = blocks.narrow(lead, *span).narrow(lead + 1, b0, b1 - b0).load()
        s = scales.narrow(lead, *span).narrow(lead + 1, b0, b1 - b0).load()
        b, s = b.reshape(-1, *b.shape[-2:])[first::step], s.reshape(-1, s.shape[-1])[first::step]
        return Fp4Weight(_as_bytes(b).reshape(r1 - r0, -1).contiguous(), _as_bytes(s).contiguous(), None)

    return lazy_fp4((rows // step, n_blocks * kernels.BLOCK), kernels.BLOCK, read, keep, name)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """E2M1 pairs or E8M0 exponents, whatever one-byte dtype the file names them by (uint8, float8_e8m0fnu)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


_HOLDERS = (Mxfp4LinearMethod, Fp4MoeMethod)
