"""The Triton kernels' launches fit a Hopper GPU's shared memory, checked without one: the launcher runs on CPU
tensors with its kernels swapped for recorders, and each recorded launch is compiled for sm_90 (Triton's bundled
ptxas), whose metadata gives the shared memory the launch needs. A launch over the H100/H200 limit fails on the
device with OutOfResources; this finds it here first. The compile runs in a child process: the suite's
TRITON_INTERPRET=1 turns every kernel into an interpreted function, which does not compile."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

HOPPER_SMEM_BYTES = 232448  # per block, sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)
_POINTER_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                  torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    return "fp32"


def compile_for_hopper(kernel, args: tuple, kwargs: dict):
    """Compile one recorded launch for sm_90; returns Triton's compiled kernel (metadata.shared: bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    names = kernel.arg_names
    defaults = {param.name: param.default for param in kernel.params if param.has_default}
    values = defaults | dict(zip(names, args)) | kwargs
    constexpr_names = {names[i] for i in kernel.constexprs}
    signature, constexprs = {}, {}
    for name in names:
        value = values[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTER_TYPES[value.dtype]
        else:
            signature[name] = _scalar_type(value)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def recorded_launches(module, kernel_names: list[str], launcher) -> list[tuple]:
    recorders = {name: _Recorder(getattr(module, name)) for name in kernel_names}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        launcher()
    finally:
        for name, recorder in recorders.items():
            setattr(module, name, recorder.kernel)
    return [(name, recorder.kernel, args, kwargs) for name, recorder in recorders.items()
            for args, kwargs in recorder.launches]


def _delta_rule_prefill(dtype: torch.dtype, per_channel_gate: bool, head_dim: int, heads: int = 4):
    from pressroom.kernels.triton import delta_rule_chunk
    tokens = 200
    q, k = (torch.randn(tokens, heads, head_dim, dtype=dtype) for _ in range(2))
    v = torch.randn(tokens, heads, head_dim, dtype=dtype)
    g = -torch.rand(tokens, heads, head_dim if per_channel_gate else 1, dtype=torch.float32).squeeze(-1)
    beta = torch.rand(tokens, heads, dtype=dtype)
    states = torch.zeros(2, heads, head_dim, head_dim, dtype=torch.float32)
    cu = torch.tensor([0, 70, tokens], dtype=torch.int32)
    return lambda: delta_rule_chunk.chunk_delta_rule_varlen(q, k, v, g, beta, cu, states,
                                                            torch.tensor([0, 1], dtype=torch.int32))


def delta_rule_prefill_smem(dtype: str, per_channel_gate: bool, head_dim: int) -> list[tuple[str, int]]:
    """(kernel, shared bytes) of each launch of one delta-rule prefill; run with TRITON_INTERPRET unset."""
    from pressroom.kernels.triton import delta_rule_chunk
    launches = recorded_launches(delta_rule_chunk, ["_gate_cumsum_kernel", "_wy_kernel", "_scan_kernel"],
                                 _delta_rule_prefill(_DTYPES[dtype], per_channel_gate, head_dim))
    return [(name, compile_for_hopper(kernel, args, kwargs).metadata.shared)
            for name, kernel, args, kwargs in launches]


def _in_compiling_child(call: str) -> list:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = f"import json, tests.kernels.test_triton_smem as probe; print(json.dumps(probe.{call}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_FAST = [("bf16", False, 128), ("bf16", True, 128)]  # Qwen3-Next GDN, Kimi Linear KDA
_SLOW = [("fp32", False, 128), ("fp32", True, 128), ("bf16", True, 256), ("fp32", True, 256)]


@pytest.mark.parametrize("dtype,per_channel_gate,head_dim",
                         _FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in _SLOW])
def test_delta_rule_prefill_fits_hopper_shared_memory(dtype, per_channel_gate, head_dim):
    launches = _in_compiling_child(f"delta_rule_prefill_smem({dtype!r}, {per_channel_gate}, {head_dim})")
    assert [name for name, _ in launches] == ["_gate_cumsum_kernel", "_wy_kernel", "_scan_kernel"]
    for name, shared in launches:
        assert 0 <= shared <= HOPPER_SMEM_BYTES, f"{name}: {shared} bytes of shared memory"
    assert dict(launches)["_scan_kernel"] > 0  # the scan's dots stage their operands in shared memory
