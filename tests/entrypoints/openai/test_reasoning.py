"""Reasoning output through `pressroom serve`: `<think>...</think>` split into reasoning (vLLM 0.32's name) and content,
reasoning token counts, thinking_token_budget, and the session id in the per-request log line.

The server runs conftest's think_model_dir: the tiny random llama whose tokenizer has `<think>` / `</think>`
as added special tokens and whose chat template opens `<think>` in the generation prompt. Its output is
made predictable with a large logit bias on a few plain-ASCII tokens (so per-token texts join exactly into
the text) and a thinking_token_budget (so `</think>` comes exactly where the test wants it).
"""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from conftest import tiny_args
from serving import serve, tail

from pressroom.entrypoints.openai.reasoning import ReasoningParser

MODEL = "tiny-think"


# ---- the parser alone ----


class _Tok:
    """The few tokenizer calls the parser makes, for markers that are single tokens 5 and 6."""
    unk_token_id = 0
    all_special_ids = [5, 6]

    def convert_tokens_to_ids(self, token):
        return {"<think>": 5, "</think>": 6}.get(token, 0)


CASES = [
    ("abc</think>answer", True, ("abc", "answer")),
    ("</think>answer", True, ("", "answer")),
    ("still thinking </thi", True, ("still thinking </thi", "")),
    ("x < y </think> a </think> b", True, ("x < y ", " a </think> b")),
    ("<think>why</think>because", False, ("why", "because")),
    ("\n <think>why</think>because", False, ("why", "because")),
    ("plain answer <think>x</think>", False, (None, "plain answer <think>x</think>")),
    ("<thin", False, (None, "<thin")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text,opens,expected", CASES)
def test_parser_split_is_the_same_for_any_chunking(text, opens, expected):
    parser = ReasoningParser(_Tok())
    assert parser.split(text, opens) == expected
    for cuts in [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(len(text)) for j in range(i, len(text))]:
        stream = parser.stream(opens)
        pieces, bounds = [], [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(stream.feed(text[a:b]))
        pieces.append(stream.finish())
        reasoning = "".join(r for r, _ in pieces)
        content = "".join(c for _, c in pieces)
        assert (reasoning if stream.seen_span else None, content) == expected, cuts
        first_content = next((k for k, (_, c) in enumerate(pieces) if c), len(pieces))
        assert not any(r for r, _ in pieces[first_content + 1:]), "reasoning after content"


def test_parser_counts_reasoning_tokens():
    parser = ReasoningParser(_Tok())
    assert parser.count_reasoning_tokens([9, 9, 6, 9], prompt_opens=True) == 3
    assert parser.count_reasoning_tokens([9, 9, 9], prompt_opens=True) == 3  # still open
    assert parser.count_reasoning_tokens([5, 9, 6, 9], prompt_opens=False) == 3
    assert parser.count_reasoning_tokens([9, 5, 6], prompt_opens=False) == 0
    assert parser.prompt_opens([1, 5, 2]) and not parser.prompt_opens([1, 5, 6]) and not parser.prompt_opens([1])
    assert parser.markers_are_special


# ---- the server ----


@pytest.fixture(scope="module")
def served(think_model_dir, tmp_path_factory):
    args = ["--log-level", "INFO", *tiny_args(think_model_dir, "--enable-log-requests", name=MODEL)]
    with serve(args, tmp_path_factory.mktemp("serve-think") / "server.log", shutdown_s=20) as served:
        yield served


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def vocab(think_model_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(think_model_dir)
    words = [tok.encode(w, add_special_tokens=False) for w in (" sky", " blue", " red")]
    assert all(len(w) == 1 for w in words)
    return {"start": tok.convert_tokens_to_ids("<think>"), "end": tok.convert_tokens_to_ids("</think>"),
            "words": [w[0] for w in words]}


MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def _kwargs(vocab, budget: int, answer: int, **extra) -> dict:
    bias = {str(t): 100.0 for t in vocab["words"]} | {str(vocab["end"]): -100.0, str(vocab["start"]): -100.0}
    body = {"thinking_token_budget": budget, "ignore_eos": True, "logit_bias": bias}
    return dict(model=MODEL, messages=MESSAGES, max_tokens=budget + 1 + answer, extra_body=body, **extra)


@pytest.mark.parametrize("budget", [0, 6])
def test_reasoning_split_and_budget(client, vocab, budget):
    r = client.chat.completions.create(temperature=0, logprobs=True, **_kwargs(vocab, budget, 5))
    choice = r.choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == budget + 1 + 5 and tokens.count("</think>") == 1
    assert tokens.index("</think>") == budget  # the budget caps the thinking span exactly
    msg = choice.message
    assert msg.reasoning == "".join(tokens[:budget])
    assert msg.content == "".join(tokens[budget + 1:]) and msg.content
    assert r.usage.completion_tokens == budget + 6
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1  # up to and including </think>


def test_streamed_reasoning_equals_unstreamed(server, vocab):
    asyncio.run(_streamed_equals_unstreamed(server, vocab))


async def _streamed_equals_unstreamed(server, vocab):
    kwargs = _kwargs(vocab, 7, 6, temperature=1.0, seed=3, n=2)
    async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60) as aclient:
        whole = await aclient.chat.completions.create(**kwargs)
        reasoning, content, usage = ["", ""], ["", ""], None
        content_started = [False, False]
        stream = await aclient.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        async for chunk in stream:
            for c in chunk.choices:
                r = getattr(c.delta, "reasoning", None) or ""
                assert not (r and content_started[c.index]), "reasoning after content"
                reasoning[c.index] += r
                content[c.index] += c.delta.content or ""
                content_started[c.index] |= bool(c.delta.content)
            usage = chunk.usage or usage
    choices = sorted(whole.choices, key=lambda c: c.index)
    assert reasoning == [c.message.reasoning for c in choices]
    assert content == [c.message.content for c in choices]
    assert all(r and c for r, c in zip(reasoning, content))
    assert usage.completion_tokens == whole.usage.completion_tokens == 2 * 14
    assert usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens_details.reasoning_tokens
    assert whole.usage.completion_tokens_details.reasoning_tokens == 2 * 8


def test_open_span_counts_every_token_as_reasoning(client, vocab):
    """No budget and no end marker: everything is reasoning and content is empty."""
    kwargs = _kwargs(vocab, 0, 0)
    kwargs["extra_body"] = {k: v for k, v in kwargs["extra_body"].items() if k != "thinking_token_budget"}
    kwargs["max_tokens"] = 5
    r = client.chat.completions.create(temperature=0, **kwargs)
    assert r.choices[0].message.reasoning and not r.choices[0].message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 5 == r.usage.completion_tokens


def test_bad_budget_is_a_400(server):
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES, "thinking_token_budget": -2})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/chat/completions",  # vLLM's spelling of no budget
                   json={"model": MODEL, "messages": MESSAGES, "thinking_token_budget": -1, "max_tokens": 2})
    assert r.status_code == 200


def test_session_id_reaches_the_log(served, client):
    url, log = served
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                   extra_headers={"X-Session-Id": "conv-header-1"})
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"session_id": "conv-field-2"})
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                                            extra_body={"session_id": "conv-stream-3"})
    for _ in stream:
        pass
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={"X-Session-Id": "s" * 300}).status_code == 400
    deadline = time.monotonic() + 5
    while True:
        text = tail(log)
        lines = [line for line in text.splitlines() if "Finished request" in line]
        if all(any(f"(session {s})" in line and "2 generated" in line and "TTFT" in line for line in lines)
               for s in ("conv-header-1", "conv-field-2", "conv-stream-3")):
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    metrics = httpx.get(f"{url}/metrics").text
    assert "conv-" not in metrics  # no per-session series


def test_make_parser_choices(think_model_dir, tiny_model_dir):
    import transformers

    from pressroom.entrypoints.openai.reasoning import make_parser
    think = transformers.AutoTokenizer.from_pretrained(think_model_dir)
    plain = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    assert make_parser("auto", think) is not None and make_parser(None, think) is not None
    assert make_parser("auto", plain) is None and make_parser("none", think) is None
    custom = make_parser("think", plain, "<reason>", "</reason>")  # multi-token markers: ids from encoding
    assert custom is not None and len(custom.end_ids) > 1 and not custom.markers_are_special
    assert custom.split("a</reason>b", True) == ("a", "b")
    with pytest.raises(ValueError):
        make_parser("deepseek", think)
