"""The Triton recurrent prefill kernels on CUDA at real shapes against their torch references: the chunked gated
delta rule (Qwen3-Next's Gated DeltaNet: 16 key heads, 32 value heads; Kimi Linear's KDA: 32 heads; d_k = d_v =
128), Mamba2's SSD (128 heads x 64 x 128 state, 8 groups), Mamba1's selective scan (d_inner 5120, d_state 16) and
the causal conv (Mamba2's conv width 4 over x, B and C), over ~8k packed tokens of mixed lengths with slot-indexed
state pools: nonzero initial states, a one-token sequence, an empty one and a padding (negative) slot. And a prompt
prefilled over two calls through its slot equals one call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: recurrent prefill at real shapes")]

if torch.cuda.is_available():
    from pressroom.kernels import delta_rule as dr
    from pressroom.kernels import ssm
    from pressroom.kernels.triton import delta_rule_chunk, ssm_prefill

# per sequence: (tokens, slot), 8192 tokens in all; -1 is padding
LENGTHS_SLOTS = [(4000, 3), (1, 0), (1537, 9), (0, 4), (64, 1), (2000, 7), (90, -1), (500, 2)]
NUM_SLOTS = 12
DELTA_SHAPES = {"qwen3_next_gdn": (16, 32, 128, 128, False), "kimi_linear_kda": (32, 32, 128, 128, True)}
# fp32: exact fp32 dots on both sides, only the order of sums differs; bf16: TF32 dots in the kernels, fp32 in torch
TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def packing(spec: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([n for n, _ in spec])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).cuda()
    return cu, torch.tensor([s for _, s in spec], dtype=torch.int32).cuda()


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).cuda()


def delta_inputs(shape: str, tokens: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    h_k, h_v, d_k, d_v, per_channel = DELTA_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    gate_shape = (tokens, h_v, d_k) if per_channel else (tokens, h_v)
    x = {"q": randn(gen, tokens, h_k, d_k), "k": randn(gen, tokens, h_k, d_k), "v": randn(gen, tokens, h_v, d_v),
         "g": F.logsigmoid(randn(gen, *gate_shape) + 2.0), "beta": torch.rand(tokens, h_v, generator=gen).cuda()}
    x = {name: t.to(dtype) for name, t in x.items()}
    x["states"] = randn(gen, NUM_SLOTS, h_v, d_k, d_v, scale=0.1)
    return x


def delta_reference(x: dict[str, torch.Tensor], spec: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's chunked form on each live sequence from its slot: (outputs, zero on padding; the pool after)."""
    out = torch.zeros_like(x["v"])
    pool = x["states"].clone()
    start = 0
    for length, slot in spec:
        part = slice(start, start + length)
        start += length
        if slot < 0 or length == 0:
            continue
        o, final = dr.chunk_gated_delta_rule(x["q"][part], x["k"][part], x["v"][part], x["g"][part],
                                             x["beta"][part], initial_state=pool[slot:slot + 1])
        out[part] = o
        pool[slot] = final[0]
    return out, pool


@pytest.mark.parametrize("shape", DELTA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_delta_rule_varlen_equals_torch(shape: str, dtype: torch.dtype) -> None:
    cu, slots = packing(LENGTHS_SLOTS)
    x = delta_inputs(shape, int(cu[-1]), dtype)
    expected_out, expected_pool = delta_reference(x, LENGTHS_SLOTS)
    pool = x.pop("states")
    out = delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=cu, states=pool, slots=slots)
    close(out, expected_out, TOL[dtype])
    close(pool, expected_pool, TOL[dtype])


@pytest.mark.parametrize("shape", DELTA_SHAPES)
def test_chunk_delta_rule_varlen_with_model_gates(shape: str) -> None:
    """Gates as the models make them, g = -exp(A_log) softplus(a) with A_log = log(uniform(1, 16)): log-decays of
    several units a token (KDA's per channel), so cumulative gates of hundreds within a chunk."""
    cu, slots = packing(LENGTHS_SLOTS)
    x = delta_inputs(shape, int(cu[-1]), torch.float32)
    gen = torch.Generator().manual_seed(5)
    rates = torch.empty(x["g"].shape[1]).uniform_(1.0, 16.0, generator=gen).cuda()
    x["g"] = -rates.view(-1, *[1] * (x["g"].dim() - 2)) * F.softplus(randn(gen, *x["g"].shape))
    expected_out, expected_pool = delta_reference(x, LENGTHS_SLOTS)
    pool = x.pop("states")
    out = delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=cu, states=pool, slots=slots)
    assert not out.isnan().any()
    close(out, expected_out, TOL[torch.float32])
    close(pool, expected_pool, TOL[torch.float32])

@pytest.mark.parametrize("shape", DELTA_SHAPES)
def test_chunk_delta_rule_continues_through_its_slot(shape: str) -> None:
    """A 1000-token prompt prefilled as 600 then 400 tokens (the engine's chunked prefill) equals one pass."""
    x = delta_inputs(shape, 1000, torch.float32)
    pool = x.pop("states")
    whole_pool = pool.clone()
    slot = torch.tensor([5], dtype=torch.int32, device="cuda")
    whole = delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=packing([(1000, 5)])[0], states=whole_pool,
                                                     slots=slot)
    parts = [delta_rule_chunk.chunk_delta_rule_varlen(**{n: t[part] for n, t in x.items()},
                                                      cu_seqlens=packing([(len(range(1000)[part]), 5)])[0],
                                                      states=pool, slots=slot)
             for part in (slice(0, 600), slice(600, 1000))]
    close(torch.cat(parts), whole, TOL[torch.float32])
    close(pool, whole_pool, TOL[torch.float32])


def ssd_inputs(tokens: int, dtype: torch.dtype, heads: int = 128, head_dim: int = 64, groups: int = 8,
               d_state: int = 128, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = {"x": randn(gen, tokens, heads, head_dim), "dt": randn(gen, tokens, heads, scale=0.5) - 3.0,
         "B": randn(gen, tokens, groups, d_state), "C": randn(gen, tokens, groups, d_state)}
    a = {name: t.to(dtype) for name, t in a.items()}
    a["A"] = -torch.linspace(1.0, 16.0, heads).cuda()  # Mamba2's init: A_log = log(uniform(1, 16))
    a["D"] = randn(gen, heads)
    a["dt_bias"] = randn(gen, heads, scale=0.1)
    a["states"] = randn(gen, NUM_SLOTS, heads, head_dim, d_state, scale=0.1)
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_varlen_equals_torch(dtype: torch.dtype) -> None:
    cu, slots = packing(LENGTHS_SLOTS)
    a = ssd_inputs(int(cu[-1]), dtype)
    pool = a.pop("states")
    expected_pool = pool.clone()
    expected = ssm.ssd_varlen(cu_seqlens=cu, states=expected_pool, slots=slots, dt_limit=(0.0, 0.5), **a)
    y = ssm_prefill.ssd_varlen(cu_seqlens=cu, states=pool, slots=slots, dt_limit=(0.0, 0.5), **a)
    close(y, expected, TOL[dtype])
    close(pool, expected_pool, TOL[dtype])


def test_ssd_varlen_continues_through_its_slot() -> None:
    a = ssd_inputs(1000, torch.float32)
    pool = a.pop("states")
    whole_pool = pool.clone()
    slot = torch.tensor([5], dtype=torch.int32, device="cuda")
    per_token = ("x", "dt", "B", "C")
    whole = ssm_prefill.ssd_varlen(cu_seqlens=packing([(1000, 5)])[0], states=whole_pool, slots=slot, **a)
    parts = [ssm_prefill.ssd_varlen(**{n: t[part] if n in per_token else t for n, t in a.items()},
                                    cu_seqlens=packing([(len(range(1000)[part]), 5)])[0], states=pool, slots=slot)
             for part in (slice(0, 600), slice(600, 1000))]
    close(torch.cat(parts), whole, TOL[torch.float32])
    close(pool, whole_pool, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_varlen_equals_torch(dtype: torch.dtype) -> None:
    d_inner, d_state = 5120, 16
    cu, slots = packing(LENGTHS_SLOTS)
    tokens = int(cu[-1])
    gen = torch.Generator().manual_seed(2)
    a = {"x": randn(gen, tokens, d_inner), "dt": randn(gen, tokens, d_inner, scale=0.5) - 3.0,
         "B": randn(gen, tokens, d_state), "C": randn(gen, tokens, d_state), "z": randn(gen, tokens, d_inner)}
    a = {name: t.to(dtype) for name, t in a.items()}
    a["A"] = -torch.arange(1, d_state + 1.0).repeat(d_inner, 1).cuda()  # Mamba1's init: A_log = log(1..d_state)
    a["D"] = randn(gen, d_inner)
    a["dt_bias"] = randn(gen, d_inner, scale=0.1)
    pool = randn(gen, NUM_SLOTS, d_inner, d_state)
    expected_pool = pool.clone()
    expected = ssm.selective_scan_varlen(cu_seqlens=cu, states=expected_pool, slots=slots, **a)
    y = ssm_prefill.selective_scan_varlen(cu_seqlens=cu, states=pool, slots=slots, **a)
    close(y, expected, TOL[dtype])
    close(pool, expected_pool, TOL[torch.float32])  # the state math is fp32 on both sides whatever the inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_varlen_equals_torch(dtype: torch.dtype) -> None:
    channels, width = 128 * 64 + 2 * 8 * 128, 4  # Mamba2's xBC
    cu, slots = packing(LENGTHS_SLOTS + [(2, 11)])  # and a sequence shorter than the conv state
    gen = torch.Generator().manual_seed(3)
    x = randn(gen, int(cu[-1]), channels).to(dtype)
    weight = randn(gen, channels, width, scale=0.5).to(dtype)
    bias = randn(gen, channels).to(dtype)
    pool = randn(gen, NUM_SLOTS, channels, width - 1).to(dtype)
    expected_pool = pool.clone()
    expected = ssm.causal_conv1d_varlen(x, cu, weight, bias, expected_pool, slots)
    y = ssm_prefill.causal_conv1d_varlen(x, cu, weight, bias, pool, slots)
    close(y, expected, TOL[dtype])
    assert torch.equal(pool, expected_pool)  # the new states are inputs, copied


def milliseconds(fn, reps: int = 3) -> float:
    """Mean wall time of fn() on the GPU after one warm-up call (which compiles the Triton kernels)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("kernel", ["qwen3_next_gdn", "kimi_linear_kda", "mamba2_ssd", "mamba1_scan"])
def test_triton_prefill_beats_torch(kernel: str) -> None:
    """A coarse guard against a pathological kernel (spills, a serial loop): the Triton prefill of 8k bf16 tokens
    takes at most half the torch reference's time (which loops over sequences and chunks on the host). The times
    are printed (pytest -s) for the record."""
    cu, slots = packing(LENGTHS_SLOTS)
    tokens = int(cu[-1])
    if kernel in DELTA_SHAPES:
        x = delta_inputs(kernel, tokens, torch.bfloat16)
        pool = x.pop("states")
        triton_ms = milliseconds(lambda: delta_rule_chunk.chunk_delta_rule_varlen(**x, cu_seqlens=cu, states=pool,
                                                                                  slots=slots))
        torch_ms = milliseconds(lambda: delta_reference({**x, "states": pool}, LENGTHS_SLOTS))
    elif kernel == "mamba2_ssd":
        a = ssd_inputs(tokens, torch.bfloat16)
        pool = a.pop("states")
        triton_ms = milliseconds(lambda: ssm_prefill.ssd_varlen(cu_seqlens=cu, states=pool, slots=slots, **a))
        torch_ms = milliseconds(lambda: ssm.ssd_varlen(cu_seqlens=cu, states=pool, slots=slots, **a))
    else:
        d_inner, d_state = 5120, 16
        gen = torch.Generator().manual_seed(4)
        a = {name: randn(gen, tokens, width).to(torch.bfloat16)
             for name, width in (("x", d_inner), ("dt", d_inner), ("B", d_state), ("C", d_state), ("z", d_inner))}
        a["A"] = -torch.arange(1, d_state + 1.0).repeat(d_inner, 1).cuda()
        pool = randn(gen, NUM_SLOTS, d_inner, d_state)
        triton_ms = milliseconds(lambda: ssm_prefill.selective_scan_varlen(cu_seqlens=cu, states=pool, slots=slots,
                                                                           **a))
        torch_ms = milliseconds(lambda: ssm.selective_scan_varlen(cu_seqlens=cu, states=pool, slots=slots, **a),
                                reps=1)
    print(f"{kernel}: {tokens} tokens, triton {triton_ms:.2f} ms, torch {torch_ms:.2f} ms")
    assert triton_ms < torch_ms / 2, f"{kernel}: triton {triton_ms:.2f} ms vs torch {torch_ms:.2f} ms"
