"""The recurrent layers' C kernels (kernels/csrc/recurrent.c) against their torch references in kernels/ssm.py and
kernels/delta_rule.py: Mamba1's packed scan and one-token step, Mamba2's one-token step and the gated delta rule's
one-token step (scalar and per-channel gates), on state pools with padding slots, fp32 tight and bf16 looser, with
the strided views the models pass. Each test also checks that the C kernel ran (a spy on its binding)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from pressroom.kernels import cpu, delta_rule, ssm
from pressroom.platforms.cpu import CpuIsa, cpu_info

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch path is all there is")

FP32 = dict(atol=2e-5, rtol=2e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)
DTYPES = [pytest.param(torch.float32, FP32, id="fp32"), pytest.param(torch.bfloat16, BF16, id="bf16")]


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of cpu.<name> (the dispatch must reach the C kernel, not fall back)."""
    calls, real = [], getattr(cpu, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, name, counted)
    return calls


def _reference(monkeypatch: pytest.MonkeyPatch, fn: Callable, *args, **kwargs):
    """fn on the torch path (the C kernels switched off for the call)."""
    with monkeypatch.context() as m:
        m.setattr(ssm, "CPU_KERNELS", False)
        m.setattr(delta_rule, "CPU_KERNELS", False)
        return fn(*args, **kwargs)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: dict) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def _columns(g: torch.Generator, tokens: int, widths: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Column slices of one packed [tokens, sum(widths)] tensor: strided rows, as the models' splits give."""
    packed = torch.randn(tokens, sum(widths), generator=g).to(dtype)
    return list(packed.split(widths, dim=-1))


# ---------------------------------------------------------------- Mamba1


def _mamba1_inputs(tokens: int, d_inner: int, d_state: int, dtype: torch.dtype, num_slots: int):
    g = torch.Generator().manual_seed(tokens * 7 + d_inner)
    x, dt, z, B, C = _columns(g, tokens, [d_inner, d_inner, d_inner, d_state, d_state], dtype)
    A = -torch.exp(torch.rand(d_inner, d_state, generator=g) * 2.0)
    D, dt_bias = torch.randn(d_inner, generator=g), torch.randn(d_inner, generator=g) - 1.0
    states = torch.randn(num_slots, d_inner, d_state, generator=g)
    return x, dt, z, B, C, A, D, dt_bias, states


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("d_state", [16, 7])
def test_mamba1_scan_varlen_matches_reference(monkeypatch, dtype, tol, d_state):
    """Packed sequences of 5, 1 (padding), 0, 130 and 1 tokens; 150 channels: two full chunks of 64 and a tail
    block of 6 lanes. Padding tokens come out zero; the padding and unused slots keep their states."""
    lengths, slots = [5, 1, 0, 130, 1], torch.tensor([2, -1, 4, 0, 5])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x, dt, z, B, C, A, D, dt_bias, states = _mamba1_inputs(sum(lengths), 150, d_state, dtype, num_slots=7)
    expected_states = states.clone()
    expected = _reference(monkeypatch, ssm.selective_scan_varlen, x, dt, A, B, C, cu_seqlens, expected_states, slots,
                          D, z, dt_bias)
    calls = _spy(monkeypatch, "mamba1_scan")
    y = ssm.selective_scan_varlen(x, dt, A, B, C, cu_seqlens, states, slots, D, z, dt_bias)
    assert calls and y.dtype == dtype and y.shape == x.shape
    _close(y, expected, tol)
    assert not y[5:6].any()
    torch.testing.assert_close(states, expected_states, **FP32)
    assert torch.equal(states[[1, 3, 6]], expected_states[[1, 3, 6]])  # never touched: the inputs' values


def test_mamba1_scan_without_options_matches_reference(monkeypatch):
    """No D, no gate, no dt bias, no softplus (dt taken as it is)."""
    x, dt, _, B, C, A, _, _, states = _mamba1_inputs(40, 19, 16, torch.float32, num_slots=2)
    dt = dt.abs()
    cu_seqlens, slots = torch.tensor([0, 17, 40]), torch.tensor([1, 0])
    expected_states = states.clone()
    expected = _reference(monkeypatch, ssm.selective_scan_varlen, x, dt, A, B, C, cu_seqlens, expected_states, slots,
                          dt_softplus=False)
    y = ssm.selective_scan_varlen(x, dt, A, B, C, cu_seqlens, states, slots, dt_softplus=False)
    _close(y, expected, FP32)
    _close(states, expected_states, FP32)


def test_mamba1_small_time_steps_are_relatively_exact(monkeypatch):
    """dt = softplus(-18..-6) (trained Mamba dt runs to 1e-3 and below): from a zero state one step leaves
    dt B x, so the state shows dt's relative error, which an absolute tolerance on y would hide."""
    x, dt, z, B, C, A, D, _, _ = _mamba1_inputs(4, 40, 16, torch.float32, num_slots=4)
    dt = torch.linspace(-18, -6, 40).expand(4, 40)
    states, expected_states = torch.zeros(4, 40, 16), torch.zeros(4, 40, 16)
    _reference(monkeypatch, ssm.selective_state_update_pool, expected_states, torch.arange(4), x, dt, A, B, C, D, z)
    ssm.selective_state_update_pool(states, torch.arange(4), x, dt, A, B, C, D, z)
    torch.testing.assert_close(states, expected_states, atol=0.0, rtol=1e-5)


def test_mamba1_batched_scan_matches_reference(monkeypatch):
    """selective_scan's [batch, seqlen, ...] form, from a given state and from zeros."""
    x, dt, z, B, C, A, D, dt_bias, states = _mamba1_inputs(2 * 33, 21, 16, torch.float32, num_slots=2)
    args = [t.reshape(2, 33, -1) for t in (x, dt)] + [A] + [t.reshape(2, 33, -1) for t in (B, C)]
    for initial in (states, None):
        expected, expected_h = _reference(monkeypatch, ssm.selective_scan, *args, D, z.reshape(2, 33, -1), dt_bias,
                                          initial_state=initial)
        y, h = ssm.selective_scan(*args, D, z.reshape(2, 33, -1), dt_bias, initial_state=initial)
        _close(y, expected, FP32)
        _close(h, expected_h, FP32)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_mamba1_step_pool_matches_reference(monkeypatch, dtype, tol):
    """Five decode rows over 37 channels (two full lane blocks and a tail of 5), one of them padding."""
    slots = torch.tensor([3, 0, -1, 1, 4])
    x, dt, z, B, C, A, D, dt_bias, states = _mamba1_inputs(5, 37, 16, dtype, num_slots=5)
    expected_states = states.clone()
    expected = _reference(monkeypatch, ssm.selective_state_update_pool, expected_states, slots, x, dt, A, B, C, D, z,
                          dt_bias)
    calls = _spy(monkeypatch, "mamba1_scan")
    y = ssm.selective_state_update_pool(states, slots, x, dt, A, B, C, D, z, dt_bias)
    assert calls
    _close(y, expected, tol)
    assert not y[2].any()
    torch.testing.assert_close(states, expected_states, **FP32)
    assert torch.equal(states[2], expected_states[2])


# ---------------------------------------------------------------- Mamba2


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,head_dim,groups,d_state", [(6, 5, 3, 7), (16, 64, 2, 64)], ids=["odd", "threaded"])
def test_ssd_step_pool_matches_reference(monkeypatch, dtype, tol, heads, head_dim, groups, d_state):
    """Heads in groups (B and C shared), dt clamped, a padding row; x, B and C are views of one convolved [x | B | C]
    row as Mamba2's mixer splits it. Odd sizes, and a size that the helper threads share."""
    rows = 4
    g = torch.Generator().manual_seed(1)
    xBC, dt = _columns(g, rows, [heads * head_dim + 2 * groups * d_state, heads], dtype)
    x, B, C = xBC.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    x, B, C = x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (groups, d_state)), C.unflatten(-1, (groups, d_state))
    A = -torch.rand(heads, generator=g) * 3
    D, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    states, slots = torch.randn(5, heads, head_dim, d_state, generator=g), torch.tensor([4, -1, 0, 2])
    expected_states = states.clone()
    limit = (0.05, 1.5)
    expected = _reference(monkeypatch, ssm.ssd_state_update_pool, expected_states, slots, x, dt, A, B, C, D, dt_bias,
                          dt_limit=limit)
    calls = _spy(monkeypatch, "ssd_step")
    y = ssm.ssd_state_update_pool(states, slots, x, dt, A, B, C, D, dt_bias, dt_limit=limit)
    assert calls and y.dtype == dtype
    _close(y, expected, tol)
    assert not y[1].any()
    torch.testing.assert_close(states, expected_states, **FP32)
    assert torch.equal(states[[1, 3]], expected_states[[1, 3]])


def test_unpooled_steps_match_reference(monkeypatch):
    """selective_state_update and ssd_state_update (a state per row, as the whole-mixer forms call them)."""
    x, dt, z, B, C, A, D, dt_bias, states = _mamba1_inputs(3, 21, 16, torch.float32, num_slots=3)
    expected_states = states.clone()
    expected = _reference(monkeypatch, ssm.selective_state_update, expected_states, x, dt, A, B, C, D, z, dt_bias)
    _close(ssm.selective_state_update(states, x, dt, A, B, C, D, z, dt_bias), expected, FP32)
    _close(states, expected_states, FP32)
    g = torch.Generator().manual_seed(2)
    x, B, C = torch.randn(3, 4, 8, generator=g), torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    dt, A, states = torch.randn(3, 4, generator=g), -torch.rand(4, generator=g), torch.randn(3, 4, 8, 16, generator=g)
    expected_states = states.clone()
    expected = _reference(monkeypatch, ssm.ssd_state_update, expected_states, x, dt, A, B, C)
    _close(ssm.ssd_state_update(states, x, dt, A, B, C), expected, FP32)
    _close(states, expected_states, FP32)


# ---------------------------------------------------------------- gated delta rule


def _delta_inputs(rows: int, key_heads: int, heads: int, d_k: int, d_v: int, scalar_gate: bool, dtype: torch.dtype,
                  num_slots: int):
    """q, k, v views of one packed projection row (as Qwen3-Next's split gives), log-gates <= 0, beta in (0, 1)."""
    g = torch.Generator().manual_seed(d_k + heads)
    q, k, v = _columns(g, rows, [key_heads * d_k, key_heads * d_k, heads * d_v], dtype)
    q, k, v = q.unflatten(-1, (key_heads, d_k)), k.unflatten(-1, (key_heads, d_k)), v.unflatten(-1, (heads, d_v))
    gate = -torch.rand(rows, heads, *(() if scalar_gate else (d_k,)), generator=g)
    beta = torch.rand(rows, heads, generator=g).to(dtype)
    return q, k, v, gate, beta, torch.randn(num_slots, heads, d_k, d_v, generator=g)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("scalar_gate", [True, False], ids=["gdn", "kda"])
@pytest.mark.parametrize("key_heads,heads,d_k,d_v", [(2, 4, 24, 20), (4, 8, 128, 96)], ids=["odd", "threaded"])
def test_delta_rule_step_pool_matches_reference(monkeypatch, dtype, tol, scalar_gate, key_heads, heads, d_k, d_v):
    """Key heads shared by value heads; a padding row keeps its output zero and its slot's state. Odd sizes (d_v
    not a multiple of the column block), and a size that the helper threads share."""
    q, k, v, gate, beta, states = _delta_inputs(4, key_heads, heads, d_k, d_v, scalar_gate, dtype, num_slots=6)
    slots = torch.tensor([5, -1, 0, 3])
    expected_states = states.clone()
    expected = _reference(monkeypatch, delta_rule.recurrent_decode_step_pool, q, k, v, gate, beta, expected_states,
                          slots)
    calls = _spy(monkeypatch, "delta_rule_step")
    o = delta_rule.recurrent_decode_step_pool(q, k, v, gate, beta, states, slots)
    assert calls and o.dtype == dtype
    _close(o, expected, tol)
    assert not o[1].any()
    torch.testing.assert_close(states, expected_states, **FP32)
    assert torch.equal(states[[1, 2, 4]], expected_states[[1, 2, 4]])


@pytest.mark.parametrize("scalar_gate", [True, False], ids=["gdn", "kda"])
def test_delta_rule_decode_step_matches_reference(monkeypatch, scalar_gate):
    """The models' call: gathered states in, new states out (the input states left as they were), KDA's q and k
    as views of a [q | k | v] stack, no normalization and a given scale too."""
    q, k, v, gate, beta, states = _delta_inputs(3, 4, 4, 32, 32, scalar_gate, torch.float32, num_slots=3)
    before = states.clone()
    for options in ({}, {"normalize_qk": False, "scale": 0.3}):
        expected_o, expected_new = _reference(monkeypatch, delta_rule.recurrent_decode_step, q, k, v, gate, beta,
                                              states, **options)
        o, new = delta_rule.recurrent_decode_step(q, k, v, gate, beta, states, **options)
        _close(o, expected_o, FP32)
        _close(new, expected_new, FP32)
        assert torch.equal(states, before)


def test_slot_outside_the_pool_raises_and_changes_nothing():
    x, dt, z, B, C, A, D, dt_bias, states = _mamba1_inputs(2, 16, 16, torch.float32, num_slots=2)
    before = states.clone()
    with pytest.raises(IndexError):
        ssm.selective_state_update_pool(states, torch.tensor([0, 2]), x, dt, A, B, C, D, z, dt_bias)
    assert torch.equal(states, before)


@pytest.mark.skipif(cpu_info().detected < CpuIsa.AVX2 or bool(os.environ.get("PRESSROOM_CPU_ISA")),
                    reason="the other tiers: on an AVX2 CPU, from the top-level run only")
# the AVX2 tier: CI's second pass runs every kernel test on it; the plain-C tier is built by test_ggml_ops too
@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "generic"])
def test_other_tiers_builds(tier):
    """The same kernels built for AVX2 (CI's second pass) and as plain C, on a few of these tests."""
    env = {**os.environ, "PRESSROOM_CPU_ISA": tier}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
            "-k", "varlen_matches and 16-fp32 or step_pool and bf16 and not threaded"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "5 passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
