"""The disk tier outlives the server: a second `pressroom serve` on the same path loads the prefixes the first
one computed (counted in /metrics) and answers exactly as the first did (real servers, the openai client)."""
from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving import serve

BLOCK = 16


def requests_over_shared_prefixes(prefixes: int, prefix_len: int, seed: int = 5) -> list[list[int]]:
    """Each of `prefixes` distinct prefixes twice, with short tails, in random order."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 4000) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = [h + [rng.randrange(1, 4000) for _ in range(rng.randrange(3, 12))] for h in heads for _ in range(2)]
    rng.shuffle(prompts)
    return prompts


def run_all(url: str, prompts: list[list[int]]) -> list[list[str]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def one(prompt: list[int]) -> str:
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts))


def fs_chunk_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(r'kv_offload_tiering_chunk_hits_total\{[^}]*tier="1:fs"[^}]*\} (\S+)', text)
    assert found, text[-3000:]
    return float(found.group(1))


# Two servers each (11 s in CI at a fifth of the size, 100 requests over 50 distinct 2,000-token prefixes,
# about a minute): both with test-slow. CI checks what the disk tier reads back in test_offload_faults.py.
@pytest.mark.parametrize("prefixes, prefix_len", [pytest.param(10, 400, marks=pytest.mark.slow),
                                                   pytest.param(50, 2000, marks=pytest.mark.slow)])
def test_a_restarted_server_loads_its_prefixes_from_disk(prefixes, prefix_len, tiny_model_dir, tmp_path):
    model, disk = tiny_model_dir("llama"), tmp_path / "kv"
    args = ["serve", "--model", model, "--dtype", "float32", "--num-gpu-blocks-override", "520",
            "--kv-offloading-size", "0.02", "--kv-offloading-disk-path", str(disk), "--max-num-seqs", "4"]
    prompts = requests_over_shared_prefixes(prefixes, prefix_len)
    with serve(args, tmp_path / "first.log") as (url, _):
        first = run_all(url, prompts)
    assert len(list(disk.glob("*/*.kv"))) >= prefixes * prefix_len // BLOCK  # every prefix block, flushed
    with serve(args, tmp_path / "second.log") as (url, _):
        second = run_all(url, prompts)
        loaded_tokens = fs_chunk_hits(url) * BLOCK
    assert second == first
    assert loaded_tokens >= 0.95 * prefixes * prefix_len, loaded_tokens
