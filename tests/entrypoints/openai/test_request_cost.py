"""Admission by cost for `stop` and `logit_bias` (issue 41, docs/LIMITS.md): over a limit, a 400 naming the field
and the limit before anything is queued; at the limit, an answer. And the work they make stays bounded: a
request's logit_bias becomes tensors once, not at every step."""
from __future__ import annotations

import httpx
import pytest
import torch
from pydantic import ValidationError

from pressroom.entrypoints.openai.protocol import (
    MAX_LOGIT_BIAS_X_N,
    MAX_STOP_CHARS,
    MAX_STOP_CHARS_X_N,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
)
from pressroom.sampling_params import SamplingParams
from pressroom.worker import sampler
from pressroom.worker.sampler import SamplingRow, sample

MESSAGES = [{"role": "user", "content": "hi"}]


def refusal(model, **fields) -> tuple[str, str]:
    """(field, message) of the request's first validation error."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(fields)
    first = e.value.errors()[0]
    return ".".join(map(str, first["loc"])), first["msg"]


# ---- the limits, on the request bodies --------------------------------------------------------

@pytest.mark.parametrize("model, base", [(ChatCompletionRequest, {"messages": MESSAGES}),
                                         (CompletionRequest, {"prompt": "hi"})])
def test_too_many_stop_strings_name_the_field_and_limit(model, base):
    field, message = refusal(model, **base, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert field == "stop" and str(MAX_STOP_STRINGS) in message


def test_stop_characters_over_the_limit():
    stop = ["x" * (MAX_STOP_CHARS // 2)] * 2 + ["y"]  # one character past the limit
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, stop=stop)
    assert field == "stop" and str(MAX_STOP_CHARS) in message
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, "stop": stop[:2]}).stop == stop[:2]


def test_stop_characters_times_n_over_the_limit():
    n = 128
    stop = ["x" * (MAX_STOP_CHARS_X_N // n // 2)] * 2 + ["y"]  # one character past the limit at this n
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, n=n, stop=stop)
    assert field == "stop" and str(MAX_STOP_CHARS_X_N) in message and f"n={n}" in message
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": n, "stop": stop[:2]}).stop == stop[:2]


def test_a_single_stop_string_counts_its_characters():
    field, _ = refusal(CompletionRequest, prompt="hi", stop="z" * (MAX_STOP_CHARS + 1))
    assert field == "stop"


def test_logit_bias_entries_times_n_over_the_limit():
    n = 128
    bias = {str(t): 1.0 for t in range(MAX_LOGIT_BIAS_X_N // n + 1)}
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, n=n, logit_bias=bias)
    assert field == "logit_bias" and str(MAX_LOGIT_BIAS_X_N) in message
    del bias["0"]
    assert len(ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": n, "logit_bias": bias}).logit_bias) \
        == MAX_LOGIT_BIAS_X_N // n


def test_real_requests_pass():
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": 4, "stop": ["\n\n", "User:", "</s>"],
                                                "logit_bias": {"50256": -100}})
    assert req.to_sampling_params(16).stop_strings == ["\n\n", "User:", "</s>"]


# ---- over HTTP ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * 1000] * 21}, "stop"),
    ({"n": 101, "stop": ["x" * 2000]}, "stop"),
    ({"n": 7, "logit_bias": {str(t): 0.5 for t in range(49_152)}}, "logit_bias"),
])
def test_server_answers_400_naming_the_field(tiny_server, body, field):
    r = httpx.post(f"{tiny_server}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_server_answers_at_the_limits(tiny_server):
    """1,000 stop strings at the characters' limits, and a whole-vocabulary bias at n=6, are served."""
    n = MAX_STOP_CHARS_X_N // MAX_STOP_CHARS
    stop = [f"{i:04d}" + "q" * (MAX_STOP_CHARS // MAX_STOP_STRINGS - 4) for i in range(MAX_STOP_STRINGS)]
    r = httpx.post(f"{tiny_server}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "n": n, "stop": stop})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == n
    bias = {str(t): 0.0 for t in range(49_152)}
    bias["42"] = 100.0
    r = httpx.post(f"{tiny_server}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 6, "logit_bias": bias})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 6


# ---- the sampler's bias: made once per request, added per step ---------------------------------

def test_a_rows_own_bias_tensors_are_the_ones_added():
    """A request's state makes its bias tensors once (sampler.bias_tensors); each step adds those."""
    params = SamplingParams(temperature=0.0, logit_bias={3: 50.0, 5: -50.0})
    made = sampler.bias_tensors(params.logit_bias, "cpu")
    row = SamplingRow(params, [1, 2], [], None, made)
    logits = torch.zeros(2, 8)
    logits[:, 5] = 10.0
    tokens, _ = sample(logits, [row, row])
    assert tokens == [3, 3]
    assert logits[0, 5] == 10.0  # the caller's logits are left as they were
    made[1][0] = -50.0  # the row's tensors, not the dict, are what the sampler adds
    assert sample(logits[:1], [row])[0] == [0]


def test_logit_bias_adds_exactly_what_the_plain_add_did():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=gen)
    biases = [{t: float(t) / 7 for t in range(0, 64, 3)}, None, {63: -1.5, 0: 2.25}]
    rows = [SamplingRow(SamplingParams(temperature=0.0, logit_bias=b), [], [], None) for b in biases]
    out = sampler._apply_processors(logits, rows)
    expected = logits.clone()
    for i, bias in enumerate(biases):
        for t, v in (bias or {}).items():
            expected[i, t] += v
    assert torch.equal(out, expected)
