"""Quantization methods: the interface (`base.py`), finding one by name (`registry.py`) and the built-in ones
(`fp8.py`). The loader resolves the method, hands each linear layer its layer method before loading and
lets them transform their weights after it (model/loader.py)."""
from __future__ import annotations

from pressroom.model.quantization.base import LinearMethod, QuantizationMethod
from pressroom.model.quantization.registry import NO_METHOD, method_class

__all__ = ["LinearMethod", "QuantizationMethod", "checkpoint_quantization", "resolve_method"]


def checkpoint_quantization(hf_config) -> dict | None:
    """The checkpoint's `quantization_config` (config.json), or None for a checkpoint of plain weights."""
    found = getattr(hf_config, "quantization_config", None)
    if found is not None and not isinstance(found, dict):
        found = found.to_dict() if hasattr(found, "to_dict") else dict(found)
    return found or None


def resolve_method(quantization: str, checkpoint: dict | None) -> QuantizationMethod | None:
    """The method a model loads with: `--quantization` by name, or with auto (and none) the checkpoint's own
    `quant_method` (`checkpoint`: its quantization_config); None for plain weights under auto or none (GGUF's
    4-bit path is the loader's)."""
    shipped = checkpoint.get("quant_method") if checkpoint else None
    if shipped is not None and quantization not in (*NO_METHOD, shipped):
        raise ValueError(f"This checkpoint is quantized with {shipped!r}; --quantization {quantization} cannot "
                         f"apply to it. Leave --quantization at auto (or pass {shipped}).")
    name = shipped if quantization in NO_METHOD else quantization
    if name is None:
        return None
    return method_class(name)(checkpoint if name == shipped else None)
