"""Mamba1 / Mamba2 against HF transformers (fp32): the mixers over packed steps that mix decode rows, whole
prefills and chunked prefills, states read and written at scattered slots; then whole models through `LLM`."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Mamba2Config, MambaConfig  # noqa: E402
from transformers.models.mamba.modeling_mamba import MambaMixer  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer  # noqa: E402

from pressroom.attention.backend import AttentionMetadata, forward_context  # noqa: E402
from pressroom.attention.state import StateMetadata  # noqa: E402
from pressroom.model.models.mamba import Mamba1Mixer, Mamba2Mixer  # noqa: E402

HIDDEN = 16
NUM_SLOTS = 8
# request -> (state slot, prompt length); slot 0 is padding, so none uses it
REQUESTS = {"a": (3, 7), "b": (1, 20), "c": (6, 5)}
# each step: (request, tokens) in the step's order, decodes (one token after the prompt is done) first;
# b's prompt comes in two chunks, the second beside a decode of a and all of c's prompt
STEPS = [[("a", 7), ("b", 9)],
         [("a", 1), ("b", 11), ("c", 5)],
         [("a", 1), ("b", 1), ("c", 1)],
         [("c", 1), ("a", 1), ("b", 1)]]


def _decode_counts() -> dict[str, int]:
    counts = {name: -length for name, (_, length) in REQUESTS.items()}
    for step in STEPS:
        for name, n in step:
            counts[name] += n
    return counts


def _metadata(step: list[tuple[str, int]], num_decodes: int) -> AttentionMetadata:
    qsl = [0]
    for _, n in step:
        qsl.append(qsl[-1] + n)
    slots = [REQUESTS[name][0] for name, _ in step]
    return AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes, slot_mapping=torch.empty(0),
                             block_tables=torch.empty(0), seq_lens=torch.empty(0), query_start_loc=qsl,
                             seq_lens_host=[], state=StateMetadata.one_round(qsl, slots, "cpu", num_decodes))


def _run_ours(mixer, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each request's outputs over its whole token stream, the steps run as the engine packs them."""
    mixer.bind_states({name: torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype)
                       for name, s in mixer.state_shapes().items()})
    done = {name: 0 for name in REQUESTS}
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in REQUESTS}
    for step in STEPS:
        num_decodes = sum(1 for name, n in step if n == 1 and done[name] >= REQUESTS[name][1])
        assert all(n == 1 for _, n in step[:num_decodes])
        tokens = torch.cat([inputs[name][done[name]:done[name] + n] for name, n in step])
        with forward_context(_metadata(step, num_decodes)):
            y = mixer(tokens)
        for (name, n), part in zip(step, y.split([n for _, n in step])):
            outs[name].append(part)
            done[name] += n
    return {name: torch.cat(parts) for name, parts in outs.items()}


def _run_hf(mixer, config, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each request alone: its whole prompt in one call, then one call per decode token. Returns the outputs and
    the final SSM states."""
    outs, states = {}, {}
    for name, (_, length) in REQUESTS.items():
        cache = DynamicCache(config=config)
        x = inputs[name][None]
        parts = [mixer(x[:, :length], cache=cache)]
        assert cache.layers[0].recurrent_states[0] is not None, "HF's mixer ignored the cache"
        parts += [mixer(x[:, t:t + 1], cache=cache) for t in range(length, x.shape[1])]
        outs[name] = torch.cat(parts, dim=1)[0]
        states[name] = cache.layers[0].recurrent_states[0][0]
    return outs, states


def _randomize(module: torch.nn.Module) -> None:
    """Every parameter matters: random D, norm weight and biases on top of HF's init."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("D", "norm.weight") or name.endswith("bias") and name != "dt_proj.bias":
                p.copy_(torch.randn(p.shape, generator=g))


def _check_against_hf(hf_mixer, config, ours) -> None:
    _randomize(hf_mixer)
    ours.load_state_dict(hf_mixer.state_dict())
    counts = _decode_counts()
    g = torch.Generator().manual_seed(7)
    inputs = {name: torch.randn(length + counts[name], HIDDEN, generator=g)
              for name, (_, length) in REQUESTS.items()}
    with torch.no_grad():
        expected, hf_states = _run_hf(hf_mixer, config, inputs)
        actual = _run_ours(ours, inputs)
    for name, (slot, _) in REQUESTS.items():
        torch.testing.assert_close(actual[name], expected[name], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.states["ssm"][slot], hf_states[name], atol=1e-4, rtol=1e-4)
    assert not ours.states["ssm"][0].any() and not ours.states["conv"][0].any(), "the padding slot was written"


@pytest.mark.parametrize("use_bias", [False, True])
def test_mamba1_mixer_matches_hf_over_packed_steps(use_bias: bool):
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=HIDDEN, state_size=4, intermediate_size=32, conv_kernel=4, time_step_rank=4,
                         num_hidden_layers=1, vocab_size=16, use_bias=use_bias, use_conv_bias=not use_bias)
    _check_against_hf(MambaMixer(config, 0).eval(), config, Mamba1Mixer(config))


@pytest.mark.parametrize("n_groups,chunk_size,dt_limit", [(2, 4, (0.0, float("inf"))), (1, 256, (0.0, float("inf"))),
                                                          (2, 8, (0.02, 0.3))])
def test_mamba2_mixer_matches_hf_over_packed_steps(n_groups: int, chunk_size: int, dt_limit: tuple[float, float]):
    """b's 20-token prompt spans several chunks (split 9 + 11 on our side); a dt limit tighter than HF's init
    spread clamps some prefill time steps (HF's one-token step does not clamp: neither do we)."""
    torch.manual_seed(0)
    config = Mamba2Config(hidden_size=HIDDEN, num_heads=8, head_dim=4, state_size=4, n_groups=n_groups,
                          conv_kernel=4, chunk_size=chunk_size, num_hidden_layers=1, vocab_size=16, expand=2,
                          use_conv_bias=True, time_step_limit=dt_limit)
    _check_against_hf(HFMamba2Mixer(config, 0).eval(), config, Mamba2Mixer(config))
