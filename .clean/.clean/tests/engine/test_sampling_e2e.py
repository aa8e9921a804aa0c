"""Sampling parameters end to end through `LLM.generate` on the tiny random-weight llama (fp32).

The tiny model's next-token distribution is nearly flat, so sampled outputs differ a lot between
seeds; EOS and stop tokens are forced with logit_bias where a test needs them to be likely.
"""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams

PROMPT = "Hello world, here is a prompt"
OTHER_PROMPTS = ["The quick brown fox", "def f(x):\n    return", "世界 🙂 é", "a"] + [
    {"prompt_token_ids": p} for p in random_prompts(4, low=3, high=30, seed=7)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.1)


@pytest.fixture(scope="module")
def eos(llm) -> int:
    eos = llm.get_tokenizer().eos_token_id
    assert eos is not None
    return eos


def gen(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def one(llm: LLM, params: SamplingParams, prompt=PROMPT):
    return gen(llm, [prompt], params)[0].outputs[0]


@pytest.fixture(scope="module")
def greedy16(llm):
    """A greedy reference continuation to pick stop strings / stop tokens from."""
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    return out


# ---- seeds ----------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)


def test_seeded_request_reproduces_across_runs(llm):
    a, b = one(llm, SEEDED), one(llm, SEEDED)
    assert a.token_ids == b.token_ids and a.text == b.text
    c = one(llm, SEEDED.clone(seed=4321))
    assert c.token_ids != a.token_ids  # the seed matters


def test_seeded_request_ignores_batch_composition(llm):
    alone = one(llm, SEEDED).token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=6 + i, ignore_eos=True, seed=None if i % 2 else i)
              for i in range(len(OTHER_PROMPTS))]
    others[3] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = OTHER_PROMPTS[:4] + [PROMPT] + OTHER_PROMPTS[4:]
    params = others[:4] + [SEEDED] + others[4:]
    outs = gen(llm, prompts, params)
    assert outs[4].outputs[0].token_ids == alone
    # ...and placed first, with the others reordered.
    outs = gen(llm, [PROMPT] + OTHER_PROMPTS[::-1], [SEEDED] + others[::-1])
    assert outs[0].outputs[0].token_ids == alone


def test_unseeded_requests_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert one(llm, params).token_ids != one(llm, params).token_ids


# ---- n > 1 ----------------------------------------------------------------------------------

def test_n_returns_n_distinct_indexed_samples(llm):
    out = gen(llm, [PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_n_with_seed_reproduces(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=5, ignore_eos=True)
    a = [c.token_ids for c in gen(llm, [PROMPT], params)[0].outputs]
    b = [c.token_ids for c in gen(llm, [PROMPT], params)[0].outputs]
    assert a == b and len({tuple(t) for t in a}) == 3


def test_n_greedy_samples_agree(llm, greedy16):
    out = gen(llm, [PROMPT], SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.token_ids == greedy16.token_ids for c in out.outputs)


# ---- stop strings ---------------------------------------------------------------------------

def _boundary_stop(llm, greedy) -> tuple[str, int, int]:
    """A stop string straddling a token boundary of the greedy text, occurring there first.
    Returns (stop, its start in the text, index of the token that completes it)."""
    tok = llm.get_tokenizer()
    text = greedy.text
    for k in range(2, len(greedy.token_ids) - 1):
        cut = len(tok.decode(greedy.token_ids[:k]))
        nxt = len(tok.decode(greedy.token_ids[:k + 1]))
        if cut >= 2 and nxt - cut >= 2:
            stop = text[cut - 2:cut + 2]
            if text.find(stop) == cut - 2 and stop.strip():
                return stop, cut - 2, k
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_output_and_reports_stop(llm, greedy16):
    stop, at, k = _boundary_stop(llm, greedy16)
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == greedy16.text[:at]
    assert stop not in out.text
    assert out.token_ids == greedy16.token_ids[:k + 1]  # generation ends on the completing token


def test_include_stop_str_in_output(llm, greedy16):
    stop, at, k = _boundary_stop(llm, greedy16)
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop,
                                  include_stop_str_in_output=True))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == greedy16.text[:at + len(stop)]
    assert out.text.endswith(stop)


def test_absent_stop_string_does_not_stop(llm, greedy16):
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=["\x00never\x00"]))
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == greedy16.text and out.token_ids == greedy16.token_ids


def test_streamed_outputs_never_show_the_stop_string(llm, greedy16):
    stop, at, _ = _boundary_stop(llm, greedy16)
    engine = llm.engine
    engine.add_request("stream-stop", PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                              stop=[stop]))
    texts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            if out.finished:
                final = out.outputs[0]
    assert final is not None and final.text == greedy16.text[:at]
    for t in texts:
        assert final.text.startswith(t) and stop not in t


# ---- stop tokens, EOS, lengths --------------------------------------------------------------

def _fresh_token(greedy) -> tuple[int, int]:
    """A greedy token (and its index >= 2) that does not occur earlier in the output."""
    for i in range(2, len(greedy.token_ids)):
        if greedy.token_ids[i] not in greedy.token_ids[:i]:
            return greedy.token_ids[i], i
    pytest.fail("no fresh token")


def test_stop_token_ids(llm, greedy16):
    st, i = _fresh_token(greedy16)
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[st]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == st
    assert out.token_ids == greedy16.token_ids[:i + 1]


def test_stop_token_text_is_not_in_output_text(llm, greedy16, eos):
    tok = llm.get_tokenizer()
    st, i = _fresh_token(greedy16)
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[st]))
    assert out.text == tok.decode(greedy16.token_ids[:i])
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[st],
                                  include_stop_str_in_output=True))
    assert out.text == tok.decode(greedy16.token_ids[:i + 1])
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=2,
                                  skip_special_tokens=False))
    assert out.token_ids[-1] == eos and tok.eos_token not in out.text


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_gives_length_with_exactly_that_many_tokens(llm, max_tokens):
    for params in (SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True)):
        out = one(llm, params)
        assert out.finish_reason == "length" and out.stop_reason is None
        assert len(out.token_ids) == max_tokens


def test_forced_eos_stops_immediately(llm, eos):
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0}))
    assert out.token_ids == [eos]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == ""


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_delays_eos(llm, eos, temperature):
    out = one(llm, SamplingParams(temperature=temperature, seed=3, max_tokens=10, min_tokens=5,
                                  logit_bias={eos: 100.0}))
    assert len(out.token_ids) == 6
    assert eos not in out.token_ids[:5] and out.token_ids[5] == eos
    assert out.finish_reason == "stop"


def test_min_tokens_delays_stop_token_ids(llm, greedy16):
    st, _ = _fresh_token(greedy16)
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[st],
                                  logit_bias={st: 100.0}, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.token_ids[3] == st and st not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == st


def test_min_tokens_delays_stop_strings(llm, greedy16):
    tok = llm.get_tokenizer()
    early = tok.decode(greedy16.token_ids[:2])
    stop = early[-3:]
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, ignore_eos=True, stop=[stop]))
    assert len(out.token_ids) >= 6


def test_ignore_eos_keeps_generating(llm, eos):
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={eos: 100.0}))
    assert out.token_ids == [eos] * 5
    assert out.finish_reason == "length"


# ---- logprobs -------------------------------------------------------------------------------

def _check_logprobs(llm, out, n: int) -> None:
    tok = llm.get_tokenizer()
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token, position in zip(out.token_ids, out.logprobs):
        assert n <= len(position) <= n + 1
        assert token in position
        ranked = sorted((lp for t, lp in position.items() if lp.rank <= n), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == list(range(1, n + 1))
        values = [lp.logprob for lp in ranked]
        assert values == sorted(values, reverse=True)
        chosen = position[token]
        assert chosen.logprob <= 0.0
        if chosen.rank > n:
            assert chosen.logprob <= values[-1]
        for t, lp in position.items():
            assert lp.decoded_token == tok.decode([t])
        total += chosen.logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_logprobs_greedy(llm):
    out = one(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3))
    _check_logprobs(llm, out, 3)
    for token, position in zip(out.token_ids, out.logprobs):
        assert len(position) == 3 and position[token].rank == 1


def test_logprobs_sampled(llm):
    out = one(llm, SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True, logprobs=3))
    _check_logprobs(llm, out, 3)
    assert any(len(p) == 4 for p in out.logprobs)  # a flat model rarely samples from its top 3


def test_logprobs_are_the_models_raw_distribution(llm):
    """Temperature, penalties and truncation change what is drawn, not the reported logprobs."""
    plain = one(llm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5))
    forced = one(llm, SamplingParams(temperature=0.3, top_k=2, max_tokens=1, ignore_eos=True, logprobs=5,
                                     repetition_penalty=1.5, seed=1))
    first_plain, first_forced = plain.logprobs[0], forced.logprobs[0]
    top = {t: lp.logprob for t, lp in first_plain.items() if lp.rank <= 5}
    for t, lp in first_forced.items():
        if lp.rank <= 5:
            assert top[t] == pytest.approx(lp.logprob, abs=1e-4)


def test_logprobs_zero_gives_only_the_chosen_token(llm):
    out = one(llm, SamplingParams(temperature=1.0, seed=2, max_tokens=4, ignore_eos=True, logprobs=0))
    for token, position in zip(out.token_ids, out.logprobs):
        assert list(position) == [token]
    assert one(llm, SamplingParams(temperature=0.0, max_tokens=2)).logprobs is None
