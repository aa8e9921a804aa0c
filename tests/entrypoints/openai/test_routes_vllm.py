"""vLLM 0.32's routes beside the OpenAI API (serving_vllm_routes.py), its refusal of a required or named tool_choice
without --tool-call-parser, and count_tokens' context_management: each against a real server on loopback.

No server is started for this module alone: the shared tiny llama's engine (conftest.py) is served here by uvicorn in
a thread, twice (apps are cheap; the engine is shared): as `vllm serve` runs by default (no tool parser), and with
--tool-call-parser hermes. Generative scores are checked against HF transformers' own next-token distribution of the
same checkpoint.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
import torch
from serving import serve_in_thread

from pressroom.entrypoints.openai.server import build_app
from pressroom.entrypoints.openai.serving_vllm_routes import SCALE_OUT_ROUTES
from pressroom.entrypoints.openai.settings import ServerSettings

MODEL = "tiny"
GREEDY = {"temperature": 0, "max_tokens": 6}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}


def _serving(engine, settings: ServerSettings):
    return serve_in_thread(build_app(engine, settings))


@pytest.fixture(scope="module")
def plain(tiny_async_engine) -> Iterator[str]:
    """As `vllm serve MODEL` runs: no tool parser."""
    settings = ServerSettings(served_model_name=(MODEL,), log_requests=False, log_stats_interval=0)
    with _serving(tiny_async_engine, settings) as url:
        yield url


@pytest.fixture(scope="module")
def with_parser(tiny_async_engine) -> Iterator[str]:
    """--tool-call-parser hermes, without --enable-auto-tool-choice."""
    settings = ServerSettings(served_model_name=(MODEL,), log_requests=False, log_stats_interval=0,
                              tool_call_parser="hermes")
    with _serving(tiny_async_engine, settings) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- tool_choice without --tool-call-parser ----

@pytest.mark.parametrize(("choice", "words"), [
    ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
    ({"type": "function", "function": {"name": "get_weather"}},
     'tool_choice=function "get_weather" requires --tool-call-parser to be set')])
def test_a_forced_tool_choice_needs_a_tool_call_parser(plain, choice, words):
    """vLLM 0.32's refusal, in its words; "none" needs no parser."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                   tool_choice=choice, max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        _client(plain).chat.completions.create(**request)
    assert e.value.body["param"] == "tool_choice" and words in e.value.body["message"]
    assert _client(plain).chat.completions.create(**dict(request, tool_choice="none")).choices[0].message.tool_calls \
        is None


@pytest.mark.slow
def test_with_a_parser_named_a_forced_tool_choice_runs(with_parser):
    """--tool-call-parser alone (no --enable-auto-tool-choice) lifts the refusal: the output is constrained to the
    named function's arguments (the tiny random model writes no whole call in 3 tokens). Slow: the schema's grammar
    compiles in the grammar sandbox, some 20 s on 2 busy cores."""
    answer = _client(with_parser).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        extra_body={"return_token_ids": True})
    assert answer.choices[0].finish_reason == "length"
    assert len(answer.choices[0].token_ids) == 3  # generated under the constraint, not refused


@pytest.mark.slow
def test_the_responses_api_takes_a_named_tool_choice_without_a_parser(plain):
    """vLLM 0.32 checks for the parser on chat and Messages only: its Responses API runs the named function. Slow:
    the schema's grammar compiles in the grammar sandbox, some 20 s on 2 busy cores."""
    r = _client(plain).responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=3, temperature=0,
                                        tools=[{"type": "function", **WEATHER["function"]}],
                                        tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "incomplete" and r.usage.output_tokens == 3


# ---- /v1/chat/completions/batch ----

CONVERSATIONS = [[{"role": "user", "content": "Name a color."}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}],
                 [{"role": "user", "content": "Hi"}]]


def test_batch_answers_each_conversation_as_chat_would(plain):
    """Choice i is conversation i's answer, the same as /v1/chat/completions gives it alone; usage is their sum."""
    batch = httpx.post(f"{plain}/v1/chat/completions/batch", timeout=120,
                       json={"model": MODEL, "messages": CONVERSATIONS, "return_token_ids": True, **GREEDY})
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    alone = [_client(plain).chat.completions.create(model=MODEL, messages=c, **GREEDY) for c in CONVERSATIONS]
    assert [c["message"]["content"] for c in body["choices"]] == [a.choices[0].message.content for a in alone]
    assert [len(c["token_ids"]) for c in body["choices"]] == [a.usage.completion_tokens for a in alone]
    assert body["usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)
    assert body["usage"]["completion_tokens"] == sum(a.usage.completion_tokens for a in alone)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"), ({"n": 2}, "n"), ({"tools": [WEATHER]}, "tools"),
    ({"use_beam_search": True}, "use_beam_search"), ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": 5}]]}, "messages[1].0"),
    ({"model": "no-such-model"}, "model")])
def test_batch_refuses_what_vllm_refuses(plain, extra, param):
    body = dict({"model": MODEL, "messages": CONVERSATIONS[:2], **GREEDY}, **extra)
    r = httpx.post(f"{plain}/v1/chat/completions/batch", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert (r.json()["error"]["param"] or "").startswith(param), r.json()


# ---- /generative_scoring ----

@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()


def _next_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)


def test_generative_scoring_gives_the_models_next_token_probabilities(plain, hf_tiny, smollm_tokenizer):
    """Each item's score is the first label's probability after query + item (item + query with item_first): over
    the labels alone by default, over the whole vocabulary without apply_softmax; HF's forward is the oracle."""
    labels = [smollm_tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")]
    query = "Is the sky blue? Answer:"
    q_ids = smollm_tokenizer.encode(query)
    texts = ["", " Think first."]
    cases = [(texts, [smollm_tokenizer.encode(t, add_special_tokens=False) for t in texts], False, True),
             (texts, [smollm_tokenizer.encode(t, add_special_tokens=False) for t in texts], False, False),
             ([[28, 29, 30], [31]], [[28, 29, 30], [31]], True, True)]
    for items, item_ids, item_first, softmax in cases:
        r = httpx.post(f"{plain}/generative_scoring", timeout=120, json={
            "model": MODEL, "query": query, "items": items, "label_token_ids": labels, "apply_softmax": softmax,
            "item_first": item_first})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        for d, ids in zip(body["data"], item_ids):
            logprobs = _next_token_logprobs(hf_tiny, ids + q_ids if item_first else q_ids + ids)
            chosen = logprobs[labels]
            expected = torch.softmax(chosen, -1)[0] if softmax else chosen[0].exp()
            assert d["object"] == "score" and math.isclose(d["score"], float(expected), rel_tol=1e-3), \
                (item_first, softmax, d, float(expected))
        prompt_tokens = sum(len(q_ids) + len(i) for i in item_ids)
        assert body["usage"]["prompt_tokens"] == prompt_tokens and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("extra", "param"), [
    ({"label_token_ids": [10 ** 7]}, "label_token_ids"), ({"label_token_ids": []}, "label_token_ids"),
    ({"items": []}, "items"), ({"model": "no-such-model"}, "model")])
def test_generative_scoring_refusals(plain, extra, param):
    body = dict({"model": MODEL, "query": "Is it?", "items": [" yes"], "label_token_ids": [28]}, **extra)
    r = httpx.post(f"{plain}/generative_scoring", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param


# ---- the small routes ----

def test_kv_event_sources_and_elastic_ep_answer_as_vllm_without_them(plain):
    assert httpx.get(f"{plain}/kv_event_sources").json() == {}
    assert httpx.post(f"{plain}/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}
    same = httpx.post(f"{plain}/scale_elastic_ep", json={"new_data_parallel_size": 1})
    assert same.status_code == 200 and same.json()["message"] == "Scaled to 1 data parallel engines"
    other = httpx.post(f"{plain}/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert other.status_code == 400
    assert "Elastic expert parallelism is not supported" in other.json()["error"]["message"]
    for body, words in (({}, "new_data_parallel_size is required"),
                        ({"new_data_parallel_size": 0}, "must be a positive integer"),
                        ({"new_data_parallel_size": 1, "drain_timeout": -1}, "drain_timeout must be")):
        r = httpx.post(f"{plain}/scale_elastic_ep", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"]


@pytest.mark.parametrize("path", SCALE_OUT_ROUTES)
def test_scale_out_routes_are_forbidden_as_vllm_forbids_them_by_default(plain, path):
    r = httpx.post(f"{plain}{path}", json={})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert "--enable-scale-out" in r.json()["error"]["message"]


def test_count_tokens_has_context_management(plain):
    """vLLM 0.32 answers context_management.original_input_tokens beside input_tokens (no context management
    runs, so the two are equal)."""
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    r = httpx.post(f"{plain}/v1/messages/count_tokens", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["input_tokens"] > 5 and body["context_management"] == {"original_input_tokens": body["input_tokens"]}
    count = anthropic.Anthropic(base_url=plain, api_key="unused", max_retries=0).messages.count_tokens(
        model=MODEL, messages=messages)
    assert count.input_tokens == body["input_tokens"]
