"""The Triton recurrent prefill kernels (chunked gated delta rule, Mamba2 SSD, Mamba1 selective scan, causal conv)
equal their torch references in pressroom.kernels over packed batches of mixed lengths with slot-indexed state
pools: nonzero initial states, a one-token sequence, lengths that are not a multiple of the chunk, an empty
sequence and padding (negative) slots. Run on the CPU by Triton's interpreter with tiny shapes (tests/conftest.py
sets TRITON_INTERPRET=1 where CUDA is absent)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.kernels import delta_rule as dr
from pressroom.kernels import ssm
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import delta_rule_chunk, ssm_prefill

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

# per sequence: (tokens, slot); -1 is a padding entry. One 64-token chunk and a token, one token, none (its slot's
# state stays), a partial chunk, padding, a whole chunk
LENGTHS_SLOTS = [(65, 5), (1, 0), (0, 2), (20, 3), (3, -1), (64, 6)]
# the same kinds for Mamba1, whose kernel scans blocks of 16 tokens (and is slow in the interpreter)
SHORT_LENGTHS_SLOTS = [(17, 5), (1, 0), (0, 2), (35, 3), (3, -1), (16, 6)]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def _packing(spec: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([n for n, _ in spec])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    return cu.to(DEVICE), torch.tensor([s for _, s in spec], dtype=torch.int32, device=DEVICE)


def _delta_inputs(tokens: int, h_k: int, h_v: int, d_k: int, d_v: int, per_channel: bool, dtype: torch.dtype,
                  num_slots: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v as strided views of one fused projection (as a layer splits its in_proj), gates, states."""
    gen = torch.Generator().manual_seed(seed)
    gate_shape = (tokens, h_v, d_k) if per_channel else (tokens, h_v)
    qkv = torch.randn(tokens, 2 * h_k * d_k + h_v * d_v, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([h_k * d_k, h_k * d_k, h_v * d_v], dim=-1)
    x = {"q": q.unflatten(-1, (h_k, d_k)), "k": k.unflatten(-1, (h_k, d_k)), "v": v.unflatten(-1, (h_v, d_v)),
         "g": F.logsigmoid(torch.randn(gate_shape, generator=gen) + 2.0).to(dtype).to(DEVICE),
         "beta": torch.rand(tokens, h_v, generator=gen).to(dtype).to(DEVICE)}
    x["states"] = (torch.randn(num_slots, h_v, d_k, d_v, generator=gen) * 0.5).to(DEVICE)
    return x


def _delta_reference(x: dict[str, torch.Tensor], cu: torch.Tensor, slots: torch.Tensor,
                     **options) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch chunked form on the live sequences, their outputs scattered back and states written to a copy of
    the pool; padding sequences' tokens zero."""
    bounds, slot_ids = cu.tolist(), slots.tolist()
    out = torch.zeros_like(x["v"])
    pool = x["states"].clone()
    live = [i for i, s in enumerate(slot_ids) if s >= 0]
    tokens = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in live]).to(DEVICE)
    lengths = torch.tensor([bounds[i + 1] - bounds[i] for i in live])
    live_cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(DEVICE)
    picked = torch.tensor([slot_ids[i] for i in live], device=DEVICE)
    o, final = dr.chunk_gated_delta_rule(x["q"][tokens], x["k"][tokens], x["v"][tokens], x["g"][tokens],
                                         x["beta"][tokens], initial_state=pool[picked], cu_seqlens=live_cu,
                                         **options)
    out[tokens] = o
    pool[picked] = final.to(pool.dtype)
    return out, pool


# bf16 under the interpreter only with test-slow (the suite's time); the GPU tests run it at real shapes
BF16_SLOW = pytest.param(torch.bfloat16, marks=pytest.mark.slow)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16_SLOW])
def test_chunk_delta_rule_varlen_equals_torch(per_channel: bool, dtype: torch.dtype) -> None:
    cu, slots = _packing(LENGTHS_SLOTS)
    x = _delta_inputs(int(cu[-1]), h_k=1, h_v=2, d_k=16, d_v=32, per_channel=per_channel, dtype=dtype, num_slots=8)
    expected_out, expected_pool = _delta_reference(x, cu, slots)
    pool = x.pop("states")
    out = delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=cu, states=pool, slots=slots)
    assert out.dtype == dtype
    _close(out, expected_out, TOL[dtype])
    _close(pool, expected_pool, TOL[torch.float32] if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunk_delta_rule_varlen_strong_decay(per_channel: bool) -> None:
    """Log-gates down to -30 a token: cumulative gates of -1000 within a chunk, whose exponents must be taken as
    differences of nearby rows only (and masked before exp), or they overflow into NaNs."""
    cu, slots = _packing(LENGTHS_SLOTS)
    x = _delta_inputs(int(cu[-1]), h_k=1, h_v=1, d_k=16, d_v=16, per_channel=per_channel, dtype=torch.float32,
                      num_slots=8)
    # a generator of its own: the global one's state depends on which tests ran before
    x["g"] = -30.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(30)).to(DEVICE)
    expected_out, expected_pool = _delta_reference(x, cu, slots)
    pool = x.pop("states")
    out = delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=cu, states=pool, slots=slots)
    _close(out, expected_out, 3e-5)  # fp32 sums over a chunk round at ~1e-5; an overflow is a NaN
    _close(pool, expected_pool, 3e-5)


def test_chunk_delta_rule_varlen_without_normalization() -> None:
    """normalize_qk=False and a given scale: q and k are used as they come (here unit rows, so the rule is stable)."""
    cu, slots = _packing(LENGTHS_SLOTS)
    x = _delta_inputs(int(cu[-1]), h_k=1, h_v=1, d_k=16, d_v=16, per_channel=False, dtype=torch.float32,
                      num_slots=8)
    x["q"], x["k"] = dr.l2normalize(x["q"]) * 1.5, dr.l2normalize(x["k"])
    options = dict(normalize_qk=False, scale=0.3)
    expected_out, expected_pool = _delta_reference(x, cu, slots, **options)
    pool = x.pop("states")
    out = delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=cu, states=pool, slots=slots, **options)
    _close(out, expected_out, TOL[torch.float32])
    _close(pool, expected_pool, TOL[torch.float32])


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


@pytest.mark.parametrize("dtype", [torch.float32, BF16_SLOW])
@pytest.mark.parametrize("width,has_bias", [(4, True), (2, False)])
def test_causal_conv1d_varlen_equals_torch(dtype: torch.dtype, width: int, has_bias: bool) -> None:
    cu, slots = _packing(LENGTHS_SLOTS + [(2, 7)])  # a sequence shorter than the conv state
    gen = torch.Generator().manual_seed(1)
    channels = 24
    x = _randn(gen, int(cu[-1]), channels + 5).to(dtype).to(DEVICE)[:, 5:]  # a view, as a split of in_proj's output
    weight = _randn(gen, channels, width, scale=0.5).to(dtype).to(DEVICE)
    bias = _randn(gen, channels).to(dtype).to(DEVICE) if has_bias else None
    pool = _randn(gen, 9, channels, width - 1).to(dtype).to(DEVICE)
    expected_pool = pool.clone()
    expected = ssm.causal_conv1d_varlen(x, cu, weight, bias, expected_pool, slots)
    y = ssm_prefill.causal_conv1d_varlen(x, cu, weight, bias, pool, slots)
    _close(y, expected, TOL[dtype])
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)  # the state is the inputs themselves


def _selective_inputs(tokens: int, d_inner: int, d_state: int, dtype: torch.dtype, num_slots: int,
                      seed: int = 2) -> dict[str, torch.Tensor]:
    """x, z and B, C as strided views of fused projections (Mamba1's in_proj and x_proj outputs)."""
    gen = torch.Generator().manual_seed(seed)
    x, z = _randn(gen, tokens, 2 * d_inner).to(dtype).to(DEVICE).chunk(2, dim=-1)
    _, B, C = _randn(gen, tokens, 3 + 2 * d_state).to(dtype).to(DEVICE).split([3, d_state, d_state], dim=-1)
    a = {"x": x, "z": z, "B": B, "C": C, "dt": (_randn(gen, tokens, d_inner, scale=0.5) - 1.0).to(dtype).to(DEVICE)}
    a["A"] = -torch.exp(torch.log(torch.arange(1, d_state + 1.0)).repeat(d_inner, 1)).to(DEVICE)
    a["D"] = _randn(gen, d_inner).to(DEVICE)
    a["dt_bias"] = _randn(gen, d_inner, scale=0.1).to(DEVICE)
    a["states"] = _randn(gen, num_slots, d_inner, d_state).to(DEVICE)
    return a


@pytest.mark.parametrize("dtype,gated", [(torch.float32, True), (torch.float32, False),
                                         pytest.param(torch.bfloat16, True, marks=pytest.mark.slow)])
def test_selective_scan_varlen_equals_torch(dtype: torch.dtype, gated: bool) -> None:
    cu, slots = _packing(SHORT_LENGTHS_SLOTS)
    a = _selective_inputs(int(cu[-1]), d_inner=12, d_state=8, dtype=dtype, num_slots=8)
    if not gated:
        del a["z"], a["D"], a["dt_bias"]
    pool = a.pop("states")
    expected_pool = pool.clone()
    expected = ssm.selective_scan_varlen(cu_seqlens=cu, states=expected_pool, slots=slots, **a)
    y = ssm_prefill.selective_scan_varlen(cu_seqlens=cu, states=pool, slots=slots, **a)
    _close(y, expected, 1e-4 if dtype == torch.float32 else TOL[dtype])
    _close(pool, expected_pool, 1e-4)


def _ssd_inputs(tokens: int, heads: int, head_dim: int, groups: int, d_state: int, dtype: torch.dtype,
                num_slots: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """x, B, C as strided views of the conv's output xBC and dt of the in_proj output, as Mamba2 splits them."""
    gen = torch.Generator().manual_seed(seed)
    xBC = _randn(gen, tokens, heads * head_dim + 2 * groups * d_state).to(dtype).to(DEVICE)
    x, B, C = xBC.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    dt = (_randn(gen, tokens, 2 * heads, scale=0.5) - 2.0).to(dtype).to(DEVICE)[:, heads:]
    a = {"x": x.unflatten(-1, (heads, head_dim)), "dt": dt, "B": B.unflatten(-1, (groups, d_state)),
         "C": C.unflatten(-1, (groups, d_state))}
    a["A"] = -torch.arange(1, heads + 1.0).to(DEVICE)  # Mamba2's init: A_log = log(1..16)
    a["D"] = _randn(gen, heads).to(DEVICE)
    a["dt_bias"] = _randn(gen, heads, scale=0.1).to(DEVICE)
    a["states"] = _randn(gen, num_slots, heads, head_dim, d_state).to(DEVICE)
    return a


@pytest.mark.parametrize("dtype,dt_limit", [(torch.float32, ssm.DT_LIMIT), (torch.float32, (0.05, 0.5)),
                                             (torch.bfloat16, ssm.DT_LIMIT)])
def test_ssd_varlen_equals_torch(dtype: torch.dtype, dt_limit: tuple[float, float]) -> None:
    cu, slots = _packing(LENGTHS_SLOTS + [(150, 1)])
    a = _ssd_inputs(int(cu[-1]), heads=4, head_dim=8, groups=2, d_state=16, dtype=dtype, num_slots=8)
    pool = a.pop("states")
    expected_pool = pool.clone()
    expected = ssm.ssd_varlen(cu_seqlens=cu, states=expected_pool, slots=slots, dt_limit=dt_limit, **a)
    y = ssm_prefill.ssd_varlen(cu_seqlens=cu, states=pool, slots=slots, dt_limit=dt_limit, **a)
    _close(y, expected, 1e-4 if dtype == torch.float32 else TOL[dtype])
    _close(pool, expected_pool, 1e-4)
