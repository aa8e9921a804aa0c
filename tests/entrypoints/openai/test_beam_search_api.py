"""use_beam_search on /v1/completions (vLLM's): n beams of each prompt, best first, equal to HF transformers' beam
search on the same weights; streamed, or with what it cannot honour, a 400 (as vLLM)."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

MODEL = "tiny"
PROMPTS = [[1, 4093, 314, 253, 1345], [1, 20, 903, 77, 5012, 8, 42]]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the tiny llama (shared: conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # beams that never end: ignore_eos on ours
    return model


def _beams(client, **fields):
    return client.completions.create(model=MODEL, prompt=PROMPTS, n=3, max_tokens=4, logprobs=1,
                                     extra_body={"use_beam_search": True, "ignore_eos": True,
                                                 "return_token_ids": True, **fields})


def test_each_prompts_n_beams_are_hfs_best_first(client, hf_model):
    out = _beams(client, temperature=0)
    assert [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        choices = out.choices[3 * i:3 * i + 3]
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                               max_new_tokens=4, early_stopping=False, pad_token_id=0)
        assert [c.token_ids for c in choices] == [row[len(prompt):].tolist() for row in hf]
        assert len({c.text for c in choices}) == 3 and all(c.finish_reason == "length" for c in choices)
        sums = [sum(c.logprobs.token_logprobs) for c in choices]
        assert sums == sorted(sums, reverse=True) and sums[0] > sums[-1]  # equal lengths: best cumulative first
    assert out.usage.completion_tokens == 6 * 4


def test_streamed_beam_search_is_a_400_as_on_vllm(server):
    """vLLM 0.32 refuses beam search streamed (its beams are known only at the end); so does pressroom, before any
    prompt work, rather than stream a part of the beams."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "n": 2, "max_tokens": 3, "use_beam_search": True,
            "ignore_eos": True, "stream": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "use_beam_search" and "Streaming is not currently supported with beam search" in \
        error["message"]


@pytest.mark.parametrize("fields, param", [
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
    ({"use_beam_search": True, "best_of": 2}, "best_of"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_it(server, fields, param):
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields},
                   timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert param in (error.get("param") or "") + error["message"]


def test_echo_shows_the_prompt_before_each_beam(client):
    out = client.completions.create(model=MODEL, prompt="The cat", n=2, max_tokens=2, logprobs=0, echo=True,
                                    extra_body={"use_beam_search": True, "ignore_eos": True, "temperature": 0})
    for choice in out.choices:
        assert choice.text.startswith("The cat") and len(choice.text) > len("The cat")
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[-2:])
        assert "".join(lp.tokens) == choice.text
