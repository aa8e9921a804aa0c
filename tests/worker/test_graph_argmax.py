"""When a step may take a decode graph's argmax as its tokens (worker/cuda_graphs.py's DecodeHead): exactly where
the sampler would pick the raw logits' argmax and report nothing else. Each exclusion is shown to matter: the
sampler's token (or its report) differs from the raw argmax on logits built for it."""
from __future__ import annotations

import pytest
import torch

from pressroom.sampling_params import SamplingParams, StructuredOutputsParams
from pressroom.worker.cuda_graphs import head_rows
from pressroom.worker.sampler import SamplingRow, greedy_tokens, sample, takes_raw_argmax

VOCAB, EOS = 64, 3


def _row(params: SamplingParams, output: list[int] = ()) -> SamplingRow:
    return SamplingRow(params, [5, 6, 7], list(output), EOS)


@pytest.mark.parametrize("changes", [{}, dict(max_tokens=7, ignore_eos=True), dict(stop=["x"], n=2),
                                     dict(top_k=5, top_p=0.5, min_p=0.1)])
def test_plain_greedy_requests_take_the_raw_argmax(changes):
    params = SamplingParams(**{"temperature": 0, **changes})
    assert takes_raw_argmax(params)
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(4, VOCAB, generator=gen)
        if trial % 2:  # ties: the first index wins on both paths
            logits = logits.round()
        histories = [torch.randint(0, VOCAB, (trial,), generator=gen).tolist() for _ in range(4)]
        tokens, lps = sample(logits, [_row(params, h) for h in histories])
        assert tokens == greedy_tokens(logits).tolist()
        assert lps == [None] * 4


ARGMAX = 9  # the raw logits' argmax in the cases below


def _logits() -> torch.Tensor:
    logits = torch.linspace(-1, 1, VOCAB)
    logits[ARGMAX] = 5.0
    logits[EOS - 1] = 4.0  # the runner-up
    return logits.unsqueeze(0)


# (sampling params, the output so far): each changes the greedy token away from the raw argmax
CHANGED = {
    "logit_bias": (dict(logit_bias={ARGMAX: -100.0}), []),
    "presence_penalty": (dict(presence_penalty=2.0), [ARGMAX]),
    "frequency_penalty": (dict(frequency_penalty=2.0), [ARGMAX, ARGMAX]),
    "repetition_penalty": (dict(repetition_penalty=10.0), [ARGMAX]),
    "min_tokens": (dict(min_tokens=4, stop_token_ids=[ARGMAX]), []),
    "allowed_token_ids": (dict(allowed_token_ids=[1, 2]), []),
    "bad_words": (dict(bad_words_token_ids=[[ARGMAX]]), []),
    "thinking_token_budget": (dict(thinking_token_budget=1, think_start_token_ids=[20], think_end_token_ids=[21]),
                              [20, 22]),
}


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_requests_whose_logits_change_do_not(name):
    changes, output = CHANGED[name]
    params = SamplingParams(temperature=0, **changes)
    assert not takes_raw_argmax(params)
    tokens, _ = sample(_logits(), [_row(params, output)])
    assert tokens != [ARGMAX]  # so the graph's argmax would have been wrong


@pytest.mark.parametrize("changes", [dict(logprobs=2), dict(prompt_logprobs=1), dict(temperature=0.8),
                                     dict(seed=3),
                                     dict(structured_outputs=StructuredOutputsParams(regex="a+"))])
def test_requests_that_report_logprobs_sample_or_are_masked_do_not(changes):
    params = SamplingParams(**{"temperature": 0, **changes})
    assert not takes_raw_argmax(params)
    if params.logprobs is not None:
        assert sample(_logits(), [_row(params)])[1][0] is not None  # a report the graph does not make


def test_head_rows_is_the_largest_decode_graph_within_the_bytes():
    sizes = [1, 2, 4, 8, 16]
    assert head_rows(sizes, 100, 850) == 8
    assert head_rows(sizes, 100, 1600) == 16
    assert head_rows(sizes, 100, 99) == 0
    assert head_rows(sizes, 100, 0) == 0  # DECODE_HEAD_MAX_BYTES = 0: no graph runs the head


def test_bf16_argmax_is_the_fp32_argmax_of_the_same_values():
    """The graph takes the argmax over the head's own dtype; the sampler over its exact fp32 conversion."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(8, 4096, generator=gen) * 4).to(torch.bfloat16)  # bf16: many exact ties
    logits[3, 100] = logits[3, 2000] = logits[3].max() + 1  # a tie at the top
    assert torch.equal(logits.argmax(dim=-1), greedy_tokens(logits.float()))
    assert int(logits[3].argmax()) == 100
