"""The persistent input batch: one step's inputs laid out in buffers allocated once, and the runner's
`StepBatchBuilder.build` filling them with exactly the flat batch it built from Python lists before."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pressroom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pressroom.sampling_params import SamplingParams
from pressroom.worker.input_batch import InputBatch
from pressroom.worker.model_runner import ModelRunner


def test_fields_are_aligned_views_of_one_buffer():
    batch = InputBatch("cpu", torch.int64, max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=8)
    capacity = batch.capacity
    host = batch.begin(num_tokens=7, num_reqs=3, width=5)
    host.input_ids[:] = np.arange(7)
    host.block_tables[1, :2] = [4, 9]
    dev = batch.commit()
    base = batch.host.data_ptr()
    for t in (dev.input_ids, dev.positions, dev.slot_mapping, dev.seq_lens, dev.query_start_loc, dev.block_tables):
        assert t.is_contiguous() and (t.data_ptr() - base) % 16 == 0
        assert base <= t.data_ptr() < base + capacity
    assert dev.input_ids.tolist() == list(range(7))
    assert dev.block_tables.shape == (3, 5) and dev.block_tables.tolist()[1] == [4, 9, 0, 0, 0]
    assert dev.query_start_loc.dtype == torch.int32 and dev.seq_lens.dtype == torch.int64
    host = batch.begin(num_tokens=2, num_reqs=2, width=2)  # the tables come back zeroed
    assert not host.block_tables.any()
    batch.commit()
    assert batch.capacity == capacity


def test_a_larger_step_grows_the_buffer():
    batch = InputBatch("cpu", torch.int32, max_num_tokens=4, max_num_seqs=2, max_blocks_per_seq=2)
    host = batch.begin(num_tokens=100, num_reqs=10, width=20)
    host.block_tables[9, 19] = 7
    dev = batch.commit()
    assert dev.block_tables.dtype == torch.int32 and int(dev.block_tables[9, 19]) == 7
    assert dev.input_ids.shape == (100,)


def _request(rid: str, tokens: list[int], blocks: list[int], computed: int) -> NewRequestData:
    return NewRequestData(rid, tokens, len(tokens), SamplingParams(max_tokens=8), blocks, computed)


def _reference(runner: ModelRunner, sched: SchedulerOutput):
    """The flat batch as the runner built it from lists before the persistent input batch."""
    counts, bs = sched.num_scheduled_tokens, runner.block_size
    reqs = sorted((runner.states[rid] for rid in counts), key=lambda s: counts[s.req_id] != 1)
    ids, positions, slots, lens, loc = [], [], [], [], [0]
    tables = np.zeros((len(reqs), max(len(s.block_ids) for s in reqs)), dtype=np.int64)
    for i, s in enumerate(reqs):
        start, n = s.num_computed_tokens, counts[s.req_id]
        drafts = sched.scheduled_spec_decode_tokens.get(s.req_id, ())
        tables[i, :len(s.block_ids)] = s.block_ids
        ids += s.token_ids[start:start + n - len(drafts)] + list(drafts)
        positions += list(range(start, start + n))
        slots += [s.block_ids[p // bs] * bs + p % bs for p in range(start, start + n)]
        lens.append(start + n)
        loc.append(loc[-1] + n)
    return [s.req_id for s in reqs], ids, positions, slots, lens, loc, tables.tolist()


def test_prepare_fills_the_persistent_buffers():
    runner = ModelRunner(nn.Linear(2, 2), block_size=4, dtype=torch.float32, max_num_seqs=4,
                         max_num_batched_tokens=16)
    runner.initialize_kv_cache(num_blocks=64, max_model_len=64)
    first = SchedulerOutput(
        [_request("prefill", list(range(100, 110)), [3, 7, 9], 0),
         _request("decode", list(range(200, 206)), [5, 6], 5),
         _request("chunk", list(range(300, 313)), [10, 11, 12, 13], 8),
         _request("verify", list(range(400, 407)), [20, 21, 22], 6)],
        [], {"prefill": 10, "decode": 1, "chunk": 3, "verify": 3}, 17,
        scheduled_spec_decode_tokens={"verify": [41, 42]})
    steps = [first, SchedulerOutput([], [CachedRequestData("decode", [8], 6), CachedRequestData("prefill", [], 10)],
                                    {"decode": 1, "prefill": 1}, 2)]
    buffer = None
    for step, sched in enumerate(steps):
        runner._update_states(sched)
        if step:  # what the first step sampled
            runner.states["decode"].token_ids.append(206)
            runner.states["prefill"].token_ids.append(110)
        batch = runner._batch_builder().build(sched, runner.states, None, None)
        order, ids, positions, slots, lens, loc, tables = _reference(runner, sched)
        meta = batch.meta
        assert [s.req_id for s in batch.order] == order
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == positions
        assert meta.slot_mapping.tolist() == slots and meta.seq_lens.tolist() == lens == meta.seq_lens_host
        assert meta.query_start_loc == loc and batch.query_ends == loc[1:]
        assert meta.block_tables.tolist() == tables and meta.block_tables.dtype == torch.int64
        assert meta.num_decodes == sum(1 for a, b in zip(loc, loc[1:]) if b - a == 1)
        assert meta.max_query_len == max(b - a for a, b in zip(loc, loc[1:]))
        assert meta.query_start_loc_device is None and meta.num_kv_splits == 1
        if buffer is None:
            buffer = runner._batch_builder().inputs.host.data_ptr()
        assert runner._batch_builder().inputs.host.data_ptr() == buffer  # no step allocates its inputs afresh
        assert buffer <= batch.input_ids.data_ptr() < buffer + runner._batch_builder().inputs.capacity
