"""CPU kernels written in C, compiled with the system compiler at first use and called through ctypes.

Plain C (no torch headers) keeps the build to about a second. The target follows the CPU's tier
(pressroom/platforms/cpu.py), and the cached library is keyed by source, flags, compiler and CPU
features. Where no compiler is found, `available()` is false and callers use their torch
reference path, which computes the same thing (tests compare the two).
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
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from pressroom.platforms import user_cache_dir
from pressroom.platforms.cpu import cpu_info

logger = logging.getLogger("pressroom")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("cpu_ops.c", "quant_ops.c", "decode_stack.c", "ggml_ops.c", "gemma3_stack.c",
                                             "workshare.c", "ggml_numerics.c", "recurrent.c", "vnni_gemm.c")]
_HEADERS = [_CSRC / name for name in ("common.h", "int8_dot.h", "ggml_matrix.h", "workshare.h", "layer_ops.h")]
# Reassociation lets the compiler vectorise the float reductions; finite-math stays off (-inf is used).
# The target (-march) comes from the CPU's tier: pressroom/platforms/cpu.py.
_BASE_FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
               "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "paged_decode": [_P] * 6 + [_I] * 7 + [_F, _T],
    "rms_norm": [_P] * 4 + [_I, _I, _F, _T],
    "rotary": [_P, _P, _P, _I, _I, _I, _I, _I, _T],
    "gelu_tanh_and_mul": [_P, _P, _I, _I, _T],
    "silu_and_mul": [_P, _P, _I, _I, _T],
}
_QUANT_SIGNATURES = {
    "q4_matmul_f32": [_P] * 5 + [_I] * 3 + [_T],
    "decode_stack": [_P, _P, _I] + [_P] * 7 + [_F, _F, _P, _P, _T],
    "ggml_quantize_q8_0": [_P] * 4 + [_I] * 2,
    "ggml_quantize_q8_k": [_P] * 4 + [_I] * 2,
    "ggml_q8_0_matmul_f32": [_P] * 4 + [_I] * 3 + [_T],
    "ggml_q8_0_blocks_matmul_f32": [_P] * 3 + [_I] * 3 + [_T],
    "ggml_q5_0_matmul_f32": [_P] * 5 + [_I] * 3 + [_T],
    "ggml_k4_matmul_f32": [_P] * 8 + [_I] * 3 + [_T],
    "ggml_q6_k_matmul_f32": [_P] * 6 + [_I] * 3 + [_T],
    "ggml_matrix_matmul_f32": [_P] * 3 + [_I] * 2 + [_T],
    "gemma3_decode_stack": [_P, _P, _I] + [_P] * 9 + [_F, _F, _T, _T],
    "ggml_rms_norm_f32": [_P] * 4 + [_I, _I, _F, _T],
    "ggml_geglu_f32": [_P, _P, _I, _I, _T],
    "ggml_attention_f32": [_P] * 7 + [_I] * 7 + [_F, _T],
    "ggml_rope_tables": [_P, _P, _I, _I, _F, _F],
    "ggml_rotary_f32": [_P, _P, _P, _I, _I, _I, _I, _I, _T],
    "ggml_set_q4_k_gemm_rows": [_P],
    "argmax_rows_f32": [_P, _P, _I, _I, _I],
    "vnni_gemm_f32": [_P, _P, _I, _I, _P, _P, _P, _I, _T],
    "vnni_q8_gemm_f32": [_P, _P, _I, _I, _P, _P, _I, _T],
}
# recurrent.c: these return 0, or -1 when a slot lies outside the state pool (nothing is done then).
_RECURRENT_SIGNATURES = {
    "mamba1_scan": [_P] * 13 + [_I] * 4 + [_T] * 3,
    "ssd_step": [_P] * 11 + [_I] * 6 + [_F, _F, _T, _T, _T],
    "delta_rule_step": [_P] * 9 + [_I] * 6 + [_F, _T, _T, _T, _T],
}
_COUNTS = ("ggml_matrix_fields", "gemma3_layer_fields")
# decode_stack.c's per-layer pointer table and shape vector, in its order.
DECODE_LAYER_FIELDS = ("ln1", "qkv_q", "qkv_d", "qkv_m", "qkv_bias", "o_q", "o_d", "o_m", "ln2",
                       "gu_q", "gu_d", "gu_m", "down_q", "down_d", "down_m", "k_cache", "v_cache",
                       "qkv_p", "qkv_pd", "qkv_pm", "o_p", "o_pd", "o_pm", "gu_p", "gu_pd", "gu_pm",
                       "down_p", "down_pd", "down_pm")  # the *_p fields: byte panels (vnni_gemm.c; 0: none)
DECODE_DIM_FIELDS = ("tokens", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
                     "max_blocks", "cache_bf16")
# csrc/ggml_matrix.h: a matrix is a count of parts, then MAX_PARTS parts of these fields (arrays as pointers).
GGML_PART_FIELDS = ("kind", "rows", "qs", "qh", "sc", "mn", "d", "dmin")
GGML_MAX_PARTS = 3
GGML_KINDS = ("Q8_0", "Q5_0", "K4", "Q6_K", "Q8_0_BLOCKS")
# gemma3_stack.c's per-layer table: these scalars, then the qkv, o, gate_up and down matrices.
GEMMA3_LAYER_FIELDS = ("attn_in", "q_norm", "k_norm", "attn_out", "ffn_in", "ffn_out", "k_cache", "v_cache",
                       "window", "global")
GEMMA3_MATRICES = ("qkv", "o", "gate_up", "down")


def _cache_dir() -> Path:
    return user_cache_dir("kernels")


def compile_flags() -> list[str]:
    return [*_BASE_FLAGS, *cpu_info().kernel_flags()]


def build_key(source: bytes, flags: list[str], compiler: str, cpu_flags: frozenset[str]) -> str:
    """The cached library's name: anything that changes the machine code changes the key, so a home
    directory shared between machines never loads a library built for another CPU (SIGILL)."""
    parts = [source, " ".join(flags).encode(), compiler.encode(), platform.machine().encode(),
             " ".join(sorted(cpu_flags)).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compiler_identity(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return f"{compiler} {result.stdout.splitlines()[0] if result.stdout else ''}"


def _build(sources: list[Path], headers: list[Path]) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    flags = compile_flags()
    key = build_key(b"".join(s.read_bytes() for s in [*sources, *headers]), flags, _compiler_identity(compiler),
                    cpu_info().flags)
    target = _cache_dir() / f"pressroom_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(partial), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("CPU kernel build failed, using the torch path: %s", result.stderr[-500:])
            return None
        os.replace(partial, target)  # atomic: a concurrent builder never loads half a file
    target_flags = " ".join(cpu_info().kernel_flags()) or "the compiler's default target"
    logger.info("built the C kernels for %s (%s)", cpu_info().isa.name, target_flags)
    return target


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PRESSROOM_DISABLE_C_KERNELS"):
        return None
    path = _build(_SOURCES, _HEADERS)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for base, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"{base}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    for name, argtypes in _QUANT_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    for name, argtypes in _RECURRENT_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int64
    for name in _COUNTS:
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int64
    _check_tables(lib)
    return lib


def _check_tables(lib: ctypes.CDLL) -> None:
    """The C structs' sizes equal the field lists here (a drift would read pointers from the wrong slots)."""
    matrix = 1 + GGML_MAX_PARTS * len(GGML_PART_FIELDS)
    layer = len(GEMMA3_LAYER_FIELDS) + len(GEMMA3_MATRICES) * matrix
    if lib.ggml_matrix_fields() != matrix or lib.gemma3_layer_fields() != layer:
        raise RuntimeError("kernels/cpu.py's table fields disagree with csrc/ggml_matrix.h or gemma3_stack.c.")


def available() -> bool:
    return _library() is not None


def supports(*tensors: torch.Tensor) -> bool:
    """True when the C kernels can take these tensors (CPU, bf16 or fp32) and were built."""
    return all(t.device.type == "cpu" and t.dtype in _SUFFIX for t in tensors) and available()


# Below this many elements an elementwise kernel runs on the calling thread: waking the others costs more
# than it saves. An OpenMP region costs microseconds on an idle machine but milliseconds where other processes
# preempt its threads (a 32-token Gemma 3 prompt's ~400 norms, rotaries and GELUs once took seconds), while
# these kernels take ~50 us for 2^18 elements on one thread.
_PARALLEL_MIN_ELEMENTS = 1 << 18


def _threads(numel: int) -> int:
    return kernel_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1


class TorchOpsAlone:
    """For the life of a `with` block, torch's own ops on the calling thread while these kernels keep the threads
    torch had: for steps whose heavy work is all here (a small prompt through GGML forms), where torch's remaining
    ops take microseconds each and each OpenMP region can cost milliseconds on a machine whose other processes
    preempt its threads. The hold owns the lent count and gives it back on exit; one opened where torch already
    runs on one thread, or inside another hold, changes nothing."""

    def __init__(self) -> None:
        self.threads: int | None = None  # torch's threads, lent to the kernels while this hold is open

    def __enter__(self) -> TorchOpsAlone:
        global _open_hold
        threads = torch.get_num_threads()
        if threads > 1 and _open_hold is None:
            self.threads, _open_hold = threads, self
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: object) -> None:
        global _open_hold
        if _open_hold is self:
            torch.set_num_threads(self.threads)
            self.threads, _open_hold = None, None


# The open hold, if any: kernels called deep in the layers find their thread count through it, as attention
# finds its metadata through the forward context.
_open_hold: TorchOpsAlone | None = None


def kernel_threads() -> int:
    """Threads for a kernel: those lent by the open TorchOpsAlone hold, else torch's."""
    return _open_hold.threads if _open_hold is not None else torch.get_num_threads()


def _fn(base: str, dtype: torch.dtype):
    return getattr(_library(), f"{base}_{_SUFFIX[dtype]}")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [seqs, heads, dim]; caches: [blocks, block_size, kv_heads, dim], contiguous. Returns fp32.
    `window`: each sequence attends to its last `window` keys only (None: all)."""
    seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q32 = q.float().contiguous()
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty(seqs, heads, dim, dtype=torch.float32)
    _fn("paged_decode", k_cache.dtype)(
        out.data_ptr(), q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        seqs, heads, kv_heads, dim, block_size, tables.shape[1], window or 0, scale, kernel_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> torch.Tensor:
    """x, residual: [rows, hidden] contiguous; residual is updated in place to x + residual."""
    out = torch.empty_like(x)
    _fn("rms_norm", x.dtype)(out.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
                             weight.data_ptr(), x.shape[0], x.shape[1], eps, _threads(x.numel()))
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of fp32 rows [rows, cols] whose last dimension is dense (int64 [rows])."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _library().argmax_rows_f32(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0))
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """In place on x: [tokens, heads, head_dim] (dims 1, 2 dense; dim 0 may be strided); cos, sin fp32."""
    tokens, heads, head_dim = x.shape
    _fn("rotary", x.dtype)(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim, rot_dim,
                           x.stride(0), _threads(x.numel()))
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * width] = [gate | up] contiguous -> silu(gate) * up, [rows, width] (the decode stack's)."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype)
    _fn("silu_and_mul", x.dtype)(out.data_ptr(), x.data_ptr(), rows, width, _threads(x.numel()))
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * width] = [gate | up] contiguous -> gelu_tanh(gate) * up, [rows, width]."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype)
    _fn("gelu_tanh_and_mul", x.dtype)(out.data_ptr(), x.data_ptr(), rows, width, _threads(x.numel()))
    return out


def q4_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [tokens, cols] fp32 contiguous; qs, d, m: a matrix of `rows` rows in 8-row tiles, as
    quant.NibbleMatrix packs them. Returns x @ (q * d + m).T, fp32 [tokens, rows]."""
    tokens, cols = x.shape
    out = torch.empty(tokens, rows, dtype=torch.float32)
    _library().q4_matmul_f32(out.data_ptr(), x.data_ptr(), qs.data_ptr(), d.data_ptr(), m.data_ptr(),
                             tokens, rows, cols, torch.get_num_threads())
    return out


def panel_products() -> tuple[bool, bool]:
    """Which panel products (vnni_gemm.c) this build has: (4-bit: AVX-512 VNNI or AVX2, Q8_0: AVX-512 VNNI)."""
    if not available():
        return False, False
    bits = _library().vnni_gemm_available()
    return bool(bits & 1), bool(bits & 2)


def vnni_gemm(x: torch.Tensor, panel: torch.Tensor, d: torch.Tensor, m: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [tokens, cols] fp32 contiguous; panel, d, m: a 4-bit matrix of `rows` rows as quant.VnniPanel packs
    it. Returns x @ (q * d + m).T, fp32 [tokens, rows], with q4_matmul's bits."""
    tokens, cols = x.shape
    out = torch.empty(tokens, rows, dtype=torch.float32)
    _library().vnni_gemm_f32(out.data_ptr(), x.data_ptr(), tokens, cols, panel.data_ptr(), d.data_ptr(),
                             m.data_ptr(), rows, torch.get_num_threads())
    return out


def vnni_q8_gemm(x: torch.Tensor, panel: torch.Tensor, d: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [tokens, cols] fp32 contiguous; panel, d: a Q8_0 matrix as quant.Q8Panel packs it. Returns x @ (q * d).T,
    fp32 [tokens, rows], with ggml_q8_0_matmul's bits."""
    tokens, cols = x.shape
    out = torch.empty(tokens, rows, dtype=torch.float32)
    _library().vnni_q8_gemm_f32(out.data_ptr(), x.data_ptr(), tokens, cols, panel.data_ptr(), d.data_ptr(), rows,
                                torch.get_num_threads())
    return out


def decode_stack(x: torch.Tensor, layer_ptrs: torch.Tensor, final_norm: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 dims: torch.Tensor, eps: float, scale: float, taps: torch.Tensor | None = None,
                 tap_at: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step through every layer (decode_stack.c), in place on x: [tokens, hidden] fp32, the
    embedded tokens in, the final-normed hidden states out. layer_ptrs: int64 [layers, DECODE_LAYER_FIELDS];
    dims: int64 [DECODE_DIM_FIELDS]; slots, tables, lens: int64, one row per token (a verification's tokens are
    rows of one sequence, each attending up to itself).
    taps: fp32 [n, tokens, hidden], filled with the outputs of the layers tap_at (int64 [layers]) maps to
    0..n-1 (-1: not tapped)."""
    _library().decode_stack(x.data_ptr(), layer_ptrs.data_ptr(), layer_ptrs.shape[0], final_norm.data_ptr(),
                            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                            dims.data_ptr(), eps, scale, 0 if taps is None else taps.data_ptr(),
                            0 if tap_at is None else tap_at.data_ptr(), torch.get_num_threads())
    return x


def gemma3_decode_stack(x: torch.Tensor, layer_table: torch.Tensor, final_norm: torch.Tensor,
                        rope: tuple[torch.Tensor, ...], slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                        dims: torch.Tensor, eps: float, scale: float, ggml: bool = False) -> torch.Tensor:
    """One Gemma 3 decode step through every layer (gemma3_stack.c), in place on x: [tokens, hidden] fp32, the
    scaled embeddings in, the final-normed hidden states out. layer_table: int64 [layers, gemma3_layer_fields];
    rope: (cos, sin) of the local rope, then of the global one, fp32 [tokens, head_dim / 2] contiguous; the rest
    as decode_stack's; ggml: llama.cpp's arithmetic around the products (ggml_rms_norm, ggml_geglu, ggml_attention;
    an fp32 cache)."""
    _library().gemma3_decode_stack(x.data_ptr(), layer_table.data_ptr(), layer_table.shape[0], final_norm.data_ptr(),
                                   *(t.data_ptr() for t in rope), slots.data_ptr(), tables.data_ptr(),
                                   lens.data_ptr(), dims.data_ptr(), eps, scale, int(ggml), kernel_threads())
    return x


# --- llama.cpp's CPU arithmetic around the products (ggml_numerics.c), fp32 only ---


def ggml_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> torch.Tensor:
    """ggml's RMSNorm (the sum of squares in double) times weight; residual (if given) += x first, in place, and
    normed instead. x: [rows, hidden] contiguous fp32."""
    out = torch.empty_like(x)
    _library().ggml_rms_norm_f32(out.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
                                 weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, 1)
    return out


def ggml_geglu(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * width] = [gate | up] contiguous fp32 -> GELU from ggml's fp16 table of gate, times up."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, width)
    _library().ggml_geglu_f32(out.data_ptr(), x.data_ptr(), rows, width, 1)
    return out


def ggml_rope_tables(positions: int, half: int, base: float, freq_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's rope tables (no YaRN): cos, sin fp32 [positions, half], theta stepped by powf(base, -1 / half) in
    float, cosf and sinf of it."""
    cos, sin = torch.empty(positions, half), torch.empty(positions, half)
    _library().ggml_rope_tables(cos.data_ptr(), sin.data_ptr(), positions, half, base, freq_scale)
    return cos, sin


@contextmanager
def ggml_q4_k_gemm_rows(flags: torch.Tensor | None):
    """While open, the Q4_K products' token t takes llama.cpp's 4-row gemm order where flags[t] (int64 [tokens],
    contiguous; None: every token its gemv order)."""
    _library().ggml_set_q4_k_gemm_rows(None if flags is None else flags.data_ptr())
    try:
        yield
    finally:
        _library().ggml_set_q4_k_gemm_rows(None)


def ggml_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ggml's NeoX rope in place over x [tokens, heads, head_dim] fp32 contiguous (every dim rotated)."""
    _library().ggml_rotary_f32(x.data_ptr(), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), x.shape[0],
                               x.shape[1], x.shape[2], x.shape[2], x.shape[1] * x.shape[2], 1)
    return x


def ggml_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   lens: torch.Tensor, gemm: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Attention as llama.cpp's CPU backend computes it (fp16 keys, values, queries and probabilities, ggml's
    summation orders), one query token a row: q [rows, heads, dim] fp32; k_cache, v_cache [blocks, block_size,
    kv_heads, dim] fp32 holding fp16 values; tables [rows, max_blocks], lens [rows] (the row's context, itself
    included), gemm [rows] (1: the token came in a batch of two or more), all int64 -> [rows, heads, dim]."""
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    _library().ggml_attention_f32(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                  tables.data_ptr(), lens.data_ptr(), gemm.data_ptr(), rows, heads, k_cache.shape[2],
                                  dim, k_cache.shape[1], tables.shape[1], window or 0, scale,
                                  kernel_threads() if rows > 1 else 1)
    return out


# --- GGML-quantized weights (ggml_ops.c): activations rounded per block as llama.cpp's CPU backend does ---


def ggml_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [tokens, cols] fp32 -> (q int8 [tokens, cols], d fp32 [tokens, cols // block], sums int32): llama.cpp's
    Q8_0 (block 32; sums per 32) or Q8_K (block 256; sums per 16) rounding of activations."""
    x = x.float().contiguous()
    tokens, cols = x.shape
    q = torch.empty(tokens, cols, dtype=torch.int8)
    d = torch.empty(tokens, cols // block, dtype=torch.float32)
    sums = torch.empty(tokens, cols // 32 if block == 32 else cols // 16, dtype=torch.int32)
    fn = _library().ggml_quantize_q8_0 if block == 32 else _library().ggml_quantize_q8_k
    fn(q.data_ptr(), d.data_ptr(), sums.data_ptr(), x.data_ptr(), tokens, cols)
    return q, d, sums


def _ggml_call(name: str, x: torch.Tensor, rows: int, *weights: torch.Tensor | None) -> torch.Tensor:
    """x: [tokens, cols] fp32 contiguous; weights: the layout's arrays (ggml_ops.c), contiguous."""
    tokens, cols = x.shape
    out = torch.empty(tokens, rows, dtype=torch.float32)
    ptrs = [None if w is None else w.data_ptr() for w in weights]
    getattr(_library(), name)(out.data_ptr(), x.data_ptr(), *ptrs, tokens, rows, cols, kernel_threads())
    return out


def ggml_matrix_matmul(x: torch.Tensor, matrix: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [tokens, cols] fp32 contiguous; matrix: int64, a csrc/ggml_matrix.h description of `rows` rows."""
    tokens, cols = x.shape
    out = torch.empty(tokens, rows, dtype=torch.float32)
    _library().ggml_matrix_matmul_f32(out.data_ptr(), x.data_ptr(), matrix.data_ptr(), tokens, cols,
                                      kernel_threads())
    return out


def ggml_q8_0_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return _ggml_call("ggml_q8_0_matmul_f32", x, qs.shape[0], qs, d)


def ggml_q8_0_blocks_matmul(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """blocks: uint8 [rows, cols // 32 * 34], GGUF's Q8_0 blocks (fp16 scale, then 32 codes)."""
    return _ggml_call("ggml_q8_0_blocks_matmul_f32", x, blocks.shape[0], blocks)


def ggml_q5_0_matmul(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return _ggml_call("ggml_q5_0_matmul_f32", x, qs.shape[0], qs, qh, d)


def ggml_k4_matmul(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor | None, sc: torch.Tensor, mn: torch.Tensor,
                   d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """Q4_K (qh None) or Q5_K."""
    return _ggml_call("ggml_k4_matmul_f32", x, qs.shape[0], qs, qh, sc, mn, d, dmin)


def ggml_q6_k_matmul(x: torch.Tensor, ql: torch.Tensor, qh: torch.Tensor, sc: torch.Tensor,
                     d: torch.Tensor) -> torch.Tensor:
    return _ggml_call("ggml_q6_k_matmul_f32", x, ql.shape[0], ql, qh, sc, d)


# --- the recurrent layers' token loops (recurrent.c): fp32 state pools, activations fp32 or bf16 ---

RECURRENT_MAX_DIM = 256  # recurrent.c's MAX_DIM: d_state, d_k and d_v up to this


def recurrent_fits(states: torch.Tensor, buffered_dims: int, *tensors: torch.Tensor) -> bool:
    """True when recurrent.c can take these: an fp32 contiguous state pool whose last `buffered_dims` dims fit its
    buffers, and CPU tensors of its dtypes."""
    return (states.dtype == torch.float32 and states.is_contiguous()
            and max(states.shape[-buffered_dims:]) <= RECURRENT_MAX_DIM and supports(states, *tensors))


def _unit_inner(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype with a unit stride in its last dim (a copy when needed); its other strides go to the kernel."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t
    return t.float().contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _strides(*tensors: torch.Tensor) -> ctypes.Array:
    """The row (and head, for 3-d tensors) strides of each, in elements, as one int64 array."""
    values = [s for t in tensors for s in t.stride()[:-1]]
    return (ctypes.c_int64 * len(values))(*values)


def _index(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def _slots_checked(status: int) -> None:
    if status != 0:
        raise IndexError("recurrent kernel: a slot lies outside the state pool")


def mamba1_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba1's selective scan with ssm.selective_scan_varlen's contract: x, dt, z [tokens, d_inner], B, C [tokens,
    d_state]; sequence i (tokens cu_seqlens[i]..cu_seqlens[i+1]; cu_seqlens None: token i alone, the one-token
    step) runs on from states[slots[i]] (fp32 [num_slots, d_inner, d_state], contiguous) and leaves its state there;
    a negative slot is padding (zero output). Returns y [tokens, d_inner] in x's dtype."""
    tokens, d_inner = x.shape
    d_state = states.shape[-1]
    # every tensor whose pointer goes to C is held by a name until the call returns
    x, dt, B, C = (_unit_inner(t, x.dtype) for t in (x, dt, B, C))
    z = None if z is None else _unit_inner(z, x.dtype)
    A, D, dt_bias = _f32(A), _f32(D), _f32(dt_bias)
    slots, cu = _index(slots), None if cu_seqlens is None else _index(cu_seqlens)
    y = torch.zeros(tokens, d_inner, dtype=x.dtype)
    _slots_checked(_library().mamba1_scan(
        y.data_ptr(), x.data_ptr(), dt.data_ptr(), _ptr(z), B.data_ptr(), C.data_ptr(),
        _strides(x, dt, x if z is None else z, B, C), A.data_ptr(), _ptr(D), _ptr(dt_bias), states.data_ptr(),
        _ptr(cu), slots.data_ptr(), slots.shape[0], states.shape[0], d_inner, d_state, int(x.dtype == torch.bfloat16),
        int(dt_softplus), _threads(tokens * d_inner * d_state)))
    return y


def ssd_step(states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
             dt_softplus: bool, dt_limit: tuple[float, float]) -> torch.Tensor:
    """Mamba2's one-token step with ssm.ssd_state_update_pool's contract: x [rows, heads, head_dim], dt [rows,
    heads], B, C [rows, n_groups, d_state]; states fp32 [num_slots, heads, head_dim, d_state] contiguous, stepped
    in place at slots (negative: padding, zero output). Returns y [rows, heads, head_dim] in x's dtype."""
    rows, heads, head_dim = x.shape
    x, dt, B, C = (_unit_inner(t, x.dtype) for t in (x, dt, B, C))
    A, D, dt_bias, slots = _f32(A), _f32(D), _f32(dt_bias), _index(slots)
    y = torch.zeros(rows, heads, head_dim, dtype=x.dtype)
    _slots_checked(_library().ssd_step(
        y.data_ptr(), x.data_ptr(), dt.data_ptr(), B.data_ptr(), C.data_ptr(), _strides(x, dt, B, C), A.data_ptr(),
        _ptr(D), _ptr(dt_bias), states.data_ptr(), slots.data_ptr(), rows, states.shape[0], heads, head_dim,
        states.shape[-1], B.shape[1], float(dt_limit[0]), float(dt_limit[1]), int(x.dtype == torch.bfloat16),
        int(dt_softplus), _threads(rows * heads * head_dim * states.shape[-1])))
    return y


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor, slots: torch.Tensor | None, normalize_qk: bool, scale: float) -> torch.Tensor:
    """The gated delta rule's one-token step (kernels/delta_rule.py): q, k [rows, H_k, d_k], v [rows, H_v, d_v],
    g [rows, H_v] (GDN) or [rows, H_v, d_k] (KDA), beta [rows, H_v]; row n's state, states[slots[n]] (slots None:
    states[n]; fp32 [num_slots, H_v, d_k, d_v] contiguous), is advanced in place (negative slot: padding, zero
    output). q, k are L2-normalized if asked, then q scaled by scale. Returns o [rows, H_v, d_v] in v's dtype."""
    rows, key_heads, d_k = k.shape
    heads, d_v = v.shape[-2:]
    q, k, v = (_unit_inner(t, v.dtype) for t in (q, k, v))
    scalar_gate = g.dim() == 2
    g, beta, slots = _f32(g), _f32(beta), None if slots is None else _index(slots)
    o = torch.zeros(rows, heads, d_v, dtype=v.dtype)
    _slots_checked(_library().delta_rule_step(
        o.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), _strides(q, k, v), g.data_ptr(), beta.data_ptr(),
        states.data_ptr(), _ptr(slots), rows, states.shape[0], heads, key_heads, d_k, d_v, scale,
        int(v.dtype == torch.bfloat16), int(scalar_gate), int(normalize_qk), _threads(rows * heads * d_k * d_v)))
    return o
