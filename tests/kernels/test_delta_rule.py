"""The gated delta rule (GDN's scalar gate, KDA's per-channel gate): the recurrence against HF transformers' torch
fallbacks, the chunked form against the recurrence, continuation across engine chunks, packed varlen sequences."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pressroom.kernels import delta_rule as dr

# (name, key heads, value heads, d_k, d_v, per-channel gate)
VARIANTS = {"gdn": (2, 4, 16, 48, False), "kda": (3, 3, 24, 16, True)}


def make_inputs(variant: str, tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                num_seqs: int = 1) -> dict[str, torch.Tensor]:
    """Packed random inputs in the module's layouts, gates in log space (<= 0), betas in (0, 1), and initial states."""
    hk, hv, dk, dv, per_channel = VARIANTS[variant]
    gen = torch.Generator().manual_seed(seed)
    gate_shape = (tokens, hv, dk) if per_channel else (tokens, hv)
    x = {"q": torch.randn(tokens, hk, dk, generator=gen), "k": torch.randn(tokens, hk, dk, generator=gen),
         "v": torch.randn(tokens, hv, dv, generator=gen),
         "g": F.logsigmoid(torch.randn(gate_shape, generator=gen) + 2.0),
         "beta": torch.rand(tokens, hv, generator=gen)}
    x = {name: t.to(dtype) for name, t in x.items()}
    x["initial_state"] = torch.randn(num_seqs, hv, dk, dv, generator=gen) * 0.1
    return x


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def hf_oracle(variant: str, chunked: bool, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's torch fallbacks on one sequence: [batch, seq, heads, dim] layouts, q/k normalized and q scaled inside."""
    if variant == "gdn":
        from transformers.models.qwen3_next import modeling_qwen3_next as hf
        fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    else:
        from transformers.models.kimi_linear import modeling_kimi_linear as hf
        fn = hf.chunk_kimi_delta_attention if chunked else hf.recurrent_kimi_delta_attention
    q, k, v, g, beta = (x[n].unsqueeze(0) for n in ("q", "k", "v", "g", "beta"))
    o, state = fn(q, k, v, g=g, beta=beta, initial_state=x["initial_state"], output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    return o[0], state


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_equals_hf_transformers(variant: str, chunked: bool) -> None:
    x = make_inputs(variant, tokens=70)
    expected_o, expected_state = hf_oracle(variant, chunked, x)
    fn = dr.chunk_gated_delta_rule if chunked else dr.recurrent_gated_delta_rule
    o, state = fn(**x)
    close(o, expected_o, 1e-4)
    close(state, expected_state, 1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens,chunk_size", [(1, 64), (64, 64), (150, 64), (37, 16)])
def test_chunked_equals_recurrence(variant: str, tokens: int, chunk_size: int) -> None:
    x = make_inputs(variant, tokens, seed=tokens)
    expected_o, expected_state = dr.recurrent_gated_delta_rule(**x)
    o, state = dr.chunk_gated_delta_rule(**x, chunk_size=chunk_size)
    close(o, expected_o, 1e-4)
    close(state, expected_state, 1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_equals_recurrence_bf16(variant: str) -> None:
    x = make_inputs(variant, tokens=100, dtype=torch.bfloat16)
    expected_o, expected_state = dr.recurrent_gated_delta_rule(**x)
    o, state = dr.chunk_gated_delta_rule(**x)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    close(o, expected_o, 2e-2)
    close(state, expected_state, 1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_initial_state_by_default(variant: str) -> None:
    x = make_inputs(variant, tokens=20)
    x["initial_state"] = torch.zeros_like(x["initial_state"])
    expected = dr.chunk_gated_delta_rule(**x)
    del x["initial_state"]
    for actual, want in zip(dr.chunk_gated_delta_rule(**x), expected):
        close(actual, want, 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", [1, 40, 64, 90])
def test_continuing_from_a_state_equals_running_whole(variant: str, split: int) -> None:
    """An engine prefilling a prompt over several chunks carries the state from one to the next."""
    x = make_inputs(variant, tokens=130)
    whole_o, whole_state = dr.chunk_gated_delta_rule(**x)
    head = {n: t[:split] if n != "initial_state" else t for n, t in x.items()}
    tail = {n: t[split:] for n, t in x.items() if n != "initial_state"}
    head_o, mid_state = dr.chunk_gated_delta_rule(**head)
    tail_o, state = dr.chunk_gated_delta_rule(**tail, initial_state=mid_state)
    close(torch.cat((head_o, tail_o)), whole_o, 1e-4)
    close(state, whole_state, 1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_packed_varlen_equals_each_sequence(variant: str, chunked: bool) -> None:
    lengths = [5, 0, 70, 1, 33]
    x = make_inputs(variant, tokens=sum(lengths), num_seqs=len(lengths))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    fn = dr.chunk_gated_delta_rule if chunked else dr.recurrent_gated_delta_rule
    o, states = fn(**x, cu_seqlens=cu_seqlens)
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        one = {name: t[start:end] for name, t in x.items() if name != "initial_state"}
        expected_o, expected_state = fn(**one, initial_state=x["initial_state"][n:n + 1])
        close(o[start:end], expected_o, 1e-5)
        close(states[n], expected_state[0], 1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_equals_recurrence(variant: str, dtype: torch.dtype) -> None:
    """A decode batch: one token for each of N sequences, batched in one step."""
    x = make_inputs(variant, tokens=6, num_seqs=6, dtype=dtype)
    expected_o, expected_states = dr.recurrent_gated_delta_rule(**x, cu_seqlens=torch.arange(7))
    states = x.pop("initial_state")
    o, new_states = dr.recurrent_decode_step(**x, states=states)
    close(o, expected_o, 1e-5 if dtype == torch.float32 else 1e-2)
    close(new_states, expected_states, 1e-5 if dtype == torch.float32 else 1e-2)


def test_wrong_layouts_name_every_shape() -> None:
    x = make_inputs("kda", tokens=4, num_seqs=2)
    with pytest.raises(ValueError, match=r"initial_state \(2, 3, 24, 16\)"):
        dr.chunk_gated_delta_rule(**x)  # two states for one sequence
    x["g"] = x["g"][..., :5]
    with pytest.raises(ValueError, match=r"g \(4, 3, 5\)"):
        dr.recurrent_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 1, 4]))


def _triton_decode():
    """The Triton module, or a skip where triton or anything to run it on (CUDA, the interpreter) is missing."""
    pytest.importorskip("triton", reason="triton is not installed")
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    from pressroom.kernels.triton import delta_rule as triton_delta_rule
    return triton_delta_rule


def decode_into_pool_reference(x: dict[str, torch.Tensor], pool: torch.Tensor,
                               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch decode step on the pool's rows named by slots (negative: padding, zero output, pool untouched)."""
    live = slots >= 0
    o = torch.zeros(x["v"].shape, dtype=x["v"].dtype, device=x["v"].device)
    pool = pool.clone()
    inputs = {name: x[name][live] for name in ("q", "k", "v", "g", "beta")}
    o[live], pool[slots[live]] = dr.recurrent_decode_step(**inputs, states=pool[slots[live]])
    return o, pool


def check_triton_decode(variant: str, dtype: torch.dtype, pool_dtype: torch.dtype, device: str,
                        num_seqs: int, num_slots: int, seed: int = 0) -> None:
    """Sequences reading scattered slots of a pool (some padding), q/k strided views of a fused qk tensor."""
    triton_delta_rule = _triton_decode()
    x = make_inputs(variant, tokens=num_seqs, dtype=dtype, seed=seed)
    x = {name: t.to(device) for name, t in x.items() if name != "initial_state"}
    x["q"], x["k"] = torch.cat((x["q"], x["k"]), dim=1).split(x["q"].shape[1], dim=1)
    gen = torch.Generator().manual_seed(seed)
    hv, dk, dv = x["v"].shape[1], x["q"].shape[2], x["v"].shape[2]
    pool = (torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.1).to(pool_dtype).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs]
    slots[::3] = -1
    slots = slots.to(device)
    expected_o, expected_pool = decode_into_pool_reference(x, pool, slots)
    o = triton_delta_rule.fused_recurrent_decode(**x, state_pool=pool, slots=slots)
    tol = 1e-5 if dtype == pool_dtype == torch.float32 else 2e-2
    close(o, expected_o, tol)
    close(pool, expected_pool, tol)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_triton_decode_equals_torch_step(variant: str, dtype: torch.dtype, pool_dtype: torch.dtype) -> None:
    check_triton_decode(variant, dtype, pool_dtype, "cuda" if torch.cuda.is_available() else "cpu",
                        num_seqs=5, num_slots=9)
