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


_FAST = [("bf16", True, 128)]  # Kimi Linear's KDA (the per-channel gate: the larger tiles)
_SLOW = [("bf16", False, 128), ("fp32", False, 128), ("fp32", True, 128), ("bf16", True, 256), ("fp32", True, 256)]


@pytest.mark.parametrize("dtype,per_channel_gate,head_dim",
                         _FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in _SLOW])
def test_delta_rule_prefill_fits_hopper_shared_memory(dtype, per_channel_gate, head_dim):
    launches = _in_compiling_child(f"delta_rule_prefill_smem({dtype!r}, {per_channel_gate}, {head_dim})")
    assert [name for name, _ in launches] == ["_gate_cumsum_kernel", "_wy_kernel", "_scan_kernel"]
    for name, shared in launches:
        assert 0 <= shared <= HOPPER_SMEM_BYTES, f"{name}: {shared} bytes of shared memory"
    assert dict(launches)["_scan_kernel"] > 0  # the scan's dots stage their operands in shared memory


def _v4_decode_step(dtype: torch.dtype, mode: str):
    """One DeepSeek-V4-Flash decode step's attention launches (64 heads of 512, window 128, blocks of 64; CSA:
    rate 4, the indexer's 64 heads of 128 and top-512; HCA: rate 128) for 4 decodes over 4k-token tables, the
    window from rings; the compressor's mixing too. "sliding": the MTP drafter's layer, its window paged."""
    from pressroom.kernels.triton import v4_attention as v4
    tokens, heads, dim, block_size, blocks = 4, 64, 512, 64, 64
    q = torch.randn(tokens, heads, dim, dtype=dtype)
    window = torch.zeros(1, blocks + 1, block_size, 1, dim, dtype=dtype)
    tables = torch.arange(1, blocks + 1, dtype=torch.int32).repeat(tokens, 1)
    req, pos = torch.arange(tokens), torch.full((tokens,), 4000)
    sinks = torch.zeros(heads)
    if mode == "sliding":
        return lambda: v4.v4_attention(q, req, pos, sinks, 128, dim ** -0.5, paged=(window, tables))
    on_ring = (torch.zeros(tokens + 1, 128, dim, dtype=dtype), torch.arange(1, tokens + 1),
               torch.arange(tokens + 1, dtype=torch.int32), torch.zeros(tokens, dim, dtype=dtype))
    rate = 4 if mode == "csa" else 128
    entry_dim = dim + (128 if mode == "csa" else 0)
    cache = torch.zeros(1, blocks + 1, max(1, block_size // rate), 1, entry_dim, dtype=dtype)
    entries = (cache, *v4.entry_table(tables, rate, block_size), rate)
    ring = (2 if mode == "csa" else 1) * rate
    width = ring // rate * dim
    rings = [torch.zeros(3, ring, width, dtype=dtype) for _ in range(2)]

    def compress():
        v4.mix_closing_windows(*rings, torch.zeros(rate, width), torch.ones(tokens, dtype=torch.long), pos,
                               torch.zeros(tokens, dtype=torch.long), dim, mode == "csa")

    if mode == "hca":
        return lambda: (compress(), v4.v4_attention(q, req, pos, sinks, 128, dim ** -0.5, ring=on_ring,
                                                    entries=entries))

    def csa():
        compress()
        index_q, index_w = torch.randn(tokens, 64, 128), torch.randn(tokens, 64)
        chosen = v4.choose_entries(index_q, index_w, entries, req, pos, dim, 512)
        v4.v4_attention(q, req, pos, sinks, 128, dim ** -0.5, ring=on_ring, entries=entries, chosen=chosen)
    return csa


def v4_attention_smem(dtype: str, mode: str) -> list[tuple[str, int]]:
    """(kernel, shared bytes) of each launch of one V4 decode step's attention; run with TRITON_INTERPRET unset."""
    from pressroom.kernels.triton import dsa
    from pressroom.kernels.triton import v4_attention as v4
    step = _v4_decode_step(_DTYPES[dtype], mode)
    indexer = [lambda: recorded_launches(v4, ["_v4_attention_kernel", "_merge_token_splits_kernel",
                                              "_mix_closing_kernel"], step)]
    launches = recorded_launches(dsa, ["_indexer_logits_kernel"], lambda: indexer.append(indexer[0]()))
    launches += indexer[1]
    return [(name, compile_for_hopper(kernel, args, kwargs).metadata.shared)
            for name, kernel, args, kwargs in launches]


@pytest.mark.parametrize("dtype, mode", [("bf16", "csa"), ("bf16", "hca"),
                                         pytest.param("fp32", "csa", marks=pytest.mark.slow),
                                         pytest.param("bf16", "sliding", marks=pytest.mark.slow)])
def test_v4_attention_fits_hopper_shared_memory(dtype, mode):
    launches = _in_compiling_child(f"v4_attention_smem({dtype!r}, {mode!r})")
    names = [name for name, _ in launches]
    assert "_v4_attention_kernel" in names and ("_indexer_logits_kernel" in names) == (mode == "csa")
    assert ("_mix_closing_kernel" in names) == (mode != "sliding")
    for name, shared in launches:
        assert 0 <= shared <= HOPPER_SMEM_BYTES, f"{name}: {shared} bytes of shared memory"
