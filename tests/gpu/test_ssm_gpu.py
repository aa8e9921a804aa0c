"""State-space kernels on CUDA at real shapes (Nemotron-H-8B's and Mamba2-2.7B's Mamba2 layers, Mamba-2.8B's
Mamba1 layer): the chunked prefill against the step recurrence, the Triton pool steps (SSD, selective, conv)
against torch, and whole mixers against HF transformers' torch paths (prefill past several chunks, then cached
decode)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: SSM kernels at real shapes")]

if torch.cuda.is_available():
    from transformers import DynamicCache, Mamba2Config, MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    from pressroom.kernels import ssm
    from pressroom.kernels.triton import ssm as triton_ssm

NEMOTRON_H_8B = dict(heads=128, head_dim=64, groups=8, d_state=128)
MAMBA2_2P7B = dict(heads=80, head_dim=64, groups=1, d_state=128)


@pytest.fixture(autouse=True)
def _no_tf32():
    """HF's conv runs through cuDNN, which rounds fp32 to TF32 by default: fp32 parity needs full fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _ssd_inputs(batch: int, seqlen: int, heads: int, head_dim: int, groups: int, d_state: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    return dict(x=r(batch, seqlen, heads, head_dim), dt=r(batch, seqlen, heads) - 2,
                A=-torch.rand(heads, generator=g, device="cuda") * 4, B=r(batch, seqlen, groups, d_state) / 4,
                C=r(batch, seqlen, groups, d_state) / 4, D=r(heads), dt_bias=r(heads))


@pytest.mark.parametrize("shape", [NEMOTRON_H_8B, MAMBA2_2P7B], ids=["nemotron-h-8b", "mamba2-2.7b"])
def test_ssd_chunked_equals_steps_at_real_shape(shape):
    a = _ssd_inputs(batch=1, seqlen=600, **shape)  # three 256-token chunks, the last partial
    init = torch.randn(1, shape["heads"], shape["head_dim"], shape["d_state"], device="cuda") / 4
    y, final = ssm.ssd_chunked(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], initial_state=init)
    state = init.clone()
    steps = [ssm.ssd_state_update(state, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t], a["D"],
                                  a["dt_bias"]) for t in range(600)]
    _close(y, torch.stack(steps, 1), 2e-3)
    _close(final, state, 2e-3)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [NEMOTRON_H_8B, MAMBA2_2P7B], ids=["nemotron-h-8b", "mamba2-2.7b"])
def test_triton_pool_step_matches_torch_at_real_shape(shape, state_dtype: torch.dtype):
    a = _ssd_inputs(batch=64, seqlen=1, **shape)
    args = dict(x=a["x"][:, 0].bfloat16(), dt=a["dt"][:, 0].bfloat16(), A=a["A"], B=a["B"][:, 0].bfloat16(),
                C=a["C"][:, 0].bfloat16(), D=a["D"], dt_bias=a["dt_bias"])
    states = torch.randn(256, shape["heads"], shape["head_dim"], shape["d_state"], device="cuda").to(state_dtype)
    slots = torch.randperm(256, device="cuda")[:64]
    slots[7] = -1  # a padding row
    expected_states = states.clone()
    expected = ssm.ssd_state_update_pool(expected_states, slots, **args)
    actual = triton_ssm.ssd_state_update_pool(states, slots, **args)
    _close(actual, expected, 3e-2)
    _close(states, expected_states, 1e-5 if state_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_selective_pool_step_matches_torch_at_real_shape(state_dtype: torch.dtype):
    d_inner, d_state = 5120, 16  # Mamba-2.8B
    g = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    args = dict(x=r(64, d_inner).bfloat16(), dt=(r(64, d_inner) - 2).bfloat16(),
                A=-torch.rand(d_inner, d_state, generator=g, device="cuda") * 8, B=r(64, d_state).bfloat16(),
                C=r(64, d_state).bfloat16(), D=r(d_inner), z=r(64, d_inner).bfloat16(), dt_bias=r(d_inner))
    states = r(256, d_inner, d_state).to(state_dtype)
    slots = torch.randperm(256, device="cuda")[:64]
    slots[5] = -1
    expected_states = states.clone()
    expected = ssm.selective_state_update_pool(expected_states, slots, **args)
    actual = triton_ssm.selective_state_update_pool(states, slots, **args)
    _close(actual, expected, 3e-2)
    _close(states, expected_states, 1e-5 if state_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_conv_pool_update_matches_torch_at_real_shape(state_dtype: torch.dtype):
    channels = 128 * 64 + 2 * 8 * 128  # Nemotron-H-8B's conv over x, B and C
    g = torch.Generator(device="cuda").manual_seed(2)
    pool = torch.randn(256, channels, 3, generator=g, device="cuda").to(state_dtype)
    x = torch.randn(64, channels, generator=g, device="cuda").bfloat16()
    weight, bias = (torch.randn(channels, 4, generator=g, device="cuda"),
                    torch.randn(channels, generator=g, device="cuda"))
    slots = torch.randperm(256, device="cuda")[:64]
    slots[3] = -1
    expected_pool = pool.clone()
    expected = ssm.causal_conv1d_update_pool(x, expected_pool, slots, weight, bias)
    actual = triton_ssm.causal_conv1d_update_pool(x, pool, slots, weight, bias)
    _close(actual, expected, 3e-2)
    assert torch.equal(pool, expected_pool)


def _decode_parity(mixer, config, forward, weights, conv_state, ssm_state, hidden: int, tol: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randn(2, 600, hidden, device="cuda", generator=gen)
    decode = torch.randn(2, 4, hidden, device="cuda", generator=gen)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        expected = [mixer(prompt, cache=cache)] + [mixer(decode[:, t:t + 1], cache=cache) for t in range(4)]
        actual = [forward(prompt, weights, conv_state, ssm_state)]
        actual += [forward(decode[:, t:t + 1], weights, conv_state, ssm_state) for t in range(4)]
    for a, e in zip(actual, expected):
        _close(a, e, tol)
    _close(ssm_state, cache.layers[0].recurrent_states[0], tol)


def _hf_before_5_25() -> bool:
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) < (5, 25)


# The GPU image ships transformers 5.17, whose mixers take `cache_params=` (a `cache=` is dropped: HF decodes from
# zero) and whose Mamba2 gated norm ignores n_groups; the CPU suite checks parity against 5.25.
OLD_HF = pytest.mark.skipif(_hf_before_5_25(), reason="HF's Mamba mixers before 5.25 are not this oracle (see above)")


@OLD_HF
def test_mamba2_mixer_matches_hf_on_cuda():
    torch.manual_seed(0)
    config = Mamba2Config(hidden_size=2048, num_heads=64, head_dim=64, state_size=128, n_groups=8, conv_kernel=4,
                          chunk_size=256, num_hidden_layers=1, vocab_size=16, expand=2)
    mixer = Mamba2Mixer(config, 0).cuda().eval()
    weights = ssm.Mamba2Weights(
        in_proj_weight=mixer.in_proj.weight, in_proj_bias=mixer.in_proj.bias, conv_weight=mixer.conv1d.weight[:, 0],
        conv_bias=mixer.conv1d.bias, dt_bias=mixer.dt_bias, A_log=mixer.A_log, D=mixer.D,
        norm_weight=mixer.norm.weight, out_proj_weight=mixer.out_proj.weight, out_proj_bias=mixer.out_proj.bias,
        head_dim=64, n_groups=8, d_state=128, norm_eps=mixer.norm.variance_epsilon, chunk_size=256)
    conv_dim = 4096 + 2 * 8 * 128
    _decode_parity(mixer, config, ssm.mamba2_mixer_forward, weights, torch.zeros(2, conv_dim, 3, device="cuda"),
                   torch.zeros(2, 64, 64, 128, device="cuda"), 2048, 1e-3)


@OLD_HF
def test_mamba1_mixer_matches_hf_on_cuda():
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=2560, state_size=16, intermediate_size=5120, conv_kernel=4, time_step_rank=160,
                         num_hidden_layers=1, vocab_size=16)
    mixer = MambaMixer(config, 0).cuda().eval()
    weights = ssm.Mamba1Weights(
        in_proj_weight=mixer.in_proj.weight, in_proj_bias=mixer.in_proj.bias, conv_weight=mixer.conv1d.weight[:, 0],
        conv_bias=mixer.conv1d.bias, x_proj_weight=mixer.x_proj.weight, dt_proj_weight=mixer.dt_proj.weight,
        dt_proj_bias=mixer.dt_proj.bias, A_log=mixer.A_log, D=mixer.D, out_proj_weight=mixer.out_proj.weight,
        out_proj_bias=mixer.out_proj.bias)
    _decode_parity(mixer, config, ssm.mamba1_mixer_forward, weights, torch.zeros(2, 5120, 3, device="cuda"),
                   torch.zeros(2, 5120, 16, device="cuda"), 2560, 1e-3)
