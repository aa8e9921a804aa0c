"""Admission by cost (issue 41, docs/LIMITS.md): every limit of AdmissionLimits (limits.py) refuses a request over it
with a 400 naming the field, the limit and the flag that raises it, and admits one at it; a server started with a
raised flag serves what the default refused. And the work they make stays bounded: a request's logit_bias becomes
tensors once, not at every step."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from pydantic import ValidationError

from pressroom.entrypoints.cli import build_parser
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.limits import AdmissionLimits, OverLimit, RequestCost, flag, judge
from pressroom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from pressroom.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pressroom.entrypoints.openai.settings import ServerSettings
from pressroom.sampling_params import SamplingParams
from pressroom.worker import sampler
from pressroom.worker.sampler import SamplingRow, sample

MESSAGES = [{"role": "user", "content": "hi"}]
LIMITS = AdmissionLimits()
MAX_STOP_STRINGS, MAX_STOP_CHARS = LIMITS.max_stop_strings, LIMITS.max_stop_chars
MAX_STOP_CHARS_X_N, MAX_LOGIT_BIAS_X_N = LIMITS.max_stop_chars_x_n, LIMITS.max_logit_bias_x_n
DOCS = Path(__file__).resolve().parents[3] / "docs" / "LIMITS.md"


def refusal(model, limits: AdmissionLimits = LIMITS, **fields) -> tuple[str, str]:
    """(field, message) of the body's refusal by `limits`."""
    with pytest.raises(OverLimit) as e:
        judge(model.model_validate(fields).cost(), limits)
    return e.value.param, str(e.value)


def admitted(model, limits: AdmissionLimits = LIMITS, **fields):
    req = model.model_validate(fields)
    judge(req.cost(), limits)
    return req


def token_refusal(req, prompt_lens: list[int], max_model_len: int, limits: AdmissionLimits) -> tuple[str, str]:
    with pytest.raises(OverLimit) as e:
        judge(req.tokens_cost(prompt_lens, max_model_len), limits)
    return e.value.param, str(e.value)


# ---- stop and logit_bias, on the request bodies ------------------------------------------------

@pytest.mark.parametrize("model, base", [(ChatCompletionRequest, {"messages": MESSAGES}),
                                         (CompletionRequest, {"prompt": "hi"})])
def test_too_many_stop_strings_name_the_field_and_limit(model, base):
    field, message = refusal(model, **base, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert field == "stop" and str(MAX_STOP_STRINGS) in message and "--max-stop-strings" in message
    admitted(model, **base, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])


def test_stop_characters_over_the_limit():
    stop = ["x" * (MAX_STOP_CHARS // 2)] * 2 + ["y"]  # one character past the limit
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, stop=stop)
    assert field == "stop" and str(MAX_STOP_CHARS) in message and "--max-stop-chars " in message
    assert admitted(ChatCompletionRequest, messages=MESSAGES, stop=stop[:2]).stop == stop[:2]


def test_stop_characters_times_n_over_the_limit():
    n = 128
    stop = ["x" * (MAX_STOP_CHARS_X_N // n // 2)] * 2 + ["y"]  # one character past the limit at this n
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, n=n, stop=stop)
    assert field == "stop" and str(MAX_STOP_CHARS_X_N) in message and f"n={n}" in message
    assert "--max-stop-chars-x-n" in message
    assert admitted(ChatCompletionRequest, messages=MESSAGES, n=n, stop=stop[:2]).stop == stop[:2]


def test_a_single_stop_string_counts_its_characters():
    field, _ = refusal(CompletionRequest, prompt="hi", stop="z" * (MAX_STOP_CHARS + 1))
    assert field == "stop"


def test_logit_bias_entries_times_n_over_the_limit():
    n = 128
    bias = {str(t): 1.0 for t in range(MAX_LOGIT_BIAS_X_N // n + 1)}
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, n=n, logit_bias=bias)
    assert field == "logit_bias" and str(MAX_LOGIT_BIAS_X_N) in message and "--max-logit-bias-x-n" in message
    del bias["0"]
    assert len(admitted(ChatCompletionRequest, messages=MESSAGES, n=n, logit_bias=bias).logit_bias) \
        == MAX_LOGIT_BIAS_X_N // n


def test_real_requests_pass():
    req = admitted(ChatCompletionRequest, messages=MESSAGES, n=4, stop=["\n\n", "User:", "</s>"],
                   logit_bias={"50256": -100})
    assert req.to_sampling_params(16).stop_strings == ["\n\n", "User:", "</s>"]


# ---- n, prompts and sequences -------------------------------------------------------------------

def test_n_over_the_limit():
    field, message = refusal(ChatCompletionRequest, messages=MESSAGES, n=LIMITS.max_n + 1)
    assert field == "n" and str(LIMITS.max_n) in message and "--max-n " in message
    admitted(CompletionRequest, prompt="hi", n=LIMITS.max_n)
    with pytest.raises(ValidationError):  # past int64: pydantic's 400, before any limit
        CompletionRequest.model_validate({"prompt": "hi", "n": 1 << 70})


@pytest.mark.parametrize("model, base, field", [
    (EmbeddingRequest, lambda k: {"input": ["a"] * k}, "input"),
    (EmbeddingRequest, lambda k: {"input": [[1, 2]] * k}, "input"),
    (ScoreRequest, lambda k: {"text_1": "q", "text_2": ["d"] * (k - 1)}, "text_2"),
    (ScoreRequest, lambda k: {"text_1": ["q"] * (k - k // 2), "text_2": ["d"] * (k // 2)}, "text_1"),
    (RerankRequest, lambda k: {"query": "q", "documents": ["d"] * (k - 1)}, "documents"),
])
def test_prompts_per_request_over_the_limit(model, base, field):
    limit = LIMITS.max_prompts_per_request
    got, message = refusal(model, **base(limit + 1))
    assert got == field and str(limit) in message and "--max-prompts-per-request" in message
    admitted(model, **base(limit))


def test_one_text_or_one_token_list_is_one_prompt():
    assert EmbeddingRequest.model_validate({"input": "a b c"}).cost().prompts == 1
    assert EmbeddingRequest.model_validate({"input": [1, 2, 3]}).cost().prompts == 1
    assert CompletionRequest.model_validate({"prompt": [[1], [2], [3]]}).cost().prompts == 3


def test_sequences_per_request_over_the_limit():
    """prompts x n: 9 prompts at n=128 are 1,152 sequences (and one prompt at n=1,025 when --max-n allows it)."""
    field, message = refusal(CompletionRequest, prompt=["x"] * 9, n=128)
    assert field == "prompt" and "1024" in message and "--max-sequences-per-request" in message
    admitted(CompletionRequest, prompt=["x"] * 8, n=128)
    wide = AdmissionLimits(max_n=4096)
    field, message = refusal(ChatCompletionRequest, wide, messages=MESSAGES, n=1025)
    assert field == "n" and "--max-sequences-per-request" in message
    admitted(ChatCompletionRequest, wide, messages=MESSAGES, n=1024)


# ---- tokens: the prompts' and the output budget, times n ----------------------------------------

def test_prompt_tokens_times_n_over_the_limit():
    per_sample = LIMITS.max_prompt_tokens_x_n // 128  # a 32k prompt at n=128 is at the limit
    req = CompletionRequest.model_validate({"prompt": "x", "n": 128, "max_tokens": 1})
    field, message = token_refusal(req, [per_sample + 1], 1 << 20, LIMITS)
    assert field == "prompt" and str(LIMITS.max_prompt_tokens_x_n) in message and "--max-prompt-tokens-x-n" in message
    judge(req.tokens_cost([per_sample], 1 << 20), LIMITS)
    small = AdmissionLimits(max_prompt_tokens_x_n=100)
    prompts = CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert token_refusal(prompts, [30, 21], 2048, small)[0] == "prompt"  # (30 + 21) x 2 = 102
    judge(prompts.tokens_cost([30, 20], 2048), small)
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": 2, "max_tokens": 1})
    assert token_refusal(chat, [51], 2048, small)[0] == "messages"


def test_output_tokens_times_n_over_the_limit():
    """max_tokens x prompts x n, from the body when max_tokens is given; else what is left of each prompt's
    context, once tokenized (what the engine would let it generate)."""
    limit = LIMITS.max_output_tokens_x_n
    two = {"prompt": ["a", "b"], "n": 128}
    field, message = refusal(CompletionRequest, **two, max_tokens=limit // 256 + 1)
    assert field == "max_tokens" and str(limit) in message and "--max-output-tokens-x-n" in message
    admitted(CompletionRequest, **two, max_tokens=limit // 256)
    small = AdmissionLimits(max_output_tokens_x_n=100)
    assert refusal(ChatCompletionRequest, small, messages=MESSAGES, n=2, max_completion_tokens=51)[0] \
        == "max_completion_tokens"
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "n": 2})  # no max_tokens: the rest
    judge(chat.cost(), small)
    assert token_refusal(chat, [55], 106, small)[0] == "max_tokens"  # 51 left x 2
    judge(chat.tokens_cost([56], 106), small)


# ---- the grammar --------------------------------------------------------------------------------

def _schema_of_length(chars: int) -> dict:
    schema = {"description": ""}
    schema["description"] = "x" * (chars - len(json.dumps(schema)))
    return schema


@pytest.mark.parametrize("over, under, field", [
    ({"structured_outputs": {"regex": "a" * 65537}}, {"structured_outputs": {"regex": "a" * 65536}},
     "structured_outputs"),
    ({"structured_outputs": {"grammar": "r" * 65537}}, {"structured_outputs": {"grammar": "r" * 65536}},
     "structured_outputs"),
    ({"structured_outputs": {"json": _schema_of_length(65537)}},
     {"structured_outputs": {"json": _schema_of_length(65536)}}, "structured_outputs"),
    ({"structured_outputs": {"json": "s" * 65537}}, {"structured_outputs": {"json": "s" * 65536}},
     "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": _schema_of_length(65537)}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": _schema_of_length(65536)}}},
     "response_format"),
])
def test_grammar_over_the_limit(over, under, field):
    assert LIMITS.max_grammar_chars == 65536
    got, message = refusal(ChatCompletionRequest, messages=MESSAGES, **over)
    assert got == field and "65536" in message and "--max-grammar-chars" in message
    admitted(ChatCompletionRequest, messages=MESSAGES, **under)


def test_choices_count_as_the_grammar_they_make():
    """`choice` becomes one EBNF alternation of JSON string literals: its length is what is judged."""
    choices = ["y" * 100] * 650  # "root ::= " and 650 literals of 102 characters between 649 " | ": 68,256
    field, _ = refusal(ChatCompletionRequest, messages=MESSAGES, structured_outputs={"choice": choices})
    assert field == "structured_outputs"
    admitted(ChatCompletionRequest, messages=MESSAGES, structured_outputs={"choice": choices[:600]})  # 63,006


# ---- the limits themselves, their flags and their table -----------------------------------------

def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="--max-n "):
        AdmissionLimits(max_n=0)
    with pytest.raises(ValueError, match="--max-grammar-compile-seconds"):
        AdmissionLimits(max_grammar_compile_seconds=0)


def test_every_limit_is_a_serve_flag_with_its_default():
    args = build_parser().parse_args(["serve", "m", "--max-stop-chars", "40000", "--max-prompt-tokens-x-n", "7"])
    limits = ServerSettings.from_args(args).admission_limits
    assert limits == dataclasses.replace(LIMITS, max_stop_chars=40000, max_prompt_tokens_x_n=7)
    defaults = ServerSettings.from_args(build_parser().parse_args(["serve", "m"])).admission_limits
    assert defaults == LIMITS == ServerSettings().admission_limits


def test_the_docs_table_names_every_flag():
    table = DOCS.read_text()
    for f in dataclasses.fields(AdmissionLimits):
        assert f"`{flag(f.name)}`" in table, f.name


def test_pooling_judges_its_inputs_tokens():
    """The pooling routes judge their inputs' tokens once tokenized (one count for every input)."""
    async def run(fn, *_):
        return fn()
    engine = SimpleNamespace(tokenizer=object(), tokenize_prompt=lambda text: (text, [7] * len(text)),
                             max_model_len=1000)
    limits = AdmissionLimits(max_prompt_tokens_x_n=5)
    pooling = OpenAIServingPooling(engine, ["m"], None, 1 << 20, SimpleNamespace(run=run), limits)
    cost = RequestCost(prompts=2, prompts_param="input", generates=False)
    assert asyncio.run(pooling._prompts(["abc", "de"], cost)) == [[7, 7, 7], [7, 7]]
    with pytest.raises(APIError) as e:
        asyncio.run(pooling._prompts(["abc", "def"], cost))
    assert e.value.status == 400 and e.value.param == "input" and "--max-prompt-tokens-x-n" in e.value.message


# ---- over HTTP ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * 1000] * 21}, "stop"),
    ({"n": 101, "stop": ["x" * 2000]}, "stop"),
    ({"n": 7, "logit_bias": {str(t): 0.5 for t in range(49_152)}}, "logit_bias"),
    ({"n": 129}, "n"),
    ({"structured_outputs": {"regex": "a" * 65537}}, "structured_outputs"),
])
def test_server_answers_400_naming_the_field(tiny_server, body, field):
    r = httpx.post(f"{tiny_server}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert r.json()["error"]["code"] == "admission_limit_exceeded"


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


RAISED = ["--max-n", "256", "--max-stop-strings", "2000", "--max-prompts-per-request", "4096",
          "--max-grammar-chars", "70000"]
LOWERED = ["--max-model-len", "256", "--max-prompt-tokens-x-n", "1000", "--max-output-tokens-x-n", "300"]
# What the default limits refuse and RAISED admits: (path, body, the field the default names).
REFUSED_BY_DEFAULT = [
    ("/v1/completions", {"prompt": "hi", "n": 129, "max_tokens": 1}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                              "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"regex": "a" * 65537}},
     "structured_outputs"),
]


@pytest.fixture(scope="module")
def flagged_server(tiny_model_dir, tmp_path_factory):
    """The tiny llama with some limits raised and the token budgets lowered (a 256-token context)."""
    from conftest import tiny_args
    from serving import serve
    args = tiny_args(tiny_model_dir("llama"), *RAISED, *LOWERED)
    with serve(args, tmp_path_factory.mktemp("flagged") / "server.log") as (url, _):
        yield url


@pytest.mark.parametrize("path, body, field", REFUSED_BY_DEFAULT)
def test_a_raised_flag_admits_what_the_default_refused(tiny_server, flagged_server, path, body, field):
    r = httpx.post(f"{tiny_server}{path}", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{flagged_server}{path}", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == body.get("n", 1)


def test_a_raised_prompts_limit_reaches_the_pooling_routes(tiny_server, flagged_server):
    """2,049 inputs: over the default's limit; with the flag raised, the request gets as far as the model's
    own answer (this one generates: no embeddings)."""
    body = {"model": "tiny", "input": ["a"] * 2049}
    r = httpx.post(f"{tiny_server}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = httpx.post(f"{flagged_server}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_pooling", r.text


def test_lowered_token_budgets_judge_the_tokenized_prompts(flagged_server):
    """--max-prompt-tokens-x-n 1000 and --max-output-tokens-x-n 300, over a 256-token context."""
    prompt = "hello " * 100
    count = httpx.post(f"{flagged_server}/tokenize", json={"prompt": prompt}, timeout=30).json()["count"]
    n = 1000 // count + 1
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    r = httpx.post(f"{flagged_server}/v1/completions", json={**body, "n": n}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "--max-prompt-tokens-x-n" in r.json()["error"]["message"]
    r = httpx.post(f"{flagged_server}/v1/completions", json={**body, "n": n - 1}, timeout=60)
    assert r.status_code == 200, r.text
    # no max_tokens: each sample may fill the rest of the context, 2 x (256 - the prompt) > 300
    r = httpx.post(f"{flagged_server}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "n": 2},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(f"{flagged_server}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": MESSAGES, "n": 2, "max_completion_tokens": 151})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


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
