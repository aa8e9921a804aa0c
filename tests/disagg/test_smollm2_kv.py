"""The embedded SmolLM2 moved between two offline engines: the decode engine's blocks hold exactly the prefill
engine's KV of the received tokens, and it computes only the prompt's last token. (Its greedy tokens are not held to
one engine's: disagg_support.engine_args says why.) Slow: two SmolLM2 engines (~1 min on a loaded 2-core machine)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("nixl", reason="the NixlConnector's transport (pip install nixl, or make install-test)")

from disagg.disagg_support import with_free_kv_port  # noqa: E402
from pressroom import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "Here is one fact about the moon landing in history, as the people who were there tell it: it was"


def engine(path: str, role: str) -> LLM:
    def build(port: int) -> LLM:
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": port, "kv_buffer_size": 32 << 20}
        return LLM(path, kv_cache_memory_gib=0.05, enable_prefix_caching=False, kv_transfer_config=json.dumps(config))
    return with_free_kv_port(build)


def test_the_decode_engine_gets_the_prefill_engines_kv_exactly(embedded_path):
    with engine(embedded_path, "kv_producer") as producer, engine(embedded_path, "kv_consumer") as consumer:
        pcore, ccore = producer.engine.core, consumer.engine.core
        staged, loads = {}, []
        after_update, before_step = pcore.kv_connector.after_update, ccore.kv_connector.before_step

        def record_saves(outputs, rpc):
            for _, blocks, _, num_tokens in pcore.kv_connector._to_save.values():
                staged.update(blocks=list(blocks), num_tokens=num_tokens)
            return after_update(outputs, rpc)

        def record_loads(rpc):
            loads.extend(ccore.kv_connector._loads)
            return before_step(rpc)

        pcore.kv_connector.after_update, ccore.kv_connector.before_step = record_saves, record_loads
        stage = SamplingParams(temperature=0, max_tokens=1,
                               extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        out = producer.generate([PROMPT], stage)[0]
        params = out.kv_transfer_params
        n = len(out.prompt_token_ids)
        assert params["remote_num_tokens"] == staged["num_tokens"] == n - 1
        read = SamplingParams(temperature=0, max_tokens=4, extra_args={"kv_transfer_params": params})
        got = consumer.generate([PROMPT], read)[0]
        assert len(got.outputs[0].token_ids) == 4 and got.num_cached_tokens == n - 1  # one prompt token computed
        bs = params["block_size"]
        pcaches = pcore.executor.driver_worker.model_runner.kv_caches
        ccaches = ccore.executor.driver_worker.model_runner.kv_caches
        assert [mine for mine, _ in loads] and len(loads) == len(staged["blocks"])
        for k, ((mine, _), theirs) in enumerate(zip(loads, staged["blocks"])):
            used = min(bs, n - 1 - k * bs)  # the received tokens of block k
            for pcache, ccache in zip(pcaches, ccaches):  # [planes, blocks, block size, heads, dim]
                assert torch.equal(ccache[:, mine, :used], pcache[:, theirs, :used])
        assert ccore.stats().kv_transfer.tokens_received == n - 1
