"""CPU tiers: read from the feature flags, lowered by the settings that force them, and each tier's
dtype, oneDNN and C-kernel choices. The tier is forced here; CI's second pass runs on a forced AVX2."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pressroom.config import resolve_dtype
from pressroom.kernels import cpu as cpu_kernels
from pressroom.model.layers.linear import ColumnParallelLinear
from pressroom.platforms import cpu
from pressroom.platforms.cpu import CpuIsa, make_info

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize("flags, tier", [(frozenset(), CpuIsa.GENERIC), (frozenset({"avx", "avx2"}), CpuIsa.GENERIC),
                                         (AVX2, CpuIsa.AVX2), (AVX512, CpuIsa.AVX512),
                                         (AVX512_BF16, CpuIsa.AVX512_BF16), (AMX, CpuIsa.AMX),
                                         (AVX2 | {"avx512_bf16"}, CpuIsa.AVX2)])
def test_tier_follows_the_flags(flags, tier):
    assert cpu.tier_of(flags) == tier


@pytest.mark.parametrize("tier, dtype, native", [(CpuIsa.AVX2, torch.float32, False),
                                                 (CpuIsa.AVX512, torch.float32, False),
                                                 (CpuIsa.AVX512_BF16, torch.bfloat16, True),
                                                 (CpuIsa.AMX, torch.bfloat16, True)])
def test_default_dtype_per_tier(tier, dtype, native):
    info = make_info("test", AMX, {"PRESSROOM_CPU_ISA": tier.name.lower()}, "AVX512")
    assert info.isa == tier and info.native_bf16 == native and info.default_dtype() == dtype
    assert info.dtype_reason()


def test_settings_lower_the_tier_and_never_raise_it():
    assert make_info("x", AMX, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "AVX512").isa == CpuIsa.AVX2
    assert make_info("x", AMX, {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "AVX512").isa == CpuIsa.AVX512
    assert make_info("x", AMX, {}, "AVX2").isa == CpuIsa.AVX2  # ATEN_CPU_CAPABILITY=avx2
    raised = make_info("x", AVX2, {"PRESSROOM_CPU_ISA": "amx"}, "AVX2")
    assert raised.isa == CpuIsa.AVX2 and raised.capped_by == ()
    lowered = make_info("x", AMX, {"PRESSROOM_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "AVX512")
    assert lowered.isa == CpuIsa.AVX2 and lowered.capped_by == ("PRESSROOM_CPU_ISA", "ONEDNN_MAX_CPU_ISA")
    assert "capped from AMX" in lowered.describe()


def test_a_bad_forced_tier_is_a_clear_error():
    with pytest.raises(ValueError, match="avx2, avx512"):
        make_info("x", AMX, {"PRESSROOM_CPU_ISA": "sse9"}, "AVX512")


@pytest.mark.skipif(cpu.platform.machine() != "x86_64", reason="x86 -march flags")
def test_kernel_flags_per_tier():
    assert make_info("x", AMX, {}, "AVX512").kernel_flags() == ["-march=native"]
    assert make_info("x", AMX, {"PRESSROOM_CPU_ISA": "avx2"}, "AVX512").kernel_flags() == ["-march=x86-64-v3"]
    assert make_info("x", AMX, {"PRESSROOM_CPU_ISA": "avx512"}, "AVX512").kernel_flags() == ["-march=x86-64-v4"]


def test_build_key_changes_with_anything_that_changes_the_code():
    base = (b"int f;", ["-O3", "-march=native"], "gcc 12.2", AVX512_BF16)
    key = cpu_kernels.build_key(*base)
    assert key == cpu_kernels.build_key(*base)
    assert key != cpu_kernels.build_key(b"int g;", *base[1:])
    assert key != cpu_kernels.build_key(base[0], ["-O3", "-march=x86-64-v3"], *base[2:])
    assert key != cpu_kernels.build_key(*base[:2], "gcc 13.1", base[3])
    assert key != cpu_kernels.build_key(*base[:3], AVX2)  # same flags, another CPU: -march=native differs


@pytest.fixture
def forced(monkeypatch):
    """Force a tier for this process (cpu_info() is cached: clear it before and after)."""
    def force(tier: str) -> None:
        monkeypatch.setenv("PRESSROOM_CPU_ISA", tier)
        cpu.cpu_info.cache_clear()
    yield force
    monkeypatch.delenv("PRESSROOM_CPU_ISA", raising=False)
    cpu.cpu_info.cache_clear()


def test_auto_dtype_follows_the_forced_tier(forced):
    forced("avx2")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # asked for: kept (slow, not wrong)
    forced("avx512_bf16")  # what the CPU and the other caps (CI's AVX2 pass) allow of it
    native = cpu.cpu_info().isa >= CpuIsa.AVX512_BF16
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def test_bf16_weights_skip_onednn_prepacking_below_avx512(forced):
    forced("avx2")
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = ColumnParallelLinear(64, 32)
    finally:
        torch.set_default_dtype(torch.float32)
    layer.weight.data.normal_()
    assert not layer.prepack_onednn() and layer.onednn is None
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.allclose(layer(x).float(), x.float() @ layer.weight.float().t(), atol=0.05, rtol=0.02)


@pytest.mark.slow  # CI's second pass (make test-avx2) serves the embedded model on the AVX2 path in every server test
def test_embedded_model_serves_on_a_forced_avx2_path(tmp_path):
    """A fresh process, as a user on an AVX2-only CPU gets it: fp32 (prepacked for oneDNN), no oneDNN bf16,
    C kernels for AVX2."""
    code = ("from pressroom import LLM, SamplingParams\n"
            "from pressroom.platforms.cpu import cpu_info\n"
            "llm = LLM(kv_cache_memory_gib=0.05)\n"
            "lin = llm.engine.model.model.layers[0].mlp.gate_up_proj\n"
            "out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=8))\n"
            "print(cpu_info().isa.name, llm.engine.config.model.dtype, lin.onednn is not None, lin.int4 is not None,\n"
            "      len(out[0].outputs[0].token_ids))\n")
    env = {"PRESSROOM_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PRESSROOM_CACHE": str(tmp_path),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["AVX2", "torch.float32", "True", "True", "8"]
    assert "dtype float32 (auto: no AVX-512" in r.stderr
    if cpu_kernels.available():  # the kernels were built for the forced tier, into the given cache
        # -march for the AVX2 tier: x86-64-v3 on a host with more, native on an AVX2-only host.
        march = "-march=native" if cpu.cpu_info().detected == CpuIsa.AVX2 else "-march=x86-64-v3"
        assert f"built the C kernels for AVX2 ({march})" in r.stderr
        assert list(tmp_path.glob("kernels/pressroom_ops-*.so"))
