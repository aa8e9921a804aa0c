"""State-space kernels in torch: chunked prefill equals the step-by-step recurrence, a prefill continued from a
mid-sequence state equals the whole run, packed sequences equal separate ones, and whole Mamba1 / Mamba2 mixers
equal HF transformers' (prefill, then decode steps through HF's cache)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pressroom.kernels import ssm

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Mamba2Config, MambaConfig  # noqa: E402
from transformers.models.mamba.modeling_mamba import MambaMixer  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer, Mamba2RMSNormGated  # noqa: E402

TIGHT = dict(atol=2e-5, rtol=2e-5)


def _close(actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **(tol or TIGHT))


# ---------------------------------------------------------------- conv


def _conv_inputs(batch: int = 2, seqlen: int = 9, channels: int = 6, width: int = 4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, seqlen, channels, generator=g), torch.randn(channels, width, generator=g),
            torch.randn(channels, generator=g))


def test_conv_prefill_from_zero_state_is_the_padded_causal_conv():
    x, weight, bias = _conv_inputs()
    y, state = ssm.causal_conv1d(x, weight, bias, None)
    expected = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=3, groups=6)[..., :9])
    _close(y, expected.transpose(1, 2))
    _close(state, x[:, -3:].transpose(1, 2))


def test_conv_prefill_continued_and_stepwise_equal_the_whole_run():
    x, weight, bias = _conv_inputs()
    whole, whole_state = ssm.causal_conv1d(x, weight, bias, None)
    head, state = ssm.causal_conv1d(x[:, :2], weight, bias, None)  # shorter than the window
    tail, state = ssm.causal_conv1d(x[:, 2:], weight, bias, state)
    _close(torch.cat([head, tail], 1), whole)
    _close(state, whole_state)
    state = torch.zeros(2, 6, 3)
    steps = [ssm.causal_conv1d_update(x[:, t], state, weight, bias) for t in range(9)]
    _close(torch.stack(steps, 1), whole)
    _close(state, whole_state)


def test_conv_varlen_reads_and_writes_pool_slots():
    x, weight, bias = _conv_inputs(batch=1, seqlen=12)
    pool = torch.randn(4, 6, 3)
    slots = torch.tensor([3, 0, 1])
    cu = torch.tensor([0, 5, 6, 12])
    expected_pool = pool.clone()
    expected = []
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y, s = ssm.causal_conv1d(x[:, start:end], weight, bias, pool[slots[i]][None])
        expected.append(y[0])
        expected_pool[slots[i]] = s[0]
    _close(ssm.causal_conv1d_varlen(x[0], cu, weight, bias, pool, slots), torch.cat(expected))
    _close(pool, expected_pool)


# ---------------------------------------------------------------- Mamba1 selective scan


def _scan_inputs(batch: int = 2, seqlen: int = 11, d_inner: int = 6, d_state: int = 4):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(batch, seqlen, d_inner), dt=r(batch, seqlen, d_inner), A=-torch.rand(d_inner, d_state, generator=g),
                B=r(batch, seqlen, d_state), C=r(batch, seqlen, d_state), D=r(d_inner), z=r(batch, seqlen, d_inner),
                dt_bias=r(d_inner))


def test_selective_scan_chunks_equal_the_step_recurrence():
    a = _scan_inputs()
    init = torch.randn(2, 6, 4)
    y, final = ssm.selective_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"],
                                  initial_state=init, chunk_size=3)
    state = init.clone()
    steps = [ssm.selective_state_update(state, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t],
                                        a["D"], a["z"][:, t], a["dt_bias"]) for t in range(11)]
    _close(y, torch.stack(steps, 1))
    _close(final, state)


def test_selective_scan_continued_from_a_mid_state_equals_the_whole_run():
    a = _scan_inputs()
    args = lambda part: (a["x"][:, part], a["dt"][:, part], a["A"], a["B"][:, part], a["C"][:, part],  # noqa: E731
                         a["D"], a["z"][:, part], a["dt_bias"])
    whole, final = ssm.selective_scan(*args(slice(None)))
    head, mid = ssm.selective_scan(*args(slice(0, 4)))
    tail, end = ssm.selective_scan(*args(slice(4, None)), initial_state=mid)
    _close(torch.cat([head, tail], 1), whole)
    _close(end, final)


def test_selective_scan_varlen_uses_each_slot_state():
    a = _scan_inputs(batch=1, seqlen=10)
    pool = torch.randn(3, 6, 4)
    cu, slots = torch.tensor([0, 7, 10]), torch.tensor([2, 0])
    expected_pool = pool.clone()
    expected = []
    for i, part in enumerate([slice(0, 7), slice(7, 10)]):
        y, h = ssm.selective_scan(a["x"][:, part], a["dt"][:, part], a["A"], a["B"][:, part], a["C"][:, part],
                                  a["D"], a["z"][:, part], a["dt_bias"], initial_state=pool[slots[i]][None])
        expected.append(y[0])
        expected_pool[slots[i]] = h[0]
    y = ssm.selective_scan_varlen(a["x"][0], a["dt"][0], a["A"], a["B"][0], a["C"][0], cu, pool, slots, a["D"],
                                  a["z"][0], a["dt_bias"])
    _close(y, torch.cat(expected))
    _close(pool, expected_pool)


# ---------------------------------------------------------------- Mamba2 SSD


def _ssd_inputs(batch: int = 2, seqlen: int = 13, heads: int = 4, head_dim: int = 3, groups: int = 2,
                d_state: int = 5, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(x=r(batch, seqlen, heads, head_dim), dt=r(batch, seqlen, heads),
                A=-torch.rand(heads, generator=g) * 2, B=r(batch, seqlen, groups, d_state),
                C=r(batch, seqlen, groups, d_state), D=torch.randn(heads, generator=g),
                dt_bias=torch.randn(heads, generator=g))


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 256])
def test_ssd_chunks_equal_the_step_recurrence(chunk_size: int):
    a = _ssd_inputs()
    init = torch.randn(2, 4, 3, 5)
    y, final = ssm.ssd_chunked(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], initial_state=init,
                               chunk_size=chunk_size)
    state = init.clone()
    steps = [ssm.ssd_state_update(state, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t], a["D"],
                                  a["dt_bias"]) for t in range(13)]
    _close(y, torch.stack(steps, 1), atol=1e-4, rtol=1e-4)
    _close(final, state, atol=1e-4, rtol=1e-4)


def test_ssd_chunks_clamp_dt_as_the_step_does():
    a = _ssd_inputs()
    y, final = ssm.ssd_chunked(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], dt_limit=(0.2, 0.9),
                               chunk_size=4)
    state = torch.zeros(2, 4, 3, 5)
    steps = [ssm.ssd_state_update(state, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t], a["D"],
                                  a["dt_bias"], dt_limit=(0.2, 0.9)) for t in range(13)]
    _close(y, torch.stack(steps, 1), atol=1e-4, rtol=1e-4)
    _close(final, state, atol=1e-4, rtol=1e-4)
    unclamped, _ = ssm.ssd_chunked(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], chunk_size=4)
    assert not torch.allclose(y, unclamped)


def test_ssd_continued_from_a_mid_state_equals_the_whole_run():
    a = _ssd_inputs()
    args = lambda part: (a["x"][:, part], a["dt"][:, part], a["A"], a["B"][:, part], a["C"][:, part],  # noqa: E731
                         a["D"], a["dt_bias"])
    whole, final = ssm.ssd_chunked(*args(slice(None)), chunk_size=4)
    head, mid = ssm.ssd_chunked(*args(slice(0, 6)), chunk_size=4)
    tail, end = ssm.ssd_chunked(*args(slice(6, None)), initial_state=mid, chunk_size=4)
    _close(torch.cat([head, tail], 1), whole, atol=1e-4, rtol=1e-4)
    _close(end, final, atol=1e-4, rtol=1e-4)


def test_ssd_varlen_uses_each_slot_state():
    """An empty sequence and a padding one (slot -1, its tokens zeros out) leave their states alone."""
    a = _ssd_inputs(batch=1, seqlen=12)
    pool = torch.randn(3, 4, 3, 5)
    cu, slots = torch.tensor([0, 1, 1, 9, 12]), torch.tensor([1, 2, 0, -1])
    expected_pool = pool.clone()
    expected = []
    for slot, part in [(1, slice(0, 1)), (0, slice(1, 9))]:
        y, h = ssm.ssd_chunked(a["x"][:, part], a["dt"][:, part], a["A"], a["B"][:, part], a["C"][:, part], a["D"],
                               a["dt_bias"], initial_state=pool[slot][None], chunk_size=4)
        expected.append(y[0])
        expected_pool[slot] = h[0]
    expected.append(torch.zeros(3, 4, 3))
    y = ssm.ssd_varlen(a["x"][0], a["dt"][0], a["A"], a["B"][0], a["C"][0], cu, pool, slots, a["D"], a["dt_bias"],
                       chunk_size=4)
    _close(y, torch.cat(expected))
    _close(pool, expected_pool)


def test_ssd_bf16_follows_fp32():
    a32, a16 = _ssd_inputs(), _ssd_inputs(dtype=torch.bfloat16)
    y32, h32 = ssm.ssd_chunked(a32["x"], a32["dt"], a32["A"], a32["B"], a32["C"], a32["D"], a32["dt_bias"],
                               chunk_size=4)
    y16, h16 = ssm.ssd_chunked(a16["x"], a16["dt"], a16["A"], a16["B"], a16["C"], a16["D"], a16["dt_bias"],
                               chunk_size=4)
    assert y16.dtype == torch.bfloat16
    _close(y16, y32, atol=0.1, rtol=0.05)
    _close(h16, h32, atol=0.1, rtol=0.05)


def test_gated_rms_norm_matches_hf():
    norm = Mamba2RMSNormGated(12, group_size=4, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x, z = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    _close(ssm.gated_rms_norm(x, z, norm.weight, 1e-5, 4), norm(x, z))


# ---------------------------------------------------------------- whole mixers against HF


def _run_hf(mixer: torch.nn.Module, config, prompt: torch.Tensor, decode: torch.Tensor) -> list[torch.Tensor]:
    cache = DynamicCache(config=config)
    outs = [mixer(prompt, cache=cache)]
    # transformers before the `cache` keyword (5.17, the GPU image's, says `cache_params`) swallows it in **kwargs
    # and decodes from a zero state: fail on the oracle, not as a ~0.1 mismatch of ours
    assert cache.layers[0].recurrent_states[0] is not None, "HF's mixer ignored the cache: transformers too old"
    outs += [mixer(decode[:, t:t + 1], cache=cache) for t in range(decode.shape[1])]
    return outs + [cache.layers[0].recurrent_states[0]]


def _run_ours(forward, weights, conv_state, ssm_state, prompt, decode) -> list[torch.Tensor]:
    outs = [forward(prompt, weights, conv_state, ssm_state)]
    outs += [forward(decode[:, t:t + 1], weights, conv_state, ssm_state) for t in range(decode.shape[1])]
    return outs + [ssm_state]


def _mamba1_weights(m: MambaMixer) -> ssm.Mamba1Weights:
    bias = lambda linear: linear.bias  # noqa: E731
    return ssm.Mamba1Weights(
        in_proj_weight=m.in_proj.weight, in_proj_bias=bias(m.in_proj), conv_weight=m.conv1d.weight[:, 0],
        conv_bias=m.conv1d.bias, x_proj_weight=m.x_proj.weight, dt_proj_weight=m.dt_proj.weight,
        dt_proj_bias=m.dt_proj.bias, A_log=m.A_log, D=m.D, out_proj_weight=m.out_proj.weight,
        out_proj_bias=bias(m.out_proj))


def _mamba2_weights(m: Mamba2Mixer) -> ssm.Mamba2Weights:
    return ssm.Mamba2Weights(
        in_proj_weight=m.in_proj.weight, in_proj_bias=m.in_proj.bias, conv_weight=m.conv1d.weight[:, 0],
        conv_bias=m.conv1d.bias, dt_bias=m.dt_bias, A_log=m.A_log, D=m.D, norm_weight=m.norm.weight,
        out_proj_weight=m.out_proj.weight, out_proj_bias=m.out_proj.bias, head_dim=m.head_dim,
        n_groups=m.n_groups, d_state=m.ssm_state_size, norm_eps=m.norm.variance_epsilon, chunk_size=m.chunk_size,
        dt_limit=tuple(m.time_step_limit))


def _randomize(module: torch.nn.Module) -> None:
    """Make every parameter matter: random D, norm weight and biases on top of HF's init."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("D", "norm.weight") or name.endswith("bias") and name != "dt_proj.bias":
                p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("use_bias,prompt_len", [(False, 7), (True, 7), (False, ssm.SCAN_CHUNK_SIZE + 3)])
def test_mamba1_mixer_matches_hf_prefill_and_decode(use_bias: bool, prompt_len: int):
    """The longer prompt spans two scan chunks, the second partial: its final states feed the decode steps."""
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=16, state_size=4, intermediate_size=32, conv_kernel=4, time_step_rank=4,
                         num_hidden_layers=1, vocab_size=16, use_bias=use_bias)
    mixer = MambaMixer(config, 0).eval()
    _randomize(mixer)
    prompt, decode = torch.randn(2, prompt_len, 16), torch.randn(2, 3, 16)
    with torch.no_grad():
        expected = _run_hf(mixer, config, prompt, decode)
        actual = _run_ours(ssm.mamba1_mixer_forward, _mamba1_weights(mixer), torch.zeros(2, 32, 3),
                           torch.zeros(2, 32, 4), prompt, decode)
    for a, e in zip(actual, expected):
        _close(a, e, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size,n_groups", [(4, 2), (256, 1)])
def test_mamba2_mixer_matches_hf_prefill_and_decode(chunk_size: int, n_groups: int):
    torch.manual_seed(0)
    config = Mamba2Config(hidden_size=16, num_heads=8, head_dim=4, state_size=4, n_groups=n_groups, conv_kernel=4,
                          chunk_size=chunk_size, num_hidden_layers=1, vocab_size=16, expand=2, use_conv_bias=True)
    mixer = Mamba2Mixer(config, 0).eval()
    _randomize(mixer)
    prompt, decode = torch.randn(2, 11, 16), torch.randn(2, 3, 16)
    conv_dim = 32 + 2 * n_groups * 4
    with torch.no_grad():
        expected = _run_hf(mixer, config, prompt, decode)
        actual = _run_ours(ssm.mamba2_mixer_forward, _mamba2_weights(mixer), torch.zeros(2, conv_dim, 3),
                           torch.zeros(2, 8, 4, 4), prompt, decode)
    for a, e in zip(actual, expected):
        _close(a, e, atol=1e-4, rtol=1e-4)


def _tiny_mixer(version: int):
    """A tiny random HF Mamba (1) or Mamba2 (2) mixer, our forward for it, its weights and its two states' shapes
    (conv, SSM) for a batch of 2."""
    torch.manual_seed(0)
    if version == 1:
        mixer = MambaMixer(MambaConfig(hidden_size=16, state_size=4, intermediate_size=32, conv_kernel=4,
                                       time_step_rank=4, num_hidden_layers=1, vocab_size=16), 0)
        forward, weights, shapes = ssm.mamba1_mixer_forward, _mamba1_weights(mixer), ((2, 32, 3), (2, 32, 4))
    else:
        mixer = Mamba2Mixer(Mamba2Config(hidden_size=16, num_heads=8, head_dim=4, state_size=4, n_groups=2,
                                         conv_kernel=4, chunk_size=4, num_hidden_layers=1, vocab_size=16), 0)
        forward, weights, shapes = ssm.mamba2_mixer_forward, _mamba2_weights(mixer), ((2, 48, 3), (2, 8, 4, 4))
    _randomize(mixer)
    return mixer, forward, weights, shapes


@pytest.mark.parametrize("version", [1, 2])
def test_mixer_prefill_in_two_calls_equals_one(version: int):
    """Chunked prefill: the conv and SSM states carried across calls give the outputs of one whole prefill."""
    mixer, forward, weights, shapes = _tiny_mixer(version)
    prompt = torch.randn(2, 13, 16)
    with torch.no_grad():
        whole_conv, whole_ssm = torch.zeros(shapes[0]), torch.zeros(shapes[1])
        whole = forward(prompt, weights, whole_conv, whole_ssm)
        conv, state = torch.zeros(shapes[0]), torch.zeros(shapes[1])
        parts = [forward(prompt[:, :6], weights, conv, state), forward(prompt[:, 6:], weights, conv, state)]
    _close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-4)
    _close(conv, whole_conv)
    _close(state, whole_ssm, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- Triton: Mamba2 step on a state pool


def _pool_step_inputs(batch: int, heads: int, head_dim: int, groups: int, d_state: int, slots: int,
                      dtype: torch.dtype, device: str = "cpu", seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    states = r(slots, heads, head_dim, d_state).to(dtype)
    args = dict(x=r(batch, heads, head_dim).to(dtype), dt=r(batch, heads).to(dtype),
                A=-torch.rand(heads, generator=g).to(device) * 2, B=r(batch, groups, d_state).to(dtype),
                C=r(batch, groups, d_state).to(dtype), D=r(heads), dt_bias=r(heads))
    return states, args


@pytest.mark.parametrize("dtype,dt_limit", [(torch.float32, ssm.DT_LIMIT), (torch.bfloat16, ssm.DT_LIMIT),
                                            (torch.float32, (0.2, 0.9))])
def test_triton_ssd_pool_step_matches_torch(dtype: torch.dtype, dt_limit: tuple[float, float]):
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    from pressroom.kernels.triton import ssm as triton_ssm
    states, args = _pool_step_inputs(batch=4, heads=4, head_dim=24, groups=2, d_state=12, slots=6, dtype=dtype)
    slots = torch.tensor([5, -1, 0, 2])  # out of order, one padding row
    expected_states = states.clone()
    expected = ssm.ssd_state_update_pool(expected_states, slots, **args, dt_limit=dt_limit)
    actual = triton_ssm.ssd_state_update_pool(states, slots, **args, dt_limit=dt_limit)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    _close(actual, expected, **tol)
    _close(states, expected_states, **tol)
    assert torch.equal(states[[1, 3, 4]], expected_states[[1, 3, 4]])  # untouched slots


def test_ssd_pool_step_is_the_batched_step():
    states, args = _pool_step_inputs(batch=3, heads=4, head_dim=3, groups=1, d_state=5, slots=4,
                                     dtype=torch.float32)
    slots = torch.tensor([2, 0, 3])
    picked = states[slots].clone()
    expected = ssm.ssd_state_update(picked, **args)
    _close(ssm.ssd_state_update_pool(states, slots, **args), expected)
    _close(states[slots], picked)


@pytest.mark.parametrize("width,dtype", [(4, torch.float32), (2, torch.float32), (4, torch.bfloat16)])
def test_triton_conv_pool_update_matches_torch(width: int, dtype: torch.dtype):
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    from pressroom.kernels.triton import ssm as triton_ssm
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(5, 20, width - 1, generator=g).to(dtype)
    x, weight, bias = (torch.randn(3, 20, generator=g).to(dtype), torch.randn(20, width, generator=g),
                       torch.randn(20, generator=g))
    slots = torch.tensor([4, -1, 1])
    expected_pool = pool.clone()
    expected = ssm.causal_conv1d_update_pool(x, expected_pool, slots, weight, bias)
    actual = triton_ssm.causal_conv1d_update_pool(x, pool, slots, weight, bias)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    _close(actual, expected, **tol)
    assert torch.equal(pool, expected_pool)  # the state is a shift of stored values and x: exact


def test_conv_pool_update_is_the_batched_update():
    x, weight, bias = _conv_inputs(batch=1, seqlen=3)
    pool = torch.randn(4, 6, 3)
    slots = torch.tensor([2, 0, 3])
    picked = pool[slots].clone()
    expected = ssm.causal_conv1d_update(x[0], picked, weight, bias)
    _close(ssm.causal_conv1d_update_pool(x[0], pool, slots, weight, bias), expected)
    _close(pool[slots], picked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_selective_pool_step_matches_torch(dtype: torch.dtype):
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    from pressroom.kernels.triton import ssm as triton_ssm
    a = _scan_inputs(batch=4, seqlen=1, d_inner=40, d_state=12)
    args = dict(x=a["x"][:, 0].to(dtype), dt=a["dt"][:, 0].to(dtype), A=a["A"], B=a["B"][:, 0].to(dtype),
                C=a["C"][:, 0].to(dtype), D=a["D"], z=a["z"][:, 0].to(dtype), dt_bias=a["dt_bias"])
    pool = torch.randn(6, 40, 12).to(dtype)
    slots = torch.tensor([5, -1, 0, 2])
    expected_pool = pool.clone()
    expected = ssm.selective_state_update_pool(expected_pool, slots, **args)
    actual = triton_ssm.selective_state_update_pool(pool, slots, **args)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    _close(actual, expected, **tol)
    _close(pool, expected_pool, **tol)
    assert torch.equal(pool[[1, 3, 4]], expected_pool[[1, 3, 4]])


def test_selective_pool_step_is_the_batched_step():
    a = _scan_inputs(batch=3, seqlen=1)
    step = dict(x=a["x"][:, 0], dt=a["dt"][:, 0], A=a["A"], B=a["B"][:, 0], C=a["C"][:, 0], D=a["D"],
                z=a["z"][:, 0], dt_bias=a["dt_bias"])
    pool = torch.randn(4, 6, 4)
    slots = torch.tensor([2, 0, 3])
    picked = pool[slots].clone()
    expected = ssm.selective_state_update(picked, **step)
    _close(ssm.selective_state_update_pool(pool, slots, **step), expected)
    _close(pool[slots], picked)


def _bf16(weights):
    """The same mixer weights rounded to bf16 (the dataclass's ints and floats kept)."""
    fields = {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in vars(weights).items()}
    return type(weights)(**fields)


@pytest.mark.parametrize("version", [1, 2])
def test_mixers_in_bf16_follow_fp32(version: int):
    mixer, forward, weights, shapes = _tiny_mixer(version)
    prompt, decode = torch.randn(2, 9, 16), torch.randn(2, 2, 16)
    with torch.no_grad():
        expected = _run_ours(forward, weights, torch.zeros(shapes[0]), torch.zeros(shapes[1]), prompt, decode)
        actual = _run_ours(forward, _bf16(weights), torch.zeros(shapes[0], dtype=torch.bfloat16),
                           torch.zeros(shapes[1]), prompt.bfloat16(), decode.bfloat16())
    for a, e in zip(actual[:-1], expected[:-1]):
        assert a.dtype == torch.bfloat16
        _close(a, e, atol=0.1, rtol=0.05)
    _close(actual[-1], expected[-1], atol=0.1, rtol=0.05)
