"""The NixlConnector on its own, two connectors in this process over NIXL's UCX (no model): a producer stages a
finished request's chunks, a consumer reads them and its ranks' copies get the very bytes the producer's ranks
wrote; a corrupt chunk, a read that never ends, an unreachable producer and a consumer that never comes each end
with the prompt computed locally (or the chunks let go) and no staging slot held. The `rpc` here stands in for the
workers: it reads and writes the staging buffer as a rank's copier would."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl", reason="the NixlConnector's transport (pip install nixl, or make install-test)")

from serving import free_port  # noqa: E402

from disagg.disagg_support import with_free_kv_port  # noqa: E402
from pressroom.config import EngineArgs, KVTransferConfig  # noqa: E402
from pressroom.core.outputs import EngineCoreOutput  # noqa: E402
from pressroom.core.request import Request, RequestStatus  # noqa: E402
from pressroom.distributed.kv_transfer.base import check_kv_transfer_params  # noqa: E402
from pressroom.distributed.kv_transfer.nixl_connector import NixlConnector  # noqa: E402
from pressroom.sampling_params import SamplingParams  # noqa: E402

BS = 4
CHUNK = (2, 3, 2, BS, 8)  # kv heads, layers, planes, block size, head dim
FINGERPRINT = bytes(range(16))


def connector(role: str, **extra) -> NixlConnector:
    """A connector listening on a free port (another if NIXL finds it taken: disagg_support says why)."""
    timeout = extra.pop("timeout", 10.0)

    def build(port: int) -> NixlConnector:
        config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_port=port, kv_buffer_size=64 << 10,
                                  transfer_timeout_s=timeout, **extra)
        return NixlConnector(config, fingerprint=FINGERPRINT, chunk_shape=CHUNK, kv_dtype=torch.float32,
                             block_size=BS)
    return with_free_kv_port(build)


@pytest.fixture
def pair():
    made = []

    def make(producer: dict | None = None, consumer: dict | None = None):
        made.extend([connector("kv_producer", **(producer or {})), connector("kv_consumer", **(consumer or {}))])
        return made[-2], made[-1]

    yield make
    for c in made:
        c.close()


PROMPT = list(range(100, 111))  # 11 tokens: the chunks cover 10, the last of them partly


def request(rid: str, params: dict, max_tokens: int = 1) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens,
                                                     extra_args={"kv_transfer_params": params}), None)


def stage(producer: NixlConnector, rid: str = "r1") -> tuple[dict, dict[int, torch.Tensor]]:
    """Runs a finished prefill through the producer; its fake ranks write a distinct pattern per block."""
    written: dict[int, torch.Tensor] = {}

    def rpc(method, saves):
        assert method == "kv_connector_save"
        for block, slot in saves:
            written[block] = torch.full(CHUNK, float(block)) + torch.arange(8.0)
            producer.staging.chunks[slot].copy_(written[block])

    req = request(rid, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH
    producer.request_finished(req, [7, 5, 9])
    out = EngineCoreOutput(rid, [42], "length")
    producer.after_update([out], rpc)
    return out.kv_transfer_params, written


def admit(consumer: NixlConnector, req: Request, local_tokens: int = 0, deadline_s: float = 10.0) -> int:
    """Polls as the scheduler does until the transfer is settled: the tokens it loads."""
    deadline = time.monotonic() + deadline_s
    while (n := consumer.get_num_new_matched_tokens(req, local_tokens)) is None:
        assert time.monotonic() < deadline, "the transfer never settled"
        time.sleep(0.01)
    return n


def wait_for(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_chunks_move_intact_and_slots_come_back(pair):
    producer, consumer = pair()
    params, written = stage(producer)
    assert params["remote_num_tokens"] == len(PROMPT) - 1 and len(params["remote_block_ids"]) == 3
    req = request("d1", params, max_tokens=5)
    consumer.check_request(params)
    assert admit(consumer, req) == len(PROMPT) - 1
    consumer.update_state_after_alloc(req, [3, 4, 6], 0, len(PROMPT) - 1)
    loaded = {}

    def rpc(method, loads):
        assert method == "kv_connector_load"
        for block, slot in loads:
            loaded[block] = consumer.staging.chunks[slot].clone()

    consumer.before_step(rpc)
    assert sorted(loaded) == [3, 4, 6]
    for mine, theirs in zip([3, 4, 6], [7, 5, 9]):
        assert torch.equal(loaded[mine], written[theirs])
    stats = consumer.stats()
    assert stats.transfers_done == 1 and stats.tokens_received == len(PROMPT) - 1 and stats.staging_slots_used == 0
    assert stats.bytes_received > 3 * consumer.staging.chunk_bytes
    wait_for(lambda: producer.stats().staging_slots_used == 0)  # the consumer's word let the producer go
    assert producer.stats().bytes_sent == producer.stats().bytes_staged > 0


def test_local_prefix_hits_are_not_read_again(pair):
    producer, consumer = pair()
    params, _ = stage(producer)
    req = request("d2", params)
    assert admit(consumer, req, local_tokens=BS) == len(PROMPT) - 1 - BS  # the first block was a local hit
    assert consumer.stats().bytes_received < 3 * consumer.staging.chunk_bytes


def test_a_corrupt_chunk_is_computed_locally(pair):
    producer, consumer = pair(producer={"fault_injection": "corrupt_staged"})
    params, _ = stage(producer)
    assert admit(consumer, request("d3", params)) == 0
    stats = consumer.stats()
    assert stats.corrupt_chunks == 1 and stats.transfers_failed == 1 and stats.staging_slots_used == 0
    wait_for(lambda: producer.stats().staging_slots_used == 0)  # told to drop them
    assert producer.stats().bytes_sent == 0


def test_a_read_that_never_ends_times_out(pair):
    producer, consumer = pair(consumer={"fault_injection": "stall_reads", "timeout": 0.5})
    params, _ = stage(producer)
    start = time.monotonic()
    assert admit(consumer, request("d4", params)) == 0
    assert 0.5 <= time.monotonic() - start < 5
    assert consumer.stats().transfers_failed == 1
    wait_for(lambda: consumer.stats().staging_slots_used == 0 and producer.stats().staging_slots_used == 0)


def test_an_unreachable_producer_times_out(pair):
    producer, consumer = pair(consumer={"timeout": 1.0})
    params, _ = stage(producer)
    params = {**params, "remote_engine_id": "gone", "remote_port": free_port()}
    assert admit(consumer, request("d5", params)) == 0
    assert consumer.stats().transfers_failed == 1 and consumer.stats().staging_slots_used == 0


def test_chunks_no_consumer_reads_expire(pair):
    producer, _ = pair(producer={"abort_request_timeout_s": 0.3})
    stage(producer)
    assert producer.stats().staging_slots_used == 3
    wait_for(lambda: producer.stats().staging_slots_used == 0)
    assert producer.stats().transfers_expired == 1


def test_an_aborted_request_does_not_stage(pair):
    producer, _ = pair()
    req = request("a1", {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_ABORTED
    producer.request_finished(req, [1, 2, 3])
    out = EngineCoreOutput("a1", [], "abort")
    producer.after_update([out], lambda *a: pytest.fail("nothing to save"))
    assert out.kv_transfer_params is None and producer.stats().staging_slots_used == 0


def test_foreign_params_are_refused_with_the_reason(pair):
    producer, consumer = pair()
    params, _ = stage(producer)
    with pytest.raises(ValueError, match="block size 8, this engine 4"):
        consumer.check_request({**params, "block_size": 8})
    with pytest.raises(ValueError, match="model fingerprints differ"):
        consumer.check_request({**params, "model_fingerprint": "00" * 16})
    with pytest.raises(ValueError, match="lacks remote_block_ids"):
        consumer.check_request({k: v for k, v in params.items() if k != "remote_block_ids"})
    with pytest.raises(ValueError, match="kv_role is kv_producer"):
        producer.check_request(params)
    with pytest.raises(ValueError, match="kv_role is kv_consumer"):
        consumer.check_request({"do_remote_decode": True})
    with pytest.raises(ValueError, match="runs no KV connector"):
        check_kv_transfer_params({"do_remote_decode": True}, None, 16)
    check_kv_transfer_params({"do_remote_decode": False}, None, 16)  # nothing asked: fine


@pytest.mark.parametrize("value, error", [
    ('{"kv_connector": "NixlConnector"}', "needs a \"kv_role\""),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_sideways"}', "kv_role 'kv_sideways'"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0}', "not a TCP port"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "bogus": 1}', "unknown kv_transfer_config key"),
    ('{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}', "NixlConnector"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backends": ["GDS"]}}',
     "UCX"),
])
def test_bad_transfer_configs_are_refused(value, error):
    with pytest.raises(ValueError, match=error):
        EngineArgs(kv_transfer_config=value).create_engine_config()


@pytest.mark.parametrize("args, error", [
    ({"kv_offloading_size": 1}, "cannot be combined"),
    ({"data_parallel_size": 2}, "one transfer agent per engine core"),
])
def test_the_connector_refuses_what_it_cannot_run_with(args, error):
    with pytest.raises(ValueError, match=error):
        EngineArgs(**args, kv_transfer_config='{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
                   ).create_engine_config()


def test_the_scheduler_admits_others_while_a_transfer_is_in_flight(pair):
    """The real Scheduler with the consumer's connector: the remote-prefill request waits while its KV is read
    (a stalled read keeps it in flight), a plain request is admitted meanwhile; once the read is done the request is
    admitted with the received tokens computed, its blocks get the chunks before its step, and one prompt token is
    scheduled."""
    from pressroom.config import SchedulerConfig
    from pressroom.core.kv_cache_manager import KVCacheManager
    from pressroom.core.outputs import ModelRunnerOutput
    from pressroom.core.scheduler import Scheduler

    producer, consumer = pair()
    params, _ = stage(producer)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256), KVCacheManager(32, BS),
                      kv_connector=consumer)
    remote, plain = request("remote", params, max_tokens=3), Request("plain", [1, 2, 3], SamplingParams(max_tokens=2),
                                                                    None)
    consumer.config = KVTransferConfig(**{**_fields(consumer.config), "fault_injection": "stall_reads"})
    sched.add_request(remote)
    sched.add_request(plain)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"plain": 3}  # the remote one waits, the plain one goes on
    sched.update_from_output(out, ModelRunnerOutput({"plain": [9]}))
    consumer.config = KVTransferConfig(**{**_fields(consumer.config), "fault_injection": None})
    deadline = time.monotonic() + 10
    loads = []
    while "remote" not in (out := sched.schedule()).num_scheduled_tokens:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    consumer.before_step(lambda method, pairs: loads.extend(pairs))
    assert out.num_scheduled_tokens["remote"] == 1 and remote.num_computed_tokens == len(PROMPT)
    new = next(n for n in out.new_requests if n.req_id == "remote")
    assert new.num_computed_tokens == len(PROMPT) - 1
    assert [block for block, _ in loads] == new.block_ids[:3] and consumer.stats().staging_slots_used == 0


def _fields(config: KVTransferConfig) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_prompt_logprobs_compute_the_prompt_here(pair):
    producer, consumer = pair()
    params, _ = stage(producer)
    req = Request("lp", list(PROMPT), SamplingParams(max_tokens=1, prompt_logprobs=1,
                                                     extra_args={"kv_transfer_params": params}), None)
    assert consumer.get_num_new_matched_tokens(req, 0) == 0
    assert consumer.stats().bytes_received == 0 and consumer.stats().staging_slots_used == 0


def test_a_kv_port_taken_after_it_was_picked_is_traded_for_another(monkeypatch):
    """The race disagg_support mends: the first port handed out is held by another socket when NIXL binds it; the
    connector comes up on the next one instead of failing the test run."""
    import socket

    from disagg import disagg_support
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    handed = iter([taken])
    monkeypatch.setattr(disagg_support, "free_port", lambda: next(handed, None) or free_port())
    tried: list[int] = []
    try:
        c = disagg_support.with_free_kv_port(lambda port: tried.append(port) or NixlConnector(
            KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer", kv_port=port,
                             kv_buffer_size=64 << 10), fingerprint=FINGERPRINT, chunk_shape=CHUNK,
            kv_dtype=torch.float32, block_size=BS))
        c.close()
    finally:
        held.close()
    assert tried[0] == taken and len(tried) == 2 and tried[1] != taken
