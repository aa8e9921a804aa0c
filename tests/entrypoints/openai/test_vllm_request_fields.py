"""vLLM's request fields on the server, sent as a vLLM user sends them (the official `openai` client's
`extra_body`), each shown to change the output as vLLM's does: allowed_token_ids, bad_words,
truncate_prompt_tokens, return_token_ids (whole and streamed), cache_salt; vllm_xargs and
spaces_between_special_tokens accepted.

The server is the session's tiny random-weight llama (`tiny_server`): its greedy text is gibberish, but fixed.
"""
from __future__ import annotations

import uuid

import httpx
import openai
import pytest

MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client: openai.OpenAI, prompt: str = PROMPT, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
                                     extra_body={"return_token_ids": True, **extra})


def _tokens(url: str, text: str) -> list[int]:
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    return httpx.post(f"{url}/tokenize", json=body).json()["tokens"]


def _text(url: str, ids: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]


def test_allowed_token_ids_bound_every_sampled_token(client):
    allowed = [11, 220, 3000, 4000]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                                "ignore_eos": True})
    ids = out.choices[0].token_ids
    assert len(ids) == 12 and set(ids) <= set(allowed)


def test_bad_words_remove_a_word_greedy_decoding_writes(client, tiny_server):
    plain = _complete(client).choices[0]
    # a token of the greedy output that is a whole word, alone or after a space; vLLM bans the spaced form only
    # where it has as many tokens as the bare word
    word, token = next((word, t) for t in plain.token_ids if (word := _text(tiny_server, [t]).strip()).isalpha()
                       and (_tokens(tiny_server, word) == [t]
                            or _tokens(tiny_server, " " + word) == [t] and len(_tokens(tiny_server, word)) == 1))
    banned = _complete(client, bad_words=[word]).choices[0]
    assert token not in banned.token_ids
    first = plain.token_ids.index(token)
    assert banned.token_ids[:first] == plain.token_ids[:first]  # greedy as before, up to the banned word


def test_truncate_prompt_tokens_keeps_the_last_k(client, tiny_server):
    long_prompt = " ".join(["word"] * 40)
    whole = _tokens(tiny_server, long_prompt)
    out = _complete(client, long_prompt, truncate_prompt_tokens=5)
    assert out.usage.prompt_tokens == 5 and out.choices[0].prompt_token_ids == whole[-5:]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7
    assert _complete(client, truncate_prompt_tokens=-1).usage.prompt_tokens == len(_tokens(tiny_server, PROMPT))
    for bad in (0, 1 << 20):  # zero is no size; more than max_model_len is vLLM's 400 too
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            _complete(client, truncate_prompt_tokens=bad)


def test_return_token_ids_whole_and_streamed(client, tiny_server):
    whole = _complete(client)
    choice = whole.choices[0]
    assert choice.prompt_token_ids == _tokens(tiny_server, PROMPT)
    assert len(choice.token_ids) == whole.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    assert _complete(client, return_token_ids=False).choices[0].token_ids is None

    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                          extra_body={"return_token_ids": True})
    assert len(chat.prompt_token_ids) == chat.usage.prompt_tokens and len(chat.choices[0].token_ids) == 6
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == chat.prompt_token_ids
    assert [t for c in stream for ch in c.choices for t in ch.token_ids or []] == chat.choices[0].token_ids


def test_vllm_xargs_and_spaces_between_special_tokens_are_accepted(client):
    out = _complete(client, vllm_xargs={"my_ext": 1, "tags": ["a", 2.5]}, spaces_between_special_tokens=False)
    assert out.choices[0].token_ids == _complete(client).choices[0].token_ids
    with pytest.raises(openai.BadRequestError):
        _complete(client, vllm_xargs={"nested": {"no": 1}})  # vLLM's type: strings, numbers or lists of them


def _cached_tokens(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.endswith(":prompt_tokens_cached_total"))  # vLLM's family, under the server's prefix


def test_cache_salt_isolates_the_prefix_cache(client, tiny_server):
    prompt = f"{uuid.uuid4().hex} " + " ".join(["word"] * 60)  # unseen: no earlier request cached it

    def cached(**extra) -> float:
        before = _cached_tokens(tiny_server)
        _complete(client, prompt, **extra)
        return _cached_tokens(tiny_server) - before

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") > 0  # equal salts share the prefix
    assert cached(cache_salt="bob") == 0  # a different salt finds none of it
    assert cached() == 0  # nor does a request without a salt
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        _complete(client, cache_salt="")
