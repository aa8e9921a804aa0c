"""Engines of different tensor-parallel sizes exchange KV: the chunks are head-major over every KV head, so each rank
copies its own heads. A one-rank producer feeds a two-rank consumer and the other way round (offline engines, the
ranks in worker processes); each consumer's greedy tokens equal its own when it computes the prompts itself.
Slow: an engine of two ranks (~20 s on a loaded 2-core machine)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("nixl", reason="the NixlConnector's transport (pip install nixl, or make install-test)")

from disagg.disagg_support import with_free_kv_port  # noqa: E402
from pressroom import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [f"Here is one fact about topic number {i} in history{' again' * i}: it" for i in range(6)]


def engine(model: str, role: str, tp: int) -> LLM:
    def build(port: int) -> LLM:
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": port, "kv_buffer_size": 16 << 20}
        return LLM(model, dtype="float32", kv_cache_memory_gib=0.02, tensor_parallel_size=tp,
                   enable_prefix_caching=False, kv_transfer_config=json.dumps(config))
    return with_free_kv_port(build)


@pytest.mark.parametrize("producer_tp, consumer_tp", [(1, 2), (2, 1)])
def test_engines_of_other_tp_sizes_exchange_kv(tiny_model_dir, producer_tp, consumer_tp):
    model = tiny_model_dir("llama")
    with engine(model, "kv_producer", producer_tp) as producer, engine(model, "kv_consumer", consumer_tp) as consumer:
        greedy = SamplingParams(temperature=0, max_tokens=8)
        want = [o.outputs[0].token_ids for o in consumer.generate(PROMPTS, greedy)]
        stage = SamplingParams(temperature=0, max_tokens=1,
                               extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        got = []
        for prompt in PROMPTS:
            params = producer.generate([prompt], stage)[0].kv_transfer_params
            assert params["tp_size"] == producer_tp
            read = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_transfer_params": params})
            got.append(consumer.generate([prompt], read)[0].outputs[0].token_ids)
        assert got == want
        stats = consumer.engine.core.stats().kv_transfer
        assert stats.transfers_done == len(PROMPTS) and stats.transfers_failed == 0 and stats.tokens_received > 0
