"""The rejection sampler keeps the target's distribution, for a drafter with probabilities (q) and
for a deterministic one (one-hot q, as n-gram drafting is): checked by total variation over many draws."""
from __future__ import annotations

import torch

from pressroom.sampling_params import SamplingParams
from pressroom.worker.rejection_sampler import verify
from pressroom.worker.sampler import SamplingRow, probabilities

VOCAB, TRIALS = 8, 6000
# With 6,000 draws over 8 outcomes the total variation of an exact sampler stays near 0.02
# (sqrt(8 / (2 * pi * 6000)) ~ 0.015 expected); a biased sampler (e.g. accepting drafts outright) is off by > 0.2.
TV_BOUND = 0.05


def _rows(params: SamplingParams, k: int) -> list[SamplingRow]:
    return [SamplingRow(params, [1, 2, 3], [], None) for _ in range(k + 1)]


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, VOCAB, generator=gen) * 1.5  # target logits at the k + 1 = 3 positions
    draft_logits = torch.randn(2, VOCAB, generator=gen) * 1.5
    return logits, torch.softmax(draft_logits, dim=-1)


def test_probabilistic_drafts_keep_the_target_distribution():
    logits, q = _setup(0)
    params = SamplingParams(temperature=1.0)
    p = probabilities([params] * 3, logits)
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(VOCAB)
    second_given_accept = torch.zeros(VOCAB)
    accepted_first = 0
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        tokens = verify(logits, _rows(params, 2), drafts, q, gen)
        first[tokens[0]] += 1
        if len(tokens) >= 2:  # the first draft was accepted: the next token is p's at position 1
            accepted_first += 1
            second_given_accept[tokens[1]] += 1
    assert _tv(first, p[0]) < TV_BOUND
    assert accepted_first > 1000  # the test exercises both branches
    assert _tv(second_given_accept, p[1]) < TV_BOUND * 1.5  # fewer draws behind this one


def test_deterministic_drafts_keep_the_target_distribution():
    logits, _ = _setup(2)
    params = SamplingParams(temperature=0.8, top_k=6)
    p = probabilities([params] * 3, logits)
    likely = int(p[0].argmax())  # a draft the target often agrees with
    gen = torch.Generator().manual_seed(3)
    first = torch.zeros(VOCAB)
    for _ in range(TRIALS):
        tokens = verify(logits, _rows(params, 2), [likely, 0], None, gen)
        first[tokens[0]] += 1
    assert _tv(first, p[0]) < TV_BOUND
    assert 0 < first[likely] < TRIALS  # accepted sometimes, rejected (and resampled) other times


def test_greedy_accepts_the_matching_prefix_then_takes_the_argmax():
    logits = torch.full((4, VOCAB), -5.0)
    for j, t in enumerate([3, 5, 1, 6]):
        logits[j, t] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, _rows(greedy, 3), [3, 5, 1], None, None) == [3, 5, 1, 6]  # all accepted + bonus
    assert verify(logits, _rows(greedy, 3), [3, 2, 1], None, None) == [3, 5]  # stops at the first mismatch
    assert verify(logits, _rows(greedy, 3), [0, 5, 1], None, None) == [3]


def test_history_processors_see_the_drafts_before_each_position():
    """With a strong repetition penalty, a token drafted at position 0 is penalised at position 1."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 3.0
    logits[:, 6] = 2.0
    params = SamplingParams(temperature=0, repetition_penalty=10.0)
    rows = [SamplingRow(params, [1], [], None), SamplingRow(params, [1], [4], None)]
    assert verify(logits, rows, [4], None, None) == [4, 6]


def test_synthetic_acceptance_follows_the_given_rates():
    """Benchmark mode: acceptance ignores the target; position j is accepted with the given conditional rate."""
    logits = torch.zeros(4, VOCAB)
    rates = [0.8, 0.5, 0.25]
    gen = torch.Generator().manual_seed(9)
    lengths = torch.zeros(4)
    for _ in range(4000):
        tokens = verify(logits, _rows(SamplingParams(temperature=0), 3), [7, 7, 7], None, gen, rates)
        lengths[len(tokens) - 1] += 1
    survival = [1.0, 0.8, 0.4, 0.1]  # P(at least j drafts accepted)
    expected = torch.tensor([survival[j] - (survival[j + 1] if j < 3 else 0.0) for j in range(4)])
    assert (lengths / 4000 - expected).abs().max() < 0.03
