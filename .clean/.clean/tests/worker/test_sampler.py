"""The sampler on fixed logits: every knob must yield exactly the distribution vLLM defines.

Expected distributions are computed here independently, in plain Python math, then compared with
`probabilities` (exactly) and with what `sample` draws (chi-square goodness of fit, fixed seeds).
"""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from pressroom.sampling_params import SamplingParams
from pressroom.worker.sampler import SamplingRow, probabilities, sample

# Deliberately unsorted, so a bug in mapping sorted positions back to token ids shows up.
LOGITS = [0.5, 2.0, -1.0, 1.0, -3.0, 1.5, 0.0, -0.5]
VOCAB = len(LOGITS)
DRAWS = 20_000
P_MIN = 1e-3
NEG_INF = float("-inf")


# ---- independent reference implementation -------------------------------------------------

def ref_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) if x != NEG_INF else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def ref_distribution(logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> list[float]:
    """Temperature, then top-k, then top-p (smallest set of most likely tokens whose mass reaches top_p),
    then min-p (drop tokens below min_p * the top probability), renormalised."""
    z = [x / temperature for x in logits]
    if top_k and top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else NEG_INF for x in z]
    if top_p < 1.0:
        p = ref_softmax(z)
        order = sorted(range(len(z)), key=lambda i: -p[i])
        kept, mass = set(), 0.0
        for i in order:
            # Keep test cases off float knife edges of the threshold.
            assert abs(mass - top_p) > 1e-3, "test case too close to a top-p boundary"
            if mass >= top_p:
                break
            kept.add(i)
            mass += p[i]
        z = [x if i in kept else NEG_INF for i, x in enumerate(z)]
    p = ref_softmax(z)
    if min_p > 0:
        threshold = min_p * max(p)
        p = [v if v >= threshold else 0.0 for v in p]
        s = sum(p)
        p = [v / s for v in p]
    return p


def ref_processed_logits(logits: list[float], prompt: list[int], output: list[int], logit_bias=None,
                         repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
                         presence_penalty: float = 0.0) -> list[float]:
    """vLLM: logit bias, then repetition (prompt or output tokens), frequency and presence (output only)."""
    z = list(logits)
    for t, b in (logit_bias or {}).items():
        z[t] += b
    seen = set(prompt) | set(output)
    for t in seen:
        z[t] = z[t] / repetition_penalty if z[t] > 0 else z[t] * repetition_penalty
    for t in set(output):
        z[t] -= frequency_penalty * output.count(t) + presence_penalty
    return z


# ---- helpers -------------------------------------------------------------------------------

def draw_counts(params: SamplingParams, logits: list[float] = LOGITS, n: int = DRAWS, seed: int = 0,
                prompt: list[int] | None = None, output: list[int] | None = None,
                eos: int | None = None) -> list[int]:
    rows = [SamplingRow(params, prompt or [0], list(output or []), eos)] * n
    gen = torch.Generator().manual_seed(seed)
    tokens, _ = sample(torch.tensor([logits] * n, dtype=torch.float32), rows, gen)
    counts = [0] * len(logits)
    for t in tokens:
        counts[t] += 1
    return counts


def assert_fits(counts: list[int], expected: list[float]) -> None:
    """Zero-probability tokens must never appear; the rest must pass a chi-square test."""
    n = sum(counts)
    for t, (c, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert c == 0, f"token {t} has probability 0 but was drawn {c} times"
    kept = [t for t, p in enumerate(expected) if p > 0]
    if len(kept) == 1:
        assert counts[kept[0]] == n
        return
    obs = [counts[t] for t in kept]
    exp = [expected[t] * n for t in kept]
    scale = sum(obs) / sum(exp)  # exp sums to n up to float error; chisquare wants equal sums
    result = chisquare(obs, [e * scale for e in exp])
    assert result.pvalue > P_MIN, f"observed {counts}, expected {[round(e) for e in exp]} (p={result.pvalue:.2e})"


def probs_of(params: SamplingParams, logits: list[float] = LOGITS) -> list[float]:
    return probabilities([params], torch.tensor([logits], dtype=torch.float32))[0].tolist()


def support(p: list[float]) -> set[int]:
    return {i for i, v in enumerate(p) if v > 0}


# ---- truncation and temperature ------------------------------------------------------------

CASES = {
    "t1": dict(temperature=1.0),
    "t0.5": dict(temperature=0.5),
    "t2": dict(temperature=2.0),
    "top_k3": dict(top_k=3),
    "top_k1": dict(top_k=1),
    "top_k_beyond_vocab": dict(top_k=100),
    "top_p0.6": dict(top_p=0.6),
    "top_p0.9": dict(top_p=0.9),
    "min_p0.2": dict(min_p=0.2),
    "min_p0.5": dict(min_p=0.5),
    "t2_top_k5_top_p0.8": dict(temperature=2.0, top_k=5, top_p=0.8),
    "t0.5_top_k4_min_p0.1": dict(temperature=0.5, top_k=4, min_p=0.1),
    "t1.5_top_p0.9_min_p0.3": dict(temperature=1.5, top_p=0.9, min_p=0.3),
}

# Supports worked out by hand from LOGITS (token ids by logit: 1 > 5 > 3 > 0 > 6 > 7 > 2 > 4;
# probabilities .405 .245 .149 .090 .055 .033 .020 .003), so a reference bug cannot hide an
# implementation bug. None of the combined cases depends on the order of min-p vs top-k/top-p
# (vLLM v0 applies min-p last, v1 first).
EXPECTED_SUPPORT = {
    "top_k3": {1, 5, 3},
    "top_k1": {1},
    "top_p0.6": {1, 5},          # mass before token 3 is .650 >= .6, so 3 is dropped
    "top_p0.9": {1, 5, 3, 0, 6},  # mass before token 6 is .889 < .9; before token 7, .944
    "min_p0.2": {1, 5, 3, 0},    # exp(-1.5)=.22 >= .2 keeps token 0; exp(-2)=.135 drops token 6
    "min_p0.5": {1, 5},          # exp(-0.5)=.61 keeps 5; exp(-1)=.37 drops 3
}


@pytest.mark.parametrize("name", list(CASES))
def test_probabilities_match_reference(name):
    kw = CASES[name]
    expected = ref_distribution(LOGITS, **kw)
    got = probs_of(SamplingParams(**kw))
    assert support(got) == support(expected)
    assert got == pytest.approx(expected, abs=1e-6)
    if name in EXPECTED_SUPPORT:
        assert support(got) == EXPECTED_SUPPORT[name]


@pytest.mark.parametrize("name", ["t0.5", "t2", "top_k3", "top_p0.6", "min_p0.2",
                                  "t2_top_k5_top_p0.8", "t0.5_top_k4_min_p0.1", "t1.5_top_p0.9_min_p0.3"])
def test_sample_draws_reference_distribution(name):
    kw = CASES[name]
    assert_fits(draw_counts(SamplingParams(**kw)), ref_distribution(LOGITS, **kw))


def test_chi_square_rejects_wrong_temperature():
    """The goodness-of-fit check is sharp enough to tell T=1 from T=0.5 / T=2."""
    counts = draw_counts(SamplingParams(temperature=1.0))
    for t in (0.5, 2.0):
        obs, exp = counts, [p * DRAWS for p in ref_distribution(LOGITS, temperature=t)]
        assert chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue < 1e-10


def test_top_k_minus_one_and_zero_mean_off():
    full = ref_distribution(LOGITS)
    assert probs_of(SamplingParams(top_k=-1)) == pytest.approx(full, abs=1e-6)
    assert probs_of(SamplingParams(top_k=0)) == pytest.approx(full, abs=1e-6)


def test_top_p_keeps_only_the_top_token_when_it_alone_suffices():
    logits = [0.0, 5.0, 0.0, 0.0, 1.0, 0.0]  # p(1) ~ .93
    got = probs_of(SamplingParams(top_p=0.5), logits)
    assert got == pytest.approx([0, 1, 0, 0, 0, 0], abs=1e-7)


def test_mixed_batch_rows_use_their_own_params():
    """Each row is truncated with its own top-k / top-p / min-p / temperature, not its neighbours'."""
    names = ["t2", "top_k3", "top_p0.6", "min_p0.5", "t1", "t0.5_top_k4_min_p0.1", "top_k1"]
    params = [SamplingParams(**CASES[n]) for n in names]
    logits = torch.tensor([LOGITS] * len(names), dtype=torch.float32)
    got = probabilities(params, logits)
    for i, n in enumerate(names):
        assert got[i].tolist() == pytest.approx(ref_distribution(LOGITS, **CASES[n]), abs=1e-6), n


def test_mixed_batch_sampling_draws_each_rows_distribution():
    a, b = SamplingParams(temperature=2.0), SamplingParams(top_k=2)
    rows = [SamplingRow(a if i % 2 == 0 else b, [0], [], None) for i in range(2 * DRAWS)]
    tokens, _ = sample(torch.tensor([LOGITS] * len(rows)), rows, torch.Generator().manual_seed(3))
    for parity, kw in ((0, dict(temperature=2.0)), (1, dict(top_k=2))):
        counts = [0] * VOCAB
        for t in tokens[parity::2]:
            counts[t] += 1
        assert_fits(counts, ref_distribution(LOGITS, **kw))


def test_truncated_tokens_never_drawn_when_nearly_tied():
    """Top-2 of near-equal logits: the other six tokens hold 3/4 of the raw mass yet never appear."""
    logits = [3.0, 2.99, 2.98, 2.97, 2.96, 2.95, 2.94, 2.93]
    counts = draw_counts(SamplingParams(top_k=2), logits, n=5000)
    assert {t for t, c in enumerate(counts) if c} == {0, 1}


# ---- greedy ---------------------------------------------------------------------------------

def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [0], [], None) for _ in range(64)]
    tokens, _ = sample(logits, rows, gen)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_greedy_ignores_top_k_top_p_min_p_and_rng():
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.3, min_p=0.9)
    row = SamplingRow(params, [0], [], None)
    for seed in range(5):
        tokens, _ = sample(torch.tensor([LOGITS] * 3), [row] * 3, torch.Generator().manual_seed(seed))
        assert tokens == [1, 1, 1]


def test_greedy_and_random_rows_in_one_batch():
    greedy, rnd = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)
    rows = [SamplingRow(greedy if i % 2 else rnd, [0], [], None) for i in range(4000)]
    tokens, _ = sample(torch.tensor([LOGITS] * len(rows)), rows, torch.Generator().manual_seed(0))
    assert set(tokens[1::2]) == {1}
    assert set(tokens[0::2]) == {1, 5}  # top-2 of a random row: both get drawn


# ---- seeds ----------------------------------------------------------------------------------

def _seeded_draw(seed: int, out_len: int, neighbours: list[SamplingRow], at: int,
                 gen_seed: int, logits: list[float] = LOGITS, output: list[int] | None = None) -> int:
    target = SamplingRow(SamplingParams(temperature=1.0, seed=seed), [3, 4],
                         output if output is not None else [0] * out_len, None)
    rows = neighbours[:at] + [target] + neighbours[at:]
    flat = [1.0] * VOCAB
    batch = [flat] * at + [logits] + [flat] * (len(rows) - at - 1)
    tokens, _ = sample(torch.tensor(batch), rows, torch.Generator().manual_seed(gen_seed))
    return tokens[at]


def test_seeded_rows_reproduce_and_ignore_batch_composition():
    others = [
        SamplingRow(SamplingParams(temperature=1.0), [5], [1, 2], None),
        SamplingRow(SamplingParams(temperature=0.7, seed=99), [5], [1], None),
        SamplingRow(SamplingParams(temperature=0.0), [5], [], None),
        SamplingRow(SamplingParams(top_k=2, top_p=0.5), [5], [1, 2, 3], None),
        SamplingRow(SamplingParams(temperature=1.0, seed=1), [5], [1, 2, 3, 4, 5], None),
    ]
    seen = set()
    for seed in range(12):
        for out_len in (0, 1, 7):
            alone = _seeded_draw(seed, out_len, [], 0, gen_seed=0)
            assert _seeded_draw(seed, out_len, [], 0, gen_seed=0) == alone
            assert _seeded_draw(seed, out_len, [], 0, gen_seed=123) == alone
            assert _seeded_draw(seed, out_len, others, 0, gen_seed=5) == alone
            assert _seeded_draw(seed, out_len, others, 3, gen_seed=6) == alone
            assert _seeded_draw(seed, out_len, others, 5, gen_seed=7) == alone
            seen.add(alone)
    assert len(seen) >= 3  # the seed really changes the draw


def test_seeded_draw_depends_on_position_not_on_output_contents():
    a = _seeded_draw(11, 0, [], 0, 0, output=[1, 2, 3, 4])
    b = _seeded_draw(11, 0, [], 0, 0, output=[7, 7, 7, 7])
    assert a == b
    draws = {_seeded_draw(11, k, [], 0, 0) for k in range(40)}
    assert len(draws) >= 3  # a fresh draw at each output position, not one frozen token


def test_seeded_draws_follow_the_distribution():
    """Across seeds and output positions, seeded draws are still samples of the right distribution."""
    outputs = [[0] * k for k in range(100)]
    rows = [SamplingRow(SamplingParams(temperature=2.0, top_k=6, seed=s), [0], out, None)
            for s in range(100) for out in outputs]
    counts = [0] * VOCAB
    tokens, _ = sample(torch.tensor([LOGITS] * len(rows)), rows, None)
    for t in tokens:
        counts[t] += 1
    assert_fits(counts, ref_distribution(LOGITS, temperature=2.0, top_k=6))


def test_unseeded_rows_follow_the_generator():
    row = SamplingRow(SamplingParams(temperature=1.0), [0], [], None)
    logits = torch.tensor([LOGITS] * 200)
    a, _ = sample(logits, [row] * 200, torch.Generator().manual_seed(42))
    b, _ = sample(logits, [row] * 200, torch.Generator().manual_seed(42))
    c, _ = sample(logits, [row] * 200, torch.Generator().manual_seed(43))
    assert a == b
    assert a != c


# ---- logit bias and penalties ---------------------------------------------------------------

def _greedy(logits: list[float], prompt: list[int], output: list[int], **kw) -> int:
    row = SamplingRow(SamplingParams(temperature=0.0, **kw), prompt, output, None)
    tokens, _ = sample(torch.tensor([logits]), [row])
    return tokens[0]


def test_logit_bias_adds_to_logits():
    logits = [1.0, 2.0, 0.0, 0.5]
    assert _greedy(logits, [0], [], logit_bias={0: 0.9}) == 1
    assert _greedy(logits, [0], [], logit_bias={0: 1.1}) == 0
    assert _greedy(logits, [0], [], logit_bias={1: -5.0}) == 0
    assert _greedy(logits, [0], [], logit_bias={2: 100.0}) == 2
    assert _greedy(logits, [0], [], logit_bias={1: -1.6, 3: 1.0}) == 3


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # Positive seen logit: 2.0 / 2 = 1.0 < 1.1 (multiplying instead would keep it on top).
    assert _greedy([2.0, 1.1, 0.0], [0], [], repetition_penalty=2.0) == 1
    assert _greedy([2.0, 0.9, 0.0], [0], [], repetition_penalty=2.0) == 0
    # Negative seen logit: -1.0 * 2 = -2.0 < -1.5 (dividing instead would give -0.5 and keep it on top).
    assert _greedy([-1.0, -1.5, -3.0], [0], [], repetition_penalty=2.0) == 1
    assert _greedy([-1.0, -2.5, -3.0], [0], [], repetition_penalty=2.0) == 0
    # A penalty below 1 rewards seen tokens the same way round.
    assert _greedy([1.0, 1.5, -3.0], [2], [0], repetition_penalty=0.5) == 0


def test_repetition_penalty_covers_prompt_and_output_only():
    logits = [2.0, 1.9, 1.8, -5.0]
    assert _greedy(logits, [0], [], repetition_penalty=1.5) == 1     # prompt token penalised
    assert _greedy(logits, [3], [0], repetition_penalty=1.5) == 1    # output token penalised
    assert _greedy(logits, [0], [1], repetition_penalty=1.5) == 2    # both penalised
    assert _greedy(logits, [3], [3], repetition_penalty=1.5) == 0    # unseen tokens untouched


def test_frequency_penalty_scales_with_output_count_and_ignores_prompt():
    logits = [3.0, 2.5, 0.0]
    out = [0, 0, 0]  # 3 - 3 * f: f = 0.15 -> 2.55 > 2.5, f = 0.2 -> 2.4 < 2.5
    assert _greedy(logits, [2], out, frequency_penalty=0.15) == 0
    assert _greedy(logits, [2], out, frequency_penalty=0.2) == 1
    assert _greedy(logits, [0, 0, 0, 0], [2], frequency_penalty=2.0) == 0  # prompt occurrences don't count
    assert _greedy([1.0, 2.0, 0.0], [2], [1, 1], frequency_penalty=-0.5) == 1  # negative rewards


def test_presence_penalty_is_flat_for_any_count_in_output():
    logits = [3.0, 2.5, 0.0]
    assert _greedy(logits, [2], [0], presence_penalty=0.4) == 0
    assert _greedy(logits, [2], [0], presence_penalty=0.6) == 1
    assert _greedy(logits, [2], [0] * 10, presence_penalty=0.4) == 0  # count does not matter
    assert _greedy(logits, [0], [2], presence_penalty=2.0) == 0      # prompt does not count


def test_penalised_distribution_matches_vllm_definition():
    prompt, output = [1, 2], [3, 3, 5, 6]
    kw = dict(logit_bias={2: 1.0, 7: 2.0}, repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.5)
    z = ref_processed_logits(LOGITS, prompt, output, **kw)
    assert_fits(draw_counts(SamplingParams(**kw), prompt=prompt, output=output, n=10_000), ref_softmax(z))


def test_penalties_and_bias_do_not_leak_to_other_rows():
    pen = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=10.0, logit_bias={4: 100.0}), [1], [1], None)
    plain = SamplingRow(SamplingParams(temperature=0.0), [1], [1], None)
    tokens, _ = sample(torch.tensor([LOGITS] * 3), [plain, pen, plain])
    assert tokens == [1, 4, 1]


# ---- min_tokens / EOS / stop tokens ---------------------------------------------------------

EOS = 1  # the top logit, so masking it is visible


def _probs_after_processors(params: SamplingParams, output: list[int], eos: int | None = EOS) -> list[float]:
    counts = draw_counts(params, output=output, eos=eos, n=4000)
    return [c / 4000 for c in counts]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    for k in range(3):
        assert _greedy_eos(params, [0] * k) == 3, k  # 1 (EOS) and 5 (stop id) are masked
    assert _greedy_eos(params, [0] * 3) == EOS
    freq = _probs_after_processors(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[5]), [7])
    assert freq[EOS] == 0 and freq[5] == 0
    freq = _probs_after_processors(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[5]), [7, 7])
    assert freq[EOS] > 0.2 and freq[5] > 0.1


def _greedy_eos(params: SamplingParams, output: list[int], eos: int | None = EOS) -> int:
    tokens, _ = sample(torch.tensor([LOGITS]), [SamplingRow(params, [0], output, eos)])
    return tokens[0]


def test_min_tokens_with_ignore_eos_masks_only_stop_tokens():
    params = SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True, stop_token_ids=[5])
    assert _greedy_eos(params, []) == EOS
    params = SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True, stop_token_ids=[1])
    assert _greedy_eos(params, []) == 5  # an explicit stop id is masked even when it is the EOS id


def test_no_min_tokens_masks_nothing():
    assert _greedy_eos(SamplingParams(temperature=0.0, stop_token_ids=[1]), []) == EOS


# ---- logprobs -------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ranks():
    raw = torch.tensor([LOGITS, [v * 0.5 for v in reversed(LOGITS)]], dtype=torch.float32)
    ref = [torch.log_softmax(r.double(), dim=-1) for r in raw]
    # Heavy processing that must not show in the reported logprobs.
    params = SamplingParams(temperature=0.3, top_k=2, logprobs=3, repetition_penalty=1.7, presence_penalty=1.0,
                            logit_bias={4: 3.0})
    rows = [SamplingRow(params, [1, 2], [5, 5], None), SamplingRow(params, [0], [], None)]
    for seed in range(20):
        tokens, lps = sample(raw, rows, torch.Generator().manual_seed(seed))
        for i, (tok, lp) in enumerate(zip(tokens, lps)):
            ids, values, ranks = lp
            assert ids[0] == tok
            assert values[0] == pytest.approx(float(ref[i][tok]), abs=1e-5)
            assert ranks[0] == 1 + int((ref[i] > ref[i][tok]).sum())
            top = ref[i].topk(3)
            assert ids[1:] == top.indices.tolist()
            assert values[1:] == pytest.approx(top.values.tolist(), abs=1e-5)
            assert ranks[1:] == [1, 2, 3]


def test_logprobs_zero_gives_only_the_chosen_token_and_none_when_unasked():
    row0 = SamplingRow(SamplingParams(temperature=0.0, logprobs=0), [0], [], None)
    row_none = SamplingRow(SamplingParams(temperature=0.0), [0], [], None)
    tokens, lps = sample(torch.tensor([LOGITS, LOGITS]), [row0, row_none])
    ids, values, ranks = lps[0]
    assert ids == [1] and ranks == [1]
    assert values[0] == pytest.approx(math.log(ref_softmax(LOGITS)[1]), abs=1e-5)
    assert lps[1] is None


def test_logprob_rank_of_a_sampled_low_token():
    params = SamplingParams(temperature=1.0, logprobs=2, logit_bias={4: 50.0})  # forces token 4, ranked last raw
    tokens, lps = sample(torch.tensor([LOGITS]), [SamplingRow(params, [0], [], None)],
                         torch.Generator().manual_seed(0))
    assert tokens == [4]
    ids, values, ranks = lps[0]
    assert ids == [4, 1, 5] and ranks == [VOCAB, 1, 2]
    assert values[0] == pytest.approx(math.log(ref_softmax(LOGITS)[4]), abs=1e-5)
