"""`pressroom serve --speculative-config JSON`: same greedy text as without, and vLLM's spec metrics."""
from __future__ import annotations

import json

import httpx
import openai
from serving import serve

from pressroom import LLM, SamplingParams


def _metrics(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, s.labels.get("position", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_server_speculates_and_reports_it(tiny_model_dir, tmp_path):
    prompt = "one two three four one two three four one two three four one two"
    args = ["serve", tiny_model_dir("llama"), "--served-model-name", "tiny", "--dtype", "float32",
            "--kv-cache-memory-gib", "0.05"]
    spec = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                "adaptive_token_budget": False})]
    with serve(args + spec, tmp_path / "server.log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        m = _metrics(url)
    # The same request without speculation, in-process (a second server would only cost its start-up).
    plain = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05).generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert out.choices[0].text == plain[0].outputs[0].text
    drafts = m[("vllm:spec_decode_num_drafts_total", "")]
    accepted = m[("vllm:spec_decode_num_accepted_tokens_total", "")]
    assert drafts > 0 and m[("vllm:spec_decode_num_draft_tokens_total", "")] >= accepted
    assert m[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] <= drafts
    per_pos = sum(v for (name, pos), v in m.items() if name.endswith("accepted_tokens_per_pos_total"))
    assert per_pos == accepted
