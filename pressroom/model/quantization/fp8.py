"""FP8 e4m3 weights: quantized at load (`--quantization fp8`) or as an FP8 checkpoint ships them.

Online: each linear layer loads dense (this rank's slice), then `process_weights_after_loading` quantizes it
with one scale per output channel; activations are quantized per token at each call. A checkpoint with
`quantization_config.quant_method == "fp8"` ships `X.weight` in FP8 beside `X.weight_scale` (one scale per
tensor, or per output channel: [out] or [out, 1]) or `X.weight_scale_inv` (DeepSeek's 128x128 blocks:
[ceil(out / 128), ceil(in / 128)], a multiplier despite its name). `checkpoint_weights` pairs each weight
with its scale into one lazy tensor, so a tensor-parallel rank reads only its rows or columns and the scales
that go with them.

A layer holds `weight` (FP8 [out, in]) and `weight_scale` (fp32 [out, groups]): each row's scale per group
of `group` inputs, the one form all three layouts take (a per-tensor scale repeated down the rows; a block's
scale repeated over its 128 rows), so stacked parts (q, k, v) with scales of their own, and row slices that
cut a block, need nothing special. On CUDA, steps of at most 16 tokens (decode) go through the weight-only Triton
GEMV (kernels/triton/quant_gemv.py: FP8 read, dequantized in registers, bf16 activations as they are); larger
per-channel steps through torch._scaled_mm on FP8 GPUs; larger steps over 128-input blocks (DeepSeek's) through the
block-scaled FP8 GEMM on FP8 GPUs (kernels/triton/fp8_block_gemm.py: activations quantized per token and 128 inputs);
anything else, and every weight on the CPU, through the dequantizing reference (kernels/fp8.py). The CPU keeps the
weight in FP8 and dequantizes it at each call rather than holding a bf16 copy: a DeepSeek-V3 is ~700 GB in FP8 and
twice that in bf16, so memory, not the per-call dequantization, decides what a host can serve.

The routed experts of such a checkpoint (128 x 128 blocks) stay in FP8 too (`Fp8MoeMethod`): a FusedMoE holds them
stacked with one scale per block, gate's and up's on grids of their own (kernels/fp8_moe.py's `Fp8Experts`), and runs
them through the FP8 fused MoE (kernels/triton/fused_moe_fp8.py) on CUDA, the torch reference on the CPU. Under
tensor parallelism each rank's slice of the experts' intermediate features must be whole blocks (refused otherwise,
naming tensor_parallel_size); expert parallelism holds whole experts. Experts with other scale layouts, or quantized
online, load dense.

DeepSeek's form (`fmt: "e4m3"`, `weight_block_size: [128, 128]`, `activation_scheme: "dynamic"`) may add
`scale_fmt: "ue8m0"`: its block scales are powers of two, stored as float32 or as exponent bytes (uint8 or
float8_e8m0fnu: 2^(byte - 127)), and activations are scaled by powers of two as well (kernels/fp8.py). Another
`fmt` or `scale_fmt`, a scale that is not what `scale_fmt` says or of a shape its weight's grid does not give, or a
scale beside a weight that is not float8_e4m3fn, is refused with a ValueError naming it.
Static activation scales (`input_scale`) are not used: where activations are quantized, they are scaled per
token (per token and 128-input group against block weights, DeepSeek's recipe).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pressroom.kernels import fp8 as kernels
from pressroom.kernels import fp8_moe
from pressroom.kernels.fp8 import FP8
from pressroom.kernels.fp8_moe import BLOCK, Fp8Experts
from pressroom.kernels.moe_activation import LimitedSwiglu
from pressroom.model.lazy_weight import LazyWeight
from pressroom.model.quantization.base import (
    LinearMethod,
    MoeMethod,
    QuantizationMethod,
    excluded,
    lazy_quantized,
    loads_into,
)

_SCALES = (".weight_scale_inv", ".weight_scale")
_DROPPED = (".input_scale",)  # static activation scales: activations are scaled per token instead


@dataclass(slots=True)
class Fp8Weight:
    """Rows of an FP8 checkpoint weight with their scales in the per-row group form."""
    q: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale: torch.Tensor  # float32 [rows, ceil(cols / group)]
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return kernels.dequantize(self.q, self.scale, self.group)

    def take_rows(self, order: torch.Tensor) -> Fp8Weight:
        """Rows `order` (a permutation or selection): exact, since every row carries its own scales."""
        return Fp8Weight(self.q[order], self.scale[order], self.group)

    def part(self, index) -> Fp8Weight:
        """Rows [r0, r1) and columns [c0, c1) (a LazyWeight's index); columns split only at group edges."""
        (r0, r1), (c0, c1) = index
        if c0 % self.group or (c1 % self.group and c1 != self.q.shape[1]):
            raise ValueError(f"an FP8 weight in groups of {self.group} inputs cannot be split at columns [{c0}, {c1}).")
        return Fp8Weight(self.q[r0:r1, c0:c1], self.scale[r0:r1, c0 // self.group: -(-c1 // self.group)], self.group)

    def lazy(self) -> LazyWeight:
        """This in-memory weight as a lazy tensor again, for the layers' loaders (which narrow what they read)."""
        return LazyWeight(tuple(self.q.shape), FP8, self.part)


# quantization_config's fmt and scale_fmt values read here (None: not given)
FORMATS = (None, "e4m3")
SCALE_FORMATS = (None, "ue8m0")


class Fp8Method(QuantizationMethod):
    name = "fp8"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        config = checkpoint_config or {}
        self.block: tuple[int, int] | None = _block_size(config.get("weight_block_size"))
        if config.get("fmt") not in FORMATS:
            raise ValueError(f"quantization_config.fmt is {config['fmt']!r}; FP8 checkpoints are read in e4m3 only.")
        if config.get("scale_fmt") not in SCALE_FORMATS:
            raise ValueError(f"quantization_config.scale_fmt is {config['scale_fmt']!r}, an unknown scale format; "
                             "FP8 checkpoints are read with float32 scales (no scale_fmt) or ue8m0.")
        self.ue8m0 = config.get("scale_fmt") == "ue8m0"
        # HF's and vLLM's names for the modules a checkpoint left unquantized
        self.kept_dense = [*(config.get("modules_to_not_convert") or ()), *(config.get("ignored_layers") or ())]

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.serialized and excluded(prefix, self.kept_dense):
            return None
        return Fp8LinearMethod(self.serialized, self.block[1] if self.block else None, self.ue8m0)

    def moe_method(self, layer: nn.Module, prefix: str) -> MoeMethod | None:
        """FP8 experts where a checkpoint ships them in 128 x 128 blocks (the form the experts' kernels read) and
        they are SwiGLU MLPs (DeepSeek-V4's clamped SwiGLU included) without biases; others load dense (online
        --quantization fp8, other scale layouts: dequantized at load)."""
        if not self.serialized or self.block != (BLOCK, BLOCK) or excluded(prefix, self.kept_dense):
            return None
        if not layer.gated or not isinstance(layer.activation, (type(None), LimitedSwiglu)) or \
                layer.w13_bias is not None:
            return None
        _check_whole_blocks(layer, prefix)
        return Fp8MoeMethod(self.ue8m0)

    def loads_as(self, model: nn.Module, name: str, tensors: dict[str, LazyWeight]) -> Iterable[tuple[str, Any]]:
        tensor = tensors[name]
        if name.endswith(_SCALES + _DROPPED):
            return ()
        if tensor.dtype != FP8:
            _refuse_scaled_non_fp8(tensors, name)
            return ((name, tensor),)
        keep = loads_into(model, name, (Fp8LinearMethod, Fp8MoeMethod))
        scale_name = _scale_of(tensors, name)
        return ((name, self._paired(tensor, tensors[scale_name], keep, scale_name)),)

    def _paired(self, weight: LazyWeight, scale: LazyWeight, keep: bool, scale_name: str) -> LazyWeight:
        """The weight and its scale (`scale_name`) as one lazy tensor: an Fp8Weight of the rows and columns read
        (kept by an FP8 layer), or those rows dequantized to fp32 (for any other parameter, or --quantization
        none)."""
        rows, cols = weight.shape
        scales = _ScaleLayout.of(_scale_values(scale.load(), self.ue8m0, scale_name), rows, cols, self.block,
                                 scale_name)

        def read(index) -> Fp8Weight:
            (r0, r1), (c0, c1) = index
            return Fp8Weight(weight.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0).load(), *scales.rows(r0, r1, c0, c1))

        return lazy_quantized((rows, cols), FP8, read, keep)


def _weight_only_fits(x: torch.Tensor, scale: torch.Tensor, group: int, any_size: bool) -> bool:
    """Small steps (decode), or any step of a weight-only layer (`any_size`), read the FP8 weight through the
    weight-only Triton GEMV: activations stay in their dtype. Larger ones quantize activations per token for
    _scaled_mm's FP8 tensor cores."""
    from pressroom.kernels.triton.quant_gemv import SMALL_M, fp8_block_k
    return (any_size or x.shape[0] <= SMALL_M) and fp8_block_k(group, scale.shape[1], 16) is not None


def _check_whole_blocks(layer: nn.Module, prefix: str) -> None:
    """A rank holding a slice of each expert's intermediate features (tensor parallelism) must hold whole 128-row
    blocks of gate and up and whole 128-column blocks of down: a block's scale cannot be split."""
    inter, full = layer.intermediate, layer.full_intermediate
    if inter != full and (inter % BLOCK or layer.inter_start % BLOCK):
        raise ValueError(f"{prefix}: FP8 experts come in {BLOCK} x {BLOCK} blocks, and this rank's share of their "
                         f"{full} intermediate features ({inter} from {layer.inter_start}) cuts a block; use a "
                         f"tensor_parallel_size that leaves each rank a multiple of {BLOCK} features, or "
                         "enable_expert_parallel (whole experts per rank).")


def _refuse_scaled_non_fp8(tensors: dict[str, LazyWeight], name: str) -> None:
    """A weight with a scale beside it that is not float8_e4m3fn (e5m2, or any other dtype) would load with its
    scale dropped: refused."""
    base = name.removesuffix(".weight")
    scales = [base + suffix for suffix in _SCALES if name.endswith(".weight") and base + suffix in tensors]
    if scales:
        raise ValueError(f"{name} is stored as {tensors[name].dtype} beside the scale {scales[0]}; FP8 checkpoints "
                         "are read in float8_e4m3fn only.")


def _block_size(block: Any) -> tuple[int, int] | None:
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, columns] of positive integers; "
                         f"got {block!r}.")
    return tuple(block)


_EXPONENT_BYTES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _scale_values(scale: torch.Tensor, ue8m0: bool, name: str) -> torch.Tensor:
    """A checkpoint's scale tensor `name` as fp32 multipliers: floats as they are, ue8m0 exponent bytes as
    2^(byte - 127); under scale_fmt ue8m0 every scale must be a power of two. Scales of another dtype, or not
    finite, are refused."""
    if scale.dtype in _EXPONENT_BYTES:
        if not ue8m0:
            raise ValueError(f"{name} is stored as {scale.dtype} exponent bytes, but quantization_config has no "
                             "scale_fmt 'ue8m0' to say so.")
        exponents = scale.view(torch.uint8)
        if (exponents == 255).any():  # e8m0's NaN
            raise ValueError(f"{name} holds the ue8m0 NaN (byte 255).")
        return torch.exp2(exponents.float() - 127)
    if scale.dtype not in _FLOAT_SCALES:
        raise ValueError(f"{name} is stored as {scale.dtype}, an unknown scale format; FP8 scales are read as float "
                         "multipliers (float32, bfloat16, float16), or as exponent bytes under scale_fmt 'ue8m0'.")
    values = scale.float()
    if not torch.isfinite(values).all():
        raise ValueError(f"{name} holds scales that are not finite (inf or NaN).")
    if ue8m0 and not ((values > 0) & (torch.frexp(values).mantissa == 0.5)).all():
        raise ValueError(f"{name} has scales that are not powers of two, which quantization_config's scale_fmt "
                         "'ue8m0' promises.")
    return values


def _block_gemm_fits(x: torch.Tensor, scale: torch.Tensor, group: int) -> bool:
    """Block scales in 128-input groups, on a GPU with FP8 tensor cores (compute capability 8.9 and later)."""
    from pressroom.kernels.triton.fp8_block_gemm import supported
    return supported(scale, group) and torch.cuda.get_device_capability(x.device) >= (8, 9)


def _scale_of(tensors: dict[str, LazyWeight], name: str) -> str:
    base = name.removesuffix(".weight")
    for suffix in _SCALES:
        if base + suffix in tensors:
            return base + suffix
    raise ValueError(f"{name} is stored in FP8 but the checkpoint has no {base}.weight_scale or "
                     f"{base}.weight_scale_inv to scale it.")


@dataclass(slots=True)
class _ScaleLayout:
    """One checkpoint scale tensor, read in the per-row group form for any rows and columns of its weight."""
    scale: torch.Tensor  # float32: [rows, 1] (per tensor or per channel) or [row blocks, column blocks]
    block: tuple[int, int] | None  # None: one group per row

    @classmethod
    def of(cls, scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None, name: str) -> _ScaleLayout:
        scale = scale.float()
        if scale.numel() == 1:
            return cls(scale.reshape(1, 1).expand(rows, 1), None)
        if scale.numel() == rows and scale.dim() <= 2 and scale.shape[0] == rows:
            return cls(scale.reshape(rows, 1), None)
        if block is not None and tuple(scale.shape) == (-(-rows // block[0]), -(-cols // block[1])):
            return cls(scale, block)
        expected = "[1], [out], [out, 1]" + (f" or [{-(-rows // block[0])}, {-(-cols // block[1])}]" if block else "")
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; for its FP8 weight of shape {(rows, cols)} "
                         f"takes {expected} (block scales need quantization_config.weight_block_size).")

    def rows(self, r0: int, r1: int, c0: int, c1: int) -> tuple[torch.Tensor, int]:
        """Scales [r1 - r0, groups] and the group width for weight rows [r0, r1) and columns [c0, c1)."""
        if self.block is None:
            return self.scale[r0:r1].contiguous(), c1 - c0
        block_rows, block_cols = self.block
        if c0 % block_cols:
            raise ValueError(f"an FP8 weight in {block_cols}-column blocks can only be split along its inputs at "
                             f"multiples of {block_cols} (here at {c0}); use a tensor_parallel_size that keeps "
                             "each rank's share of the inputs whole blocks.")
        per_row = self.scale[torch.arange(r0, r1) // block_rows]
        return per_row[:, c0 // block_cols: -(-c1 // block_cols)].contiguous(), block_cols


class Fp8LinearMethod(LinearMethod):
    """`serialized`: rows come in FP8 from the checkpoint; else the dense weight is quantized after loading.
    `block_cols`: the checkpoint's block width (its scales' group), None for one scale per row. `pow2_scales`:
    activations are scaled by powers of two (scale_fmt ue8m0)."""

    def __init__(self, serialized: bool, block_cols: int | None = None, pow2_scales: bool = False) -> None:
        self.serialized, self.block_cols, self.pow2_scales = serialized, block_cols, pow2_scales
        # off: weight-only at every step, activations as they are (to compare with a dense twin)
        self.quantize_activations = True

    def create_weights(self, layer: nn.Module) -> None:
        out, cols = layer.weight.shape
        layer.register_buffer("weight_scale", None)
        layer.weight_group = self.block_cols or cols
        if self.serialized:
            device = layer.weight.device
            layer.weight.data = torch.empty(out, cols, dtype=FP8, device=device)
            layer.weight_scale = torch.ones(out, -(-cols // layer.weight_group), device=device)

    def store_rows(self, layer: nn.Module, row: int, loaded: Any) -> bool:
        if not self.serialized:
            return False
        if not isinstance(loaded, Fp8Weight):  # a part the checkpoint left unquantized: one scale per row
            loaded = Fp8Weight(*kernels.quantize(loaded, loaded.shape[1]), loaded.shape[1])
        rows, groups = loaded.q.shape[0], layer.weight_scale.shape[1]
        if loaded.scale.shape[1] == 1:  # one scale per row serves every group of the row
            scale = loaded.scale.expand(rows, groups)
        elif loaded.group == layer.weight_group:
            scale = loaded.scale
        else:
            raise ValueError(f"FP8 scales in groups of {loaded.group} inputs cannot join a layer scaled in groups "
                             f"of {layer.weight_group}.")
        if tuple(loaded.q.shape) != (rows, layer.weight.shape[1]) or row + rows > layer.weight.shape[0]:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.q.shape)}, which does not fit rows "
                             f"[{row}, {row + rows}) of a weight of shape {tuple(layer.weight.shape)}.")
        layer.weight.data[row:row + rows].copy_(loaded.q)
        layer.weight_scale[row:row + rows].copy_(scale)
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            q, scale = kernels.quantize(layer.weight.data, layer.weight_group)
            layer.weight.data, layer.weight_scale = q.contiguous(), scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, scale = layer.weight, layer.weight_scale
        if flat.is_cuda and _weight_only_fits(flat, scale, layer.weight_group, not self.quantize_activations):
            from pressroom.kernels.triton.quant_gemv import fp8_linear
            y = fp8_linear(flat, w, scale, layer.weight_group, bias)
        elif not self.quantize_activations:
            y = torch.nn.functional.linear(flat.float(), self.dequantized(layer),
                                           None if bias is None else bias.float()).to(flat.dtype)
        elif scale.shape[1] == 1 and flat.is_cuda and kernels.scaled_mm_supported(flat, w):
            y = kernels.scaled_mm(flat, w, scale, bias)
        elif flat.is_cuda and _block_gemm_fits(flat, scale, layer.weight_group):
            from pressroom.kernels.triton.fp8_block_gemm import block_fp8_linear
            y = block_fp8_linear(flat, w, scale, bias, self.pow2_scales)
        else:
            y = kernels.reference(flat, w, scale, layer.weight_group, bias, self.pow2_scales)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer multiplies by, in fp32 (for tests and inspection)."""
        return kernels.dequantize(layer.weight.data, layer.weight_scale, layer.weight_group)


class Fp8MoeMethod(MoeMethod):
    """A FusedMoE's experts kept as DeepSeek's FP8 checkpoints ship them (kernels/fp8_moe.py's `Fp8Experts`): `w13`
    float8_e4m3fn [experts, 2 * inter, hidden] with `w13_scale` fp32 [experts, 2 * ceil(inter / 128),
    ceil(hidden / 128)] (gate's block rows, then up's), `w2` [experts, hidden, inter] with `w2_scale`
    [experts, ceil(hidden / 128), ceil(inter / 128)]; this rank's experts and slices, one byte a weight.

    `quantize_activations` (DeepSeek's recipe, the default): activations quantized per token and 128 inputs,
    `pow2_scales` by powers of two (scale_fmt ue8m0); off, the experts run weight-only (to compare with a dense
    twin). DeepSeek-V4's clamped SwiGLU (the layer's `LimitedSwiglu`) runs as the kernels' `swiglu_limit`. On CUDA
    GPUs with FP8 tensor cores through kernels/triton/fused_moe_fp8.py, elsewhere through the torch
    reference, which dequantizes the chosen experts at each call."""

    def __init__(self, pow2_scales: bool = False) -> None:
        self.pow2_scales = pow2_scales
        self.quantize_activations = True

    def create_weights(self, layer: nn.Module) -> None:
        for param, halves in _EXPERT_GRIDS:
            dense = getattr(layer, param)
            experts, rows, cols = dense.shape
            dense.data = torch.empty(experts, rows, cols, dtype=FP8, device=dense.device)
            grid = (experts, halves * fp8_moe.blocks(rows // halves), fp8_moe.blocks(cols))
            layer.register_buffer(f"{param}_scale", torch.ones(grid, dtype=torch.float32, device=dense.device))

    def store_rows(self, layer: nn.Module, param: str, expert: int, row: int, loaded: Any) -> bool:
        target = getattr(layer, param).data[expert]
        half = target.shape[0] // dict(_EXPERT_GRIDS)[param]
        if tuple(loaded.shape) != (half, target.shape[1]) or row % half:
            raise ValueError(f"an FP8 expert part of shape {tuple(loaded.shape)} at row {row} is not one whole part "
                             f"({half} rows) of {param}, a matrix of shape {tuple(target.shape)}.")
        q, scale = _block_form(loaded)
        first = row // half * fp8_moe.blocks(half)
        target[row:row + half].copy_(q)
        getattr(layer, f"{param}_scale")[expert, first:first + scale.shape[0]].copy_(scale)
        return True

    def experts(self, layer: nn.Module) -> tuple[Fp8Experts, Fp8Experts]:
        """The layer's w13 and w2 in kernels/fp8_moe.py's stacked form."""
        return (Fp8Experts(layer.w13.data, layer.w13_scale, 2), Fp8Experts(layer.w2.data, layer.w2_scale))

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        (w13, w2), local = self.experts(layer), layer.local_ids(ids)
        limit = layer.activation.limit if isinstance(layer.activation, LimitedSwiglu) else None
        options = dict(quantize_activations=self.quantize_activations, pow2_scales=self.pow2_scales,
                       swiglu_limit=limit)
        if x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9):  # Triton's FP8 needs sm_89 or later
            from pressroom.kernels.triton.fused_moe_fp8 import fused_moe_fp8
            return fused_moe_fp8(x.contiguous(), w13, w2, weights, local, all_local=layer.owns_all, **options)
        return fp8_moe.reference(x, w13, w2, weights, local, **options)

    def dequantized(self, layer: nn.Module, param: str, expert: int) -> torch.Tensor:
        """Local expert `expert`'s `param` in fp32, as it multiplies (for tests and inspection)."""
        return self.experts(layer)[param == "w2"].dequantize(expert)


# each expert matrix and the grids of blocks down its rows: gate's and up's, down's one
_EXPERT_GRIDS = (("w13", 2), ("w2", 1))


def _block_form(loaded: Fp8Weight | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of an expert matrix as FP8 values and 128 x 128 block scales [ceil(rows / 128), ceil(cols / 128)]: a
    checkpoint's block-scaled rows as they come (exact); rows it scales otherwise (per tensor, per channel) or ships
    dense, quantized into blocks."""
    if isinstance(loaded, Fp8Weight):
        scale = _block_scales(loaded)
        if scale is not None:
            return loaded.q, scale
        loaded = loaded.dequantize()
    q, scale = fp8_moe.quantize_blocks(loaded)
    return q, scale


def _block_scales(w: Fp8Weight) -> torch.Tensor | None:
    """w's per-row group scales as one scale per 128 x 128 block, where they are that (None otherwise)."""
    rows, cols = w.q.shape
    if w.scale.shape[1] == 1:  # one scale per row: every block of the row
        scale = w.scale.expand(rows, fp8_moe.blocks(cols))
    elif w.group == BLOCK:
        scale = w.scale
    else:
        return None
    per_block = scale[::BLOCK]
    if not torch.equal(per_block.repeat_interleave(BLOCK, 0)[:rows], scale):
        return None
    return per_block.contiguous()
