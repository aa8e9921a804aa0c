"""Nemotron-H: its Mamba2 mixer (the shared layers/mamba2_mixer.py) equals HF transformers' over a packed batch of
prefills, chunked prefills and decodes on a state-slot pool."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.attention.state import StateMetadata
from pressroom.model.layers.mamba2_mixer import Mamba2Mixer
from pressroom.model.models.nemotron_h import mixer_config

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, NemotronHConfig  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer  # noqa: E402

# ---------------------------------------------------------------- a mixer on a slot pool against HF's


@dataclass(frozen=True)
class Piece:
    """One request's tokens in one step: hidden-state rows [start, end) of its sequence, in its state slot."""
    seq: int
    start: int
    end: int
    slot: int


# Three steps over sequences of 11, 13 and 9 tokens, then two more decode steps: a whole prefill and a chunk, a
# decode beside a continued chunk and a fresh prefill, all three decoding. Slot 0 stays unused (padding's).
SCHEDULE = [
    [Piece(0, 0, 11, 1), Piece(1, 0, 5, 3)],
    [Piece(0, 11, 12, 1), Piece(1, 5, 13, 3), Piece(2, 0, 9, 2)],
    [Piece(0, 12, 13, 1), Piece(1, 13, 14, 3), Piece(2, 9, 10, 2)],
    [Piece(2, 10, 11, 2), Piece(0, 13, 14, 1), Piece(1, 14, 15, 3)],
]


def run_schedule(mixer: Mamba2Mixer, seqs: list[torch.Tensor], schedule=SCHEDULE) -> list[torch.Tensor]:
    """Our mixer over `schedule`, each step one packed forward (decodes first); returns each sequence's outputs."""
    mixer.bind_states({name: torch.zeros(4, *s.shape, dtype=s.dtype) for name, s in mixer.state_shapes().items()})
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in schedule:
        step = sorted(step, key=lambda p: p.end - p.start > 1)
        qsl = [0]
        for p in step:
            qsl.append(qsl[-1] + p.end - p.start)
        num_decodes = sum(p.end - p.start == 1 for p in step)
        meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes,
                                 slot_mapping=torch.empty(0), block_tables=torch.empty(0), seq_lens=torch.empty(0),
                                 query_start_loc=qsl, seq_lens_host=[],
                                 state=StateMetadata.one_round(qsl, [p.slot for p in step], "cpu", num_decodes))
        with forward_context(meta), torch.no_grad():
            y = mixer(torch.cat([seqs[p.seq][p.start:p.end] for p in step]))
        for p, start, end in zip(step, qsl[:-1], qsl[1:]):
            outs[p.seq].append(y[start:end])
    return [torch.cat(o) for o in outs]


def run_hf(mixer: torch.nn.Module, config, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """HF's mixer over one sequence: its prompt at once, then one token per call through HF's cache."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        outs = [mixer(seq[None, :prompt_len], cache=cache)[0]]
        assert cache.layers[mixer.layer_idx].recurrent_states[0] is not None, "HF's mixer ignored the cache"
        outs += [mixer(seq[None, t:t + 1], cache=cache)[0] for t in range(prompt_len, seq.shape[0])]
    return torch.cat(outs)


def copy_hf_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            ours.get_parameter(name).copy_(p)


def randomize(module: torch.nn.Module, seed: int = 3) -> None:
    """Every parameter random, the scan's (A_log, dt_bias, D) and the norm weight included."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name != "A_log" else 1.0))


def sequences(hidden: int, lengths=(14, 15, 11), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in lengths]


PROMPT_LENS = (11, 13, 9)  # where each sequence's prefill ends in SCHEDULE


def nemotron_config(**overrides) -> NemotronHConfig:
    args = dict(vocab_size=64, hidden_size=16, layers_block_type=["linear_attention"], ssm_state_size=4,
                mamba_num_heads=4, mamba_head_dim=6, n_groups=2, chunk_size=4, conv_kernel=4, use_bias=True)
    return NemotronHConfig(**(args | overrides))


@pytest.mark.parametrize("overrides", [{}, dict(n_groups=1, chunk_size=128, use_conv_bias=False, use_bias=False)])
def test_mixer_matches_hf_over_packed_prefill_and_decode_steps(overrides):
    config = nemotron_config(**overrides)
    theirs = NemotronHMamba2Mixer(config, 0).eval()
    randomize(theirs)
    ours = Mamba2Mixer(mixer_config(config))
    copy_hf_weights(ours, theirs)
    seqs = sequences(16)
    for seq, actual, prompt_len in zip(seqs, run_schedule(ours, seqs), PROMPT_LENS):
        torch.testing.assert_close(actual, run_hf(theirs, config, seq, prompt_len), atol=1e-5, rtol=1e-4)
