"""What this CPU can run, read once from its feature flags: never learnt by trying and crashing.

Three x86 tiers matter to the CPU backend:
- AVX-512 with BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids and later; AMX on the last): bf16 is
  native, so the default dtype is bf16 with weights prepacked for oneDNN.
- AVX-512 without BF16 (Skylake-SP to Ice Lake): oneDNN can store bf16 but converts every element
  to fp32 first; fp32 is the default.
- AVX2 only (Zen 1-3, client Intel cores): oneDNN has no bf16 path at all; fp32 is the default.
Everywhere, 4-bit GGUF matrices stay 4-bit for decode-sized steps (torch's int4 kernel has AVX2
and AVX-512 code).

The tier can be lowered, never raised: `PRESSROOM_CPU_ISA` (avx2, avx512, avx512_bf16, amx) forces
one for tests and for CI's second pass, and oneDNN's own `ONEDNN_MAX_CPU_ISA` and torch's
`ATEN_CPU_CAPABILITY` cap it too, since those libraries obey them.
"""
from __future__ import annotations

import enum
import logging
import os
import platform
from dataclasses import dataclass
from functools import cache

import torch

logger = logging.getLogger("pressroom")


class CpuIsa(enum.IntEnum):
    GENERIC = 0  # not x86, or x86 without AVX2: the compiler's and torch's defaults
    AVX2 = 1  # AVX2 + FMA + F16C
    AVX512 = 2  # AVX-512 F, BW, VL, DQ
    AVX512_BF16 = 3  # + AVX512-BF16: bf16 dot products in hardware
    AMX = 4  # + AMX-BF16 tiles


_NEEDS = {  # /proc/cpuinfo flags each tier needs on top of the one below it
    CpuIsa.AVX2: {"avx2", "fma", "f16c"},
    CpuIsa.AVX512: {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    CpuIsa.AVX512_BF16: {"avx512_bf16"},
    CpuIsa.AMX: {"amx_bf16", "amx_tile"},
}
FORCE_ENV = "PRESSROOM_CPU_ISA"
_BY_NAME = {isa.name.lower(): isa for isa in CpuIsa}
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA), mapped to the highest tier they allow.
_ONEDNN_CAP = {
    "SSE41": CpuIsa.GENERIC, "AVX": CpuIsa.GENERIC, "AVX2": CpuIsa.AVX2, "AVX2_VNNI": CpuIsa.AVX2,
    "AVX2_VNNI_2": CpuIsa.AVX2, "AVX512_CORE": CpuIsa.AVX512, "AVX512_CORE_VNNI": CpuIsa.AVX512,
    "AVX512_CORE_BF16": CpuIsa.AVX512_BF16, "AVX512_CORE_FP16": CpuIsa.AVX512_BF16,
    "AVX10_1_512": CpuIsa.AVX512_BF16, "AVX512_CORE_AMX": CpuIsa.AMX, "AVX512_CORE_AMX_FP16": CpuIsa.AMX,
}
# torch's ATEN_CPU_CAPABILITY / get_cpu_capability() names.
_ATEN_CAP = {"DEFAULT": CpuIsa.GENERIC, "AVX2": CpuIsa.AVX2, "AVX512": CpuIsa.AMX, "ZVECTOR": CpuIsa.GENERIC}
# Compiler flags for the C kernels at each tier: explicit targets, so a forced tier really
# builds code without the instructions above it.
_MARCH = {
    CpuIsa.GENERIC: [],
    CpuIsa.AVX2: ["-march=x86-64-v3"],
    CpuIsa.AVX512: ["-march=x86-64-v4"],
    CpuIsa.AVX512_BF16: ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    CpuIsa.AMX: ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
}


@dataclass(slots=True, frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    detected: CpuIsa  # what the flags allow
    isa: CpuIsa  # what pressroom uses: `detected`, lowered by the settings named in `capped_by`
    capped_by: tuple[str, ...] = ()

    @property
    def native_bf16(self) -> bool:
        return self.isa >= CpuIsa.AVX512_BF16

    @property
    def bf16_storage(self) -> bool:
        """oneDNN's bf16 matmul runs (natively, or converting on AVX-512 without BF16)."""
        return self.isa >= CpuIsa.AVX512

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.native_bf16 else torch.float32

    def dtype_reason(self) -> str:
        if self.native_bf16:
            return "the CPU multiplies bf16 natively (AVX512-BF16" + (", AMX)" if self.isa >= CpuIsa.AMX else ")")
        if self.isa >= CpuIsa.AVX512:
            return "no AVX512-BF16: bf16 would be converted to fp32 element by element, fp32 is faster"
        return "no AVX-512: oneDNN has no bf16 matmul here, fp32 is the fast correct path"

    def kernel_flags(self) -> list[str]:
        """-march for the C kernels: the host's own unless the tier was lowered (then the tier's)."""
        if platform.machine() not in ("x86_64", "AMD64"):
            return ["-mcpu=native"] if platform.machine() == "aarch64" else []
        if self.isa == self.detected:
            return ["-march=native"]
        return _MARCH[self.isa]

    def describe(self) -> str:
        cap = f", capped from {self.detected.name} by {', '.join(self.capped_by)}" if self.capped_by else ""
        return f"{self.model_name or platform.machine()}: {self.isa.name}{cap}"


def tier_of(flags: frozenset[str]) -> CpuIsa:
    isa = CpuIsa.GENERIC
    for tier in (CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_BF16, CpuIsa.AMX):
        if not _NEEDS[tier] <= flags:
            break
        isa = tier
    return isa


def parse_forced(value: str) -> CpuIsa:
    try:
        return _BY_NAME[value.strip().lower()]
    except KeyError:
        raise ValueError(f"{FORCE_ENV}={value!r} is not a CPU tier; use one of {', '.join(_BY_NAME)}.") from None


def caps(env: dict[str, str], aten_capability: str) -> list[tuple[str, CpuIsa]]:
    """Every setting that lowers the tier, with the tier it allows."""
    found = []
    if env.get(FORCE_ENV):
        found.append((FORCE_ENV, parse_forced(env[FORCE_ENV])))
    onednn = env.get("ONEDNN_MAX_CPU_ISA", env.get("DNNL_MAX_CPU_ISA", "")).upper()
    if onednn in _ONEDNN_CAP:
        found.append(("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAP[onednn]))
    if aten_capability.upper() in _ATEN_CAP:
        found.append(("ATEN_CPU_CAPABILITY", _ATEN_CAP[aten_capability.upper()]))
    return found


def make_info(model_name: str, flags: frozenset[str], env: dict[str, str], aten_capability: str) -> CpuInfo:
    detected = tier_of(flags)
    isa, capped_by = detected, []
    for name, limit in caps(env, aten_capability):
        if limit < isa:
            isa = limit
        if limit < detected:
            capped_by.append(name)
    return CpuInfo(model_name, flags, detected, isa, tuple(capped_by))


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


@cache
def cpu_info() -> CpuInfo:
    model, flags = _read_cpuinfo()
    return make_info(model, flags, dict(os.environ), torch.backends.cpu.get_cpu_capability())


def log_cpu_path(requested: str, dtype: torch.dtype) -> None:
    """One start-up line: which CPU path runs and why (or a warning when the asked dtype is slow here)."""
    info = cpu_info()
    if requested == "auto":
        logger.info("CPU %s; dtype %s (auto: %s)", info.describe(), _name(dtype), info.dtype_reason())
    elif dtype == torch.bfloat16 and not info.native_bf16:
        logger.warning("CPU %s; dtype bfloat16 as asked, but this CPU has no native bf16 (%s); "
                       "--dtype auto would pick float32", info.describe(), info.dtype_reason())
    else:
        logger.info("CPU %s; dtype %s (as asked)", info.describe(), _name(dtype))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
