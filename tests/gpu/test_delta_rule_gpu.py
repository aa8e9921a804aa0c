"""The gated delta rule on CUDA at real shapes (Qwen3-Next's Gated DeltaNet: 16 key heads, 32 value heads; Kimi
Linear's KDA: 32 heads; d_k = d_v = 128): the torch chunked form against the recurrence and against the same code on
the CPU (which tests/kernels/test_delta_rule.py holds to HF transformers), and the Triton decode step into a slot
pool against the torch step, alone and continuing a chunked prefill."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pressroom.kernels import delta_rule as dr

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: delta rule at real shapes")]

if torch.cuda.is_available():
    from pressroom.kernels.triton import delta_rule as triton_delta_rule

# (key heads, value heads, d_k, d_v, per-channel gate), from HF's config defaults
SHAPES = {"qwen3_next_gdn": (16, 32, 128, 128, False), "kimi_linear_kda": (32, 32, 128, 128, True)}
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def make_inputs(shape: str, tokens: int, num_seqs: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    hk, hv, dk, dv, per_channel = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    gate_shape = (tokens, hv, dk) if per_channel else (tokens, hv)
    x = {"q": torch.randn(tokens, hk, dk, generator=gen), "k": torch.randn(tokens, hk, dk, generator=gen),
         "v": torch.randn(tokens, hv, dv, generator=gen),
         "g": F.logsigmoid(torch.randn(gate_shape, generator=gen) + 2.0),
         "beta": torch.rand(tokens, hv, generator=gen)}
    x = {name: t.to(dtype).cuda() for name, t in x.items()}
    x["initial_state"] = (torch.randn(num_seqs, hv, dk, dv, generator=gen) * 0.1).cuda()
    return x


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_recurrence(shape: str, dtype: torch.dtype) -> None:
    lengths = [130, 1, 64, 77]
    x = make_inputs(shape, sum(lengths), len(lengths), dtype)
    expected_o, expected_states = dr.recurrent_gated_delta_rule(**x, cu_seqlens=packed(lengths))
    o, states = dr.chunk_gated_delta_rule(**x, cu_seqlens=packed(lengths))
    close(o, expected_o, TOL[dtype])
    close(states, expected_states, TOL[dtype])


@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_equals_cpu(shape: str) -> None:
    lengths = [300, 45]
    x = make_inputs(shape, sum(lengths), len(lengths), torch.float32)
    o, states = dr.chunk_gated_delta_rule(**x, cu_seqlens=packed(lengths))
    expected_o, expected_states = dr.chunk_gated_delta_rule(**{n: t.cpu() for n, t in x.items()},
                                                            cu_seqlens=packed(lengths).cpu())
    close(o, expected_o, TOL[torch.float32])
    close(states, expected_states, TOL[torch.float32])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_triton_decode_equals_torch_step(shape: str, dtype: torch.dtype, pool_dtype: torch.dtype) -> None:
    num_seqs, num_slots = 64, 128
    x = make_inputs(shape, num_seqs, 1, dtype)
    del x["initial_state"]
    gen = torch.Generator().manual_seed(1)
    pool = (torch.randn(num_slots, *x["v"].shape[1:2], x["q"].shape[2], x["v"].shape[2], generator=gen) * 0.1)
    pool = pool.to(pool_dtype).cuda()
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs]
    slots[::7] = -1
    slots = slots.cuda()
    live = slots >= 0
    expected_pool = pool.clone()
    expected_o, expected_pool[slots[live]] = dr.recurrent_decode_step(
        **{n: t[live] for n, t in x.items()}, states=pool[slots[live]])
    o = triton_delta_rule.fused_recurrent_decode(**x, state_pool=pool, slots=slots)
    tol = TOL[torch.float32] if dtype == pool_dtype == torch.float32 else TOL[torch.bfloat16]
    close(o[live], expected_o, tol)
    assert not o[~live].any()
    close(pool, expected_pool, tol)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_then_triton_decode_equals_recurrence(shape: str) -> None:
    """The engine's path for a request: a chunked prefill writes its state into a slot, decode steps advance it."""
    prompt, decode_steps = 150, 8
    x = make_inputs(shape, prompt + decode_steps, 1, torch.float32)
    expected_o, expected_state = dr.recurrent_gated_delta_rule(**x)
    head = {n: t[:prompt] if n != "initial_state" else t for n, t in x.items()}
    _, state = dr.chunk_gated_delta_rule(**head)
    pool = torch.zeros(4, *state.shape[1:], device="cuda")
    pool[2] = state[0]
    slots = torch.tensor([2], device="cuda")
    for t in range(prompt, prompt + decode_steps):
        step = {n: x[n][t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        o = triton_delta_rule.fused_recurrent_decode(**step, state_pool=pool, slots=slots)
        close(o[0], expected_o[t], TOL[torch.float32])
    close(pool[2], expected_state[0], TOL[torch.float32])
