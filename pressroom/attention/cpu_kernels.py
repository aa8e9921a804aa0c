"""CPU kernels written in C, compiled with the system compiler at first use and called through ctypes.

Plain C (no torch headers) keeps the build to about a second. Where no compiler is found the
engine falls back to the torch reference path, which computes the same thing.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger("pressroom")
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cache_dir() -> Path:
    root = os.environ.get("PRESSROOM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pressroom")
    return Path(root) / "kernels"


def _build(source: Path) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    key = hashlib.sha256(source.read_bytes() + " ".join(_FLAGS).encode() + platform.machine().encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run([compiler, *_FLAGS, str(source), "-o", str(partial), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("CPU kernel build failed, using the torch path: %s", result.stderr[-500:])
            return None
        os.replace(partial, target)  # atomic: concurrent builders never load half a file
    return target


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PRESSROOM_DISABLE_C_KERNELS"):
        return None
    path = _build(_SOURCE)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    args = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def available() -> bool:
    return _library() is not None


_KERNELS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def supports(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _KERNELS and available()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seqs, heads, dim]; caches: [blocks, block_size, kv_heads, dim] (contiguous). Returns fp32 output."""
    seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q32 = q.float().contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty(seqs, heads, dim, dtype=torch.float32)
    getattr(_library(), _KERNELS[k_cache.dtype])(
        out.data_ptr(), q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        seqs, heads, kv_heads, dim, block_size, tables.shape[1], scale, torch.get_num_threads())
    return out
