"""vLLM 0.32's request fields and response shapes that issue 46 left open, on the session's tiny llama
(`tiny_server`, vLLM's default --max-logprobs of 20): prompt_logprobs (completions' choices, chat's response; HF's
values), echo with logprobs (the prompt's own token among its top_logprobs; max_tokens 0: the prompt alone),
return_tokens_as_token_ids, echo on chat, continuous usage stats, system_fingerprint, the message and response keys
vLLM sends, streamed prompt_logprobs and stream_options without a stream refused as vLLM refuses them, POST /ping and
GET /load.
"""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import hf_prompt_logprobs

MODEL = "tiny"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def _ok(url: str, path: str, body: dict) -> dict:
    r = _post(url, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    """A streamed answer's chunks ([DONE] dropped)."""
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, "temperature": 0, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)


# ---- prompt_logprobs ----

def test_completions_prompt_logprobs_are_hfs_with_the_prompts_own_token(tiny_server, hf_model):
    out = _ok(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2,
                                                "return_token_ids": True})
    choice = out["choices"][0]
    ids, rows = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    expected = hf_prompt_logprobs(hf_model, ids)
    for position, (token, row) in enumerate(zip(ids[1:], rows[1:]), start=1):
        own = row[str(token)]  # the prompt's own token, with its rank, beside the top 2
        assert own["logprob"] == pytest.approx(expected[position - 1], abs=1e-3)
        assert own["decoded_token"] is not None
        assert {e["rank"] for e in row.values()} >= {1, 2} and len(row) == (2 if own["rank"] <= 2 else 3)
        assert max(e["logprob"] for e in row.values()) == next(e["logprob"] for e in row.values() if e["rank"] == 1)
    assert "prompt_logprobs" in out["choices"][0] and out["usage"]["prompt_tokens"] == len(ids)


def test_chat_prompt_logprobs_sit_at_the_top_level(tiny_server):
    out = _ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0,
                                                     "return_token_ids": True})
    ids, rows = out["prompt_token_ids"], out["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    assert all(list(row) == [str(token)] for token, row in zip(ids[1:], rows[1:]))  # 0: the own token only
    plain = _ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert plain["prompt_logprobs"] is None and "prompt_logprobs" in plain


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", "sample logprobs of 21"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs", "prompt logprobs of 21"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "logprobs",
     "sample logprobs of 21"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "not available when `stream=True`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options",
     "only be defined when `stream=True`"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(tiny_server, path, body, param, says):
    r = _post(tiny_server, path, dict(body, max_tokens=2))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]
    if "logprobs of 21" in says:
        assert "greater than max allowed: 20" in error["message"]  # vLLM's default --max-logprobs


# ---- echo ----

def test_echo_with_logprobs_shows_the_prompts_own_token(tiny_server):
    out = _ok(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1,
                                                "return_token_ids": True})
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    lp, rows = choice["logprobs"], choice["prompt_logprobs"]
    assert choice["text"].startswith(PROMPT) and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token has none
    for k, token in enumerate(choice["prompt_token_ids"][1:], start=1):
        own = rows[k][str(token)]
        top = lp["top_logprobs"][k]
        assert lp["tokens"][k] == own["decoded_token"] and lp["tokens"][k] in top  # the own token, whatever its rank
        assert lp["token_logprobs"][k] == pytest.approx(own["logprob"])
        assert len(top) == (1 if own["rank"] == 1 else 2)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(len(ids))]
    # streamed: the prompt's logprobs come in the first chunk, before its first token's, the same values
    chunks = _chunks(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["top_logprobs"] for s in streamed), []) == lp["top_logprobs"]
    assert sum((s["text_offset"] for s in streamed), []) == lp["text_offset"]


def test_echo_with_max_tokens_0_answers_the_prompt_alone(tiny_server):
    """OpenAI's and vLLM's way to score a prompt: echo, max_tokens 0 and logprobs give its text and logprobs only
    (vLLM generates one token, counted in usage, and leaves it out)."""
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    out = _ok(tiny_server, "/v1/completions", dict(body, return_token_ids=True))
    choice = out["choices"][0]
    lp, rows = choice["logprobs"], choice["prompt_logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(rows) == len(choice["prompt_token_ids"]) == out["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][1:] == [pytest.approx(row[str(t)]["logprob"])
                                        for t, row in zip(choice["prompt_token_ids"][1:], rows[1:])]
    assert out["usage"]["completion_tokens"] == 1
    chunks = _chunks(tiny_server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks), []) == lp["tokens"]
    assert _post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}).status_code == 400  # no echo


def test_return_tokens_as_token_ids_writes_logprobs_tokens_as_ids(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "return_token_ids": True}
    out = _ok(tiny_server, "/v1/completions", dict(body, return_tokens_as_token_ids=True))["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    assert all(key.startswith("token_id:") for top in out["logprobs"]["top_logprobs"] for key in top)
    plain = _ok(tiny_server, "/v1/completions", body)["choices"][0]
    assert "".join(plain["logprobs"]["tokens"]) == plain["text"]  # the server's default: the tokens' text
    chat = _ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "logprobs": True,
                                                      "top_logprobs": 1, "return_tokens_as_token_ids": True,
                                                      "return_token_ids": True})["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert bytes(sum((e["bytes"] for e in content), [])).decode() == chat["message"]["content"]  # the text's bytes


CONTINUED = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "1. Red"}]


def test_chat_echo_begins_the_answer_with_the_last_message(tiny_server):
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 4}
    plain = _ok(tiny_server, "/v1/chat/completions", body)["choices"][0]["message"]
    echoed = _ok(tiny_server, "/v1/chat/completions", dict(body, echo=True))
    message = echoed["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "1. Red" + plain["content"]
    assert echoed["prompt_logprobs"] is not None  # echo asks for the prompt's logprobs, as vLLM's does
    chunks = _chunks(tiny_server, "/v1/chat/completions", dict(body, echo=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        message["content"]
    # a last message of another role than the answer's is not echoed
    after_user = _ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "echo": True})
    assert not after_user["choices"][0]["message"]["content"].startswith(MESSAGES[0]["content"])


# ---- usage in every chunk, the fingerprint, the keys ----

def test_continuous_usage_stats_count_each_choice_in_every_chunk(tiny_server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "ignore_eos": True,
                                                      "temperature": 1.0, "seed": 5, "stream_options": options})
    *choice_chunks, last = chunks
    assert all(c["usage"] is not None for c in choice_chunks) and last["choices"] == []
    counts: dict[int, list[int]] = {}
    for c in choice_chunks:
        counts.setdefault(c["choices"][0]["index"], []).append(c["usage"]["completion_tokens"])
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
    assert {i: seen[-1] for i, seen in counts.items()} == {0: 3, 1: 3}
    assert all(seen == sorted(seen) and seen[0] >= 1 for seen in counts.values())
    assert last["usage"]["completion_tokens"] == 6
    chat = _chunks(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True,
                                                         "stream_options": options})
    assert chat[0]["usage"]["completion_tokens"] == 0  # the role chunk
    assert [c["usage"]["completion_tokens"] for c in chat[1:-1]][-1] == 3 == chat[-1]["usage"]["completion_tokens"]
    # without include_usage, continuous_usage_stats adds nothing (vLLM's rule)
    bare = _chunks(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                    "stream_options": {"continuous_usage_stats": True}})
    assert all(c.get("usage") is None for c in bare)


def test_system_fingerprint_where_vllm_sends_it(tiny_server):
    whole = [_ok(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
             _ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})]
    prints = {r["system_fingerprint"] for r in whole}
    assert len(prints) == 1 and next(iter(prints)).startswith("pressroom-")
    # streamed: on each choice's last chunk, or on the usage chunk when one follows
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        chunks = _chunks(tiny_server, path, dict(body, max_tokens=2))
        assert [c.get("system_fingerprint") for c in chunks][-1] in prints
        assert all(c.get("system_fingerprint") is None for c in chunks[:-1])
        chunks = _chunks(tiny_server, path, dict(body, max_tokens=2, stream_options={"include_usage": True}))
        assert chunks[-1]["usage"] and chunks[-1]["system_fingerprint"] in prints
        assert all(c.get("system_fingerprint") is None for c in chunks[:-1])


def test_answers_carry_vllms_keys(tiny_server):
    chat = _ok(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert {"reasoning", "refusal", "annotations", "audio", "function_call"} <= set(chat["choices"][0]["message"])
    assert "reasoning_content" not in chat["choices"][0]["message"]  # vLLM 0.32 answers `reasoning` only
    completion = _ok(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    for answer in (chat, completion):
        assert {"service_tier", "system_fingerprint"} <= set(answer)
        assert "prompt_tokens_details" in answer["usage"] and answer["usage"]["prompt_tokens_details"] is None
    assert "prompt_logprobs" in completion["choices"][0]


def test_ping_answers_post_too_and_load_is_served(tiny_server):
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{tiny_server}/ping", timeout=30).status_code == 200
    # vLLM's GET /load: 0 without --enable-server-load-tracking (test_fields_prompt_tokens_details.py counts)
    assert httpx.get(f"{tiny_server}/load", timeout=30).json() == {"server_load": 0}


# ---- best_of ----

def test_best_of_keeps_the_n_samples_of_highest_cumulative_logprob(tiny_server):
    body = {"prompt": PROMPT, "n": 2, "best_of": 5, "max_tokens": 6, "ignore_eos": True, "temperature": 1.0,
            "seed": 3}
    out = _ok(tiny_server, "/v1/completions", dict(body, logprobs=0))
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 5 * 6  # every sample best_of made
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in out["choices"]]
    assert scores[0] >= scores[1]
    # the same seed's five samples, all returned: the two kept are their best two
    every = _ok(tiny_server, "/v1/completions", dict(body, n=5, best_of=None, logprobs=0))
    best = sorted((sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]), reverse=True)[:2]
    assert scores == pytest.approx(best, abs=1e-4)
    plain = _ok(tiny_server, "/v1/completions", body)  # no logprobs asked: none shown, though they scored
    assert all(c["logprobs"] is None for c in plain["choices"]) and len(plain["choices"]) == 2


@pytest.mark.parametrize("fields", [{"n": 3, "best_of": 2}, {"n": 1, "best_of": 3, "stream": True}])
def test_best_of_below_n_or_streamed_is_a_400(tiny_server, fields):
    r = _post(tiny_server, "/v1/completions", dict(fields, prompt=PROMPT, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text

