"""Triton kernels of the CUDA backend, each with a plain-torch reference it is tested against.

The submodules import triton themselves, so this package imports where triton is missing. Under
`TRITON_INTERPRET=1` (set before the submodules are imported) the kernels run on the CPU through Triton's
interpreter, which is how CI checks them.
"""
from __future__ import annotations

import os

import torch


def available() -> bool:
    """Triton imports and there is something to run it on: a CUDA device or the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or interpreting()


def interpreting() -> bool:
    """Whether kernels defined now run under Triton's CPU interpreter (triton.jit reads this at definition)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _mend_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a loop bound into a Python int with int() of a shape-(1,) array, which
    numpy >= 2.4 refuses, so every `range` with bounds computed in the kernel fails (triton-lang/triton#9171,
    fixed upstream after 3.6). Re-register `__index__` the way the fix does; the interpreter only, idempotent."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "mended_by_pressroom", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.mended_by_pressroom = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if interpreting():
    _mend_interpreter_index()
