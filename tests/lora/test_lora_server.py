"""LoRA adapters through a real server with the official `openai` client: adapters by name (--lora-modules, both
forms), listed by /v1/models with their parent, answering as PEFT's merged model does; loaded and unloaded at run
time with VLLM_ALLOW_RUNTIME_LORA_UPDATING, refused without it; a 404 for an unknown name."""
from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import httpx
import openai
import pytest
from conftest import hf_greedy, random_prompts, tiny_args
from test_lora import merged, write_adapter

ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    from serving import serve
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-server")
    paths = {"attn": str(root / "attn"), "mlp": str(root / "mlp"), "late": str(root / "late")}
    write_adapter(base, root / "attn", 8, ATTENTION, seed=21)
    write_adapter(base, root / "mlp", 4, MLP, seed=22)
    write_adapter(base, root / "late", 2, ["q_proj", "v_proj", "down_proj"], seed=23)
    mlp = json.dumps({"name": "mlp", "path": paths["mlp"], "base_model_name": "tiny"})
    args = tiny_args(base, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
                     f"attn={paths['attn']}", mlp)
    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}):  # for its process only
            url, _ = stack.enter_context(serve(args, root / "server.log"))
        yield url, base, paths


def _greedy_ids(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    return out.choices[0].text


def test_adapters_by_name_answer_as_peft_and_are_listed_with_their_parent(lora_server, smollm_tokenizer):
    url, base, paths = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "attn", "mlp"}
    assert models["attn"].model_extra["parent"] == "tiny" and models["attn"].model_extra["root"] == paths["attn"]
    prompt = random_prompts(1, low=6, high=7, seed=8)[0]
    texts = {name: _greedy_ids(client, name, prompt) for name in ("tiny", "attn", "mlp")}
    for name in ("attn", "mlp"):
        want = smollm_tokenizer.decode(hf_greedy(merged(base, paths[name]), prompt, 12))
        assert texts[name] == want, name
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)


def test_adapters_load_and_unload_at_run_time(lora_server, smollm_tokenizer):
    url, base, paths = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    prompt = random_prompts(1, low=6, high=7, seed=9)[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=prompt, max_tokens=2)
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]})
    assert loaded.status_code == 200, loaded.text
    assert _greedy_ids(client, "late", prompt) == smollm_tokenizer.decode(hf_greedy(merged(base, paths["late"]),
                                                                                    prompt, 12))
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "no PEFT adapter directory" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=prompt, max_tokens=2)
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    assert _greedy_ids(client, "attn", prompt)  # still serving


def test_run_time_updating_is_refused_without_the_opt_in(tiny_server):
    answer = httpx.post(f"{tiny_server}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert answer.status_code == 404
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in answer.json()["error"]["message"]

