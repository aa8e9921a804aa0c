"""KV offload through the engine: outputs with the CPU and disk tiers equal outputs without offload, while
blocks really leave the device cache and come back from both tiers."""
from __future__ import annotations

import json
import random

import pytest

from pressroom import LLM, SamplingParams

CHUNK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny llama: layers, k/v, block, kv heads, head dim, fp32
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)


def shared_prefix_prompts(n: int, prefixes: int, prefix_len: int, seed: int) -> list[list[int]]:
    """n prompts, each one of `prefixes` shared prefixes plus a short tail of its own, in random order."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 500) for _ in range(prefix_len)] for _ in range(prefixes)]
    return [heads[rng.randrange(prefixes)] + [rng.randrange(1, 500) for _ in range(rng.randrange(2, 9))]
            for _ in range(n)]


def _gen(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine(model: str, **kw) -> LLM:
    # 24 blocks of 16 tokens: two 96-token prefixes at most stay on the device
    return LLM(model, dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=24,
               max_num_seqs=2, **kw)


@pytest.mark.slow  # 1,000 requests twice: 7 s
def test_1000_requests_through_cpu_and_disk_tiers_equal_no_offload(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    prompts = shared_prefix_prompts(1000, prefixes=12, prefix_len=96, seed=1)
    plain = _gen(engine(model), prompts)
    # the CPU tier holds 20 chunks of the 72 the prefixes fill: the rest come back from disk
    llm = engine(model, kv_offloading_size=20 * CHUNK_BYTES / (1 << 30), kv_offloading_disk_path=str(tmp_path))
    assert _gen(llm, prompts) == plain
    stats = llm.engine.stats().offload
    cpu, disk = stats.tiers["0:cpu"], stats.tiers["1:fs"]
    assert cpu.chunk_hits > 0 and disk.chunk_hits > 0, (cpu, disk)
    assert disk.write_bytes > 0 and disk.read_bytes > 0
    assert stats.total_bytes["device_to_cpu"] > 0 and stats.total_bytes["cpu_to_device"] > 0
    assert not any(t.corrupt_chunks for t in stats.tiers.values())


def test_an_out_of_tree_tier_by_module_path_in_vllms_config_shape(tiny_model_dir):
    """vLLM's --kv-transfer-config form, with the test tier (tests/kv_offload/memory_tier.py) behind the CPU
    tier: chunks go to it and come back from it, outputs unchanged."""
    import memory_tier
    model = tiny_model_dir("llama")
    prompts = shared_prefix_prompts(40, prefixes=6, prefix_len=96, seed=3)
    plain = _gen(engine(model), prompts)
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {
                  "cpu_bytes_to_use": 12 * CHUNK_BYTES, "spec_name": "TieringOffloadingSpec",
                  "secondary_tiers": [{"type": "module", "module_path": "memory_tier", "class_name": "MemoryTier",
                                       "name": "engine-test"}]}}
    llm = engine(model, kv_transfer_config=json.dumps(config))
    assert _gen(llm, prompts) == plain
    tier = llm.engine.stats().offload.tiers["1:memory"]
    assert tier.chunk_hits > 0 and tier.write_bytes > 0 and memory_tier.STORES["engine-test"]


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "not supported"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"secondary_tiers": [{"type": "fs", "path": "/tmp/x"}]}}, "CPU tier in front"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "module", "module_path": "no_such_module",
                                                          "class_name": "Tier"}]}}, "cannot be loaded"),
])
def test_bad_offload_configs_are_refused_clearly(config, message, tiny_model_dir):
    with pytest.raises(ValueError, match=message):
        engine(tiny_model_dir("llama"), kv_transfer_config=config)


@pytest.mark.slow  # two engines with two rank processes (12 s): the default suite's time
def test_chunks_are_the_same_whatever_the_tensor_parallel_size(tiny_model_dir, tmp_path):
    """Two ranks (worker processes, gloo) copy their KV heads into and out of the shared CPU tier: outputs
    equal no offload; then a single-rank engine serves from the disk chunks the two ranks wrote, and two
    ranks serve from chunks one rank wrote."""
    model = tiny_model_dir("llama")
    prompts = shared_prefix_prompts(80, prefixes=12, prefix_len=96, seed=5)
    plain = _gen(engine(model), prompts)
    cpu_gib = 20 * CHUNK_BYTES / (1 << 30)

    def served(path, **kw) -> dict:
        llm = engine(model, kv_offloading_size=cpu_gib, kv_offloading_disk_path=str(path), **kw)
        try:
            assert _gen(llm, prompts) == plain
            return llm.engine.stats().offload.tiers
        finally:
            llm.shutdown()

    two = served(tmp_path / "by-two", tensor_parallel_size=2)
    assert two["0:cpu"].chunk_hits > 0 and two["1:fs"].chunk_hits > 0 and two["1:fs"].write_bytes > 0
    assert served(tmp_path / "by-two")["1:fs"].chunk_hits > 0  # one rank reads what two wrote
    served(tmp_path / "by-one")
    assert served(tmp_path / "by-one", tensor_parallel_size=2)["1:fs"].chunk_hits > 0
