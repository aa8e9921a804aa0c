"""The API surface of `pressroom serve`: the access log and start-up lines, offline /docs and /redoc, the
request and response schemas in /openapi.json, /metrics without `*_created` series, X-Vllm-Priority,
`reasoning_effort` in the chat template, and a 400 naming each OpenAI field that pressroom does not implement.

The server runs the tiny llama with a chat template that writes `reasoning_effort` into the prompt when it is
given, so the prompt's token count shows whether the template received it.
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import tiny_args
from serving import serve
from starlette.requests import Request

from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.serving import request_priority

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
EFFORT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort is defined %}Reasoning effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def effort_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny llama whose chat template writes `reasoning_effort` when the render gets it."""
    import transformers
    path = tmp_path_factory.mktemp("tiny-effort") / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = EFFORT_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def _info_args(model_dir: str, *extra: str) -> list[str]:
    """`pressroom serve` of the tiny model logging at INFO (uvicorn's own lines too)."""
    return ["--log-level", "INFO", *tiny_args(model_dir, "--uvicorn-log-level", "info", *extra, name=MODEL)]


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-api") / "server.log"


@pytest.fixture(scope="module")
def server(effort_model_dir, log_path):
    with serve(_info_args(effort_model_dir, "--log-stats-interval", "0.5"), log_path, shutdown_s=20) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _wait_for_lines(log_path: Path, pattern: str, count: int = 1, seconds: float = 5) -> list[str]:
    """The log's lines matching `pattern` once there are `count` of them (lines come as responses end)."""
    deadline = time.monotonic() + seconds
    while True:
        lines = [line for line in log_path.read_text().splitlines() if re.search(pattern, line)]
        if len(lines) >= count:
            return lines
        assert time.monotonic() < deadline, (pattern, log_path.read_text()[-4000:])
        time.sleep(0.1)


# ---- logging ----

def test_start_up_lines_are_info(server, log_path):
    _wait_for_lines(log_path, r"INFO pressroom: serving tiny on http://127\.0\.0\.1:\d+$")
    _wait_for_lines(log_path, r"INFO pressroom: ready in [\d.]+s from start")
    assert not _lines(log_path, r"WARNING pressroom: (serving|ready)")


def _lines(log_path: Path, pattern: str) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if re.search(pattern, line)]


def test_one_access_line_per_request(server, client, log_path):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          extra_headers={"X-Session-Id": "conv-access-1"})
    line = _wait_for_lines(log_path, f"request_id={chat.id} ")[0]
    assert re.search(rf'INFO pressroom\.access: "POST /v1/chat/completions" 200 request_id={chat.id} '
                     rf"session_id=conv-access-1 prompt_tokens={chat.usage.prompt_tokens} "
                     rf"completion_tokens={chat.usage.completion_tokens} time=[\d.]+ms$", line), line

    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"session_id": "conv-access-2", "ignore_eos": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    line = _wait_for_lines(log_path, f"request_id={chunks[0].id} ")[0]  # logged when the stream has ended
    assert (f'"POST /v1/completions" 200 request_id={chunks[0].id} session_id=conv-access-2 '
            f"prompt_tokens={usage.prompt_tokens} completion_tokens=8 time=") in line, line

    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": -1},
                   headers={"X-Request-Id": "mine-42", "X-Session-Id": "conv-access-3"})
    assert r.status_code == 400
    line = _wait_for_lines(log_path, "request_id=mine-42 ")[0]
    assert ('"POST /v1/completions" 400 request_id=mine-42 session_id=conv-access-3 prompt_tokens=- '
            "completion_tokens=- time=") in line, line

    assert httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "tok-7"}).is_success
    line = _wait_for_lines(log_path, "request_id=tok-7 ")[0]
    assert '"POST /tokenize" 200 request_id=tok-7 session_id=- prompt_tokens=- completion_tokens=-' in line, line
    assert len(_lines(log_path, f"request_id={chat.id} ")) == 1


def test_periodic_stats_and_uvicorn_access_lines_by_default(server, client, log_path):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    _wait_for_lines(log_path, r"INFO pressroom: Avg prompt throughput: .* Running: \d+ reqs")
    _wait_for_lines(log_path, r'"POST /v1/completions HTTP/1\.1" 200')  # uvicorn's own access line


def _cli_has(flag: str) -> bool:
    from pressroom.entrypoints.cli import build_parser
    return not build_parser().parse_known_args(["serve", flag])[1]


@pytest.mark.slow  # a server of its own (6 s in CI)
@pytest.mark.skipif(not _cli_has("--disable-log-requests"), reason="the CLI has no --disable-log-* flags yet")
def test_disable_log_flags(effort_model_dir, tmp_path):
    log_path = tmp_path / "server.log"
    args = _info_args(effort_model_dir, "--log-stats-interval", "0.2", "--disable-log-requests", "--disable-log-stats",
                      "--disable-uvicorn-access-log")
    with serve(args, log_path, shutdown_s=20) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        time.sleep(1)  # five stats intervals
    text = log_path.read_text()
    assert "ready in" in text
    for absent in ("pressroom.access", "Finished request", "Avg prompt throughput", "POST /v1/completions"):
        assert absent not in text, text


# ---- /docs, /redoc, /openapi.json, /metrics ----

@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_need_no_network(server, page):
    r = httpx.get(f"{server}{page}")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    foreign = [u for u in re.findall(r"\w+://[^\s\"'<>)]+", r.text) if not u.startswith(server)]
    assert not foreign, foreign
    assets = re.findall(r'(?:src|href|spec-url)="([^"]+)"', r.text) + re.findall(r"url: '([^']+)'", r.text)
    assert any(a.endswith(".js") for a in assets) and "/openapi.json" in assets, assets
    for asset in assets:
        got = httpx.get(f"{server}{asset}")
        assert got.status_code == 200 and got.content, asset


def test_openapi_carries_request_and_response_schemas(server):
    doc = httpx.get(f"{server}/openapi.json").json()
    schemas = doc["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        return schemas[schema["$ref"].rsplit("/", 1)[1]]

    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = resolve(chat["requestBody"]["content"]["application/json"]["schema"])
    assert {"messages", "model", "max_tokens", "temperature", "stream", "reasoning_effort"} <= set(body["properties"])
    assert "messages" in body["required"]
    message = resolve(body["properties"]["messages"]["items"])
    assert {"role", "content"} <= set(message["properties"])
    chat_ok = chat["responses"]["200"]["content"]
    assert {"choices", "usage", "id"} <= set(resolve(chat_ok["application/json"]["schema"])["properties"])
    assert "delta" in resolve(resolve(chat_ok["text/event-stream"]["schema"])["properties"]["choices"]["items"])[
        "properties"]
    completion = doc["paths"]["/v1/completions"]["post"]
    assert "prompt" in resolve(completion["requestBody"]["content"]["application/json"]["schema"])["properties"]
    ok = resolve(completion["responses"]["200"]["content"]["application/json"]["schema"])
    assert {"choices", "usage"} <= set(ok["properties"])
    assert "error" in resolve(completion["responses"]["4XX"]["content"]["application/json"]["schema"])["properties"]
    for path in ("/tokenize", "/detokenize"):
        assert "$ref" in doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_metrics_have_no_created_series(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    names = [re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and line[0] != "#"]
    assert "vllm:generation_tokens_total" in names
    assert not [n for n in names if n.endswith("_created")]


# ---- priority ----

def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


@pytest.mark.parametrize("headers,field,expected", [
    ({}, None, 0),
    ({}, 4, 4),
    ({"X-Vllm-Priority": "-2"}, 4, -2),
    ({"X-Priority": "3"}, 4, 3),
    ({"X-Vllm-Priority": "1", "X-Priority": "7"}, None, 1),
])
def test_priority_header_beats_the_field(headers, field, expected):
    assert request_priority(_request(headers), field) == expected


@pytest.mark.parametrize("name", ["X-Vllm-Priority", "X-Priority"])
def test_non_integer_priority_header_is_a_400(name):  # through the server: test_server.py's bad requests
    with pytest.raises(APIError) as e:
        request_priority(_request({name: "high"}), 1)
    assert e.value.status == 400 and e.value.param == name


# ---- reasoning_effort ----

def test_reasoning_effort_reaches_the_chat_template(client, effort_model_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(effort_model_dir)

    def prompt_tokens(**template_kwargs) -> int:
        return len(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, **template_kwargs)["input_ids"])

    def served_prompt_tokens(**kwargs) -> int:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **kwargs)
        return r.usage.prompt_tokens

    assert prompt_tokens(reasoning_effort="high") > prompt_tokens()
    assert served_prompt_tokens() == prompt_tokens()
    assert served_prompt_tokens(reasoning_effort="high") == prompt_tokens(reasoning_effort="high")
    assert served_prompt_tokens(extra_body={"chat_template_kwargs": {"reasoning_effort": "minimal"}}) == \
        prompt_tokens(reasoning_effort="minimal")
    assert served_prompt_tokens(reasoning_effort="low", extra_body={"chat_template_kwargs": {
        "reasoning_effort": "a long and different effort"}}) == prompt_tokens(reasoning_effort="low")
    with pytest.raises(openai.BadRequestError) as e:
        served_prompt_tokens(extra_body={"reasoning_effort": "extreme"})
    assert e.value.body["param"] == "reasoning_effort"


# ---- fields pressroom does not implement ----

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
UNSUPPORTED = [  # (endpoint, fields, the field the 400 names)
    ("chat", {"functions": [TOOL["function"]]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
    ("chat", {"guided_regex": "a+"}, "guided_regex"),
    ("chat", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("chat", {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("completion", {"guided_json": {"type": "object"}}, "guided_json"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),  # served on completions only
]
HARMLESS = [
    ("chat", {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "modalities": ["text"],
              "store": False, "metadata": {"k": "v"}, "some_future_field": 1, "logit_bias": {"42": 1.0}}),
    ("completion", {"response_format": {"type": "text"}, "use_beam_search": False, "some_future_field": 1}),
]


def _create(client: openai.OpenAI, endpoint: str, fields: dict):
    """Sends `fields` (every one in the body as given) through the openai client."""
    if endpoint == "chat":
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=fields)
    return client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=fields)


@pytest.mark.parametrize("endpoint,fields,param", UNSUPPORTED, ids=[f"{e}-{p}" for e, _, p in UNSUPPORTED])
def test_unsupported_field_is_a_400_naming_it(server, client, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, endpoint, fields)
    assert e.value.body["param"] == param and param in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 1} | ({"messages": MESSAGES} if endpoint == "chat" else {"prompt": "hi"})
    r = httpx.post(f"{server}{path}", json=body | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and f"`{param}`" in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("choice", ["auto", None], ids=["auto", "default"])
def test_auto_tool_choice_needs_the_server_flags(client, choice):
    """As in vLLM: "auto" (the default with tools) needs --enable-auto-tool-choice and --tool-call-parser."""
    extra = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, tools=[TOOL], **extra)
    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, tools=[TOOL], tool_choice="none")
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("endpoint,fields", HARMLESS, ids=[e for e, _ in HARMLESS])
def test_harmless_fields_are_accepted(client, endpoint, fields):
    assert _create(client, endpoint, fields).usage.completion_tokens == 1


def test_image_content_part_is_a_400_naming_it(server, client):
    image = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=1)
    assert e.value.body["param"] == "messages.0.content" and "image_url" in e.value.body["message"]
    r = httpx.post(f"{server}/tokenize", json={"messages": image})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "text", "text": "this"}]}]
    assert client.chat.completions.create(model=MODEL, messages=text_parts, max_tokens=1).choices
