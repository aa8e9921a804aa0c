"""Quantization methods: the interface (`base.py`), finding one by name (`registry.py`) and the built-in ones
(`fp8.py`). The loader resolves the method, hands each linear layer its layer method before loading and
lets them transform their weights after it (model/loader.py)."""
from __future__ import annotations

import json
import os

from pressroom.model.quantization.base import LinearMethod, MoeMethod, QuantizationMethod
from pressroom.model.quantization.registry import NO_METHOD, method_class

__all__ = ["LinearMethod", "MoeMethod", "QuantizationMethod", "checkpoint_quantization", "resolve_method"]

# ModelOpt's exports name their tool, not their format: quant_algo -> the method that reads it
_MODELOPT = {"NVFP4": "nvfp4"}


def checkpoint_quantization(hf_config, path: str | None = None) -> dict | None:
    """The checkpoint's `quantization_config` (config.json), or ModelOpt's hf_quant_config.json beside it (its
    `quantization` with quant_method "modelopt"); None for a checkpoint of plain weights."""
    found = getattr(hf_config, "quantization_config", None)
    if found is not None and not isinstance(found, dict):
        found = found.to_dict() if hasattr(found, "to_dict") else dict(found)
    modelopt = os.path.join(path, "hf_quant_config.json") if path and os.path.isdir(path) else None
    if not found and modelopt and os.path.exists(modelopt):
        with open(modelopt) as f:
            found = {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
    return found or None


def _shipped_method(checkpoint: dict | None) -> str | None:
    """The method that reads the checkpoint: its quant_method, or for ModelOpt the one for its quant_algo."""
    shipped = checkpoint.get("quant_method") if checkpoint else None
    if shipped != "modelopt":
        return shipped
    algo = str(checkpoint.get("quant_algo", "")).upper()
    if algo not in _MODELOPT:
        raise ValueError(f"ModelOpt checkpoints are read in {', '.join(_MODELOPT)} only; this one is quant_algo "
                         f"{algo or None!r}.")
    return _MODELOPT[algo]


def resolve_method(quantization: str, checkpoint: dict | None) -> QuantizationMethod | None:
    """The method a model loads with: `--quantization` by name, or with auto (and none) the checkpoint's own
    `quant_method` (`checkpoint`: its quantization_config); None for plain weights under auto or none (GGUF's
    4-bit path is the loader's)."""
    shipped = _shipped_method(checkpoint)
    if shipped is not None and quantization not in (*NO_METHOD, shipped):
        raise ValueError(f"This checkpoint is quantized with {shipped!r}; --quantization {quantization} cannot "
                         f"apply to it. Leave --quantization at auto (or pass {shipped}).")
    name = shipped if quantization in NO_METHOD else quantization
    if name is None:
        return None
    return method_class(name)(checkpoint if name == shipped else None)
