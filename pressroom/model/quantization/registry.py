"""Finding a quantization method by name: a built-in one, an installed package's entry point in the group
`pressroom.quantization`, or `module.path:ClassName`.

A plug-in package declares, in its pyproject.toml:

    [project.entry-points."pressroom.quantization"]
    mymethod = "my_package.quant:MyMethod"

and is then used as `--quantization mymethod`; without a package, `--quantization my_package.quant:MyMethod`
imports the class directly. Either way the class must subclass `QuantizationMethod`.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from pressroom.config import QUANTIZATION_ENTRY_POINTS
from pressroom.model.quantization.base import QuantizationMethod

BUILTIN = {"awq": "pressroom.model.quantization.int4:AwqMethod",
           "fp8": "pressroom.model.quantization.fp8:Fp8Method",
           "gptq": "pressroom.model.quantization.int4:GptqMethod",
           "mxfp4": "pressroom.model.quantization.mxfp4:Mxfp4Method",
           "nvfp4": "pressroom.model.quantization.nvfp4:Nvfp4Method"}
# --quantization values that select no method: GGUF's own 4-bit path (auto) or dense weights (none)
NO_METHOD = ("auto", "none")


def method_class(name: str) -> type[QuantizationMethod]:
    """The class `name` stands for; a ValueError that lists what exists when it stands for nothing."""
    if name in BUILTIN:
        return _import_class(BUILTIN[name], name)
    plugin = next((ep for ep in entry_points(group=QUANTIZATION_ENTRY_POINTS) if ep.name == name), None)
    if plugin is not None:
        return _checked(_load_entry_point(plugin), name)
    if ":" in name:
        return _import_class(name, name)
    installed = sorted({*BUILTIN, *(ep.name for ep in entry_points(group=QUANTIZATION_ENTRY_POINTS))})
    raise ValueError(f"Unknown quantization method {name!r}: use one of {', '.join(installed)}, an installed "
                     f"plug-in (entry point group {QUANTIZATION_ENTRY_POINTS!r}) or module.path:ClassName.")


def _load_entry_point(plugin):
    try:
        return plugin.load()
    except Exception as e:  # a broken plug-in is the user's to fix: say which one
        raise ValueError(f"Quantization plug-in {plugin.name!r} ({plugin.value}) failed to load: {e}") from e


def _import_class(path: str, name: str) -> type[QuantizationMethod]:
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"Quantization method {name!r} cannot be imported as module.path:ClassName: {e}") from e
    return _checked(cls, name)


def _checked(cls, name: str) -> type[QuantizationMethod]:
    if not (isinstance(cls, type) and issubclass(cls, QuantizationMethod)):
        raise ValueError(f"Quantization method {name!r} is {cls!r}, not a subclass of "
                         "pressroom.model.quantization.QuantizationMethod.")
    return cls
