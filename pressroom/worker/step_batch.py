"""One step's batch: the scheduled requests flattened into one varlen batch (decodes first) in the
persistent input buffers, the attention metadata over them, the rows that sample and the step's drafts.

Under async scheduling, a request's last input token and its drafts may still be on the device (the
previous step emitted them, the drafter left them): they are copied into the batch there, and the
drafts the previous step rejected (known only on the device) shift the request back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pressroom.attention.backend import AttentionMetadata, AttentionMetadataBuilder
from pressroom.core.outputs import PLACEHOLDER_DRAFT, SchedulerOutput
from pressroom.worker.device import to_device
from pressroom.worker.input_batch import InputBatch, StepArrays
from pressroom.worker.request_state import CachedRequestState
from pressroom.worker.speculator import SpecDecodeMetadata, Speculator
from pressroom.worker.step_output import DeviceStep


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[CachedRequestState]
    query_ends: list[int]  # exclusive end of each request's tokens in the flat batch
    sampling: list[tuple[int, CachedRequestState]]  # (batch index, state) of each request that samples
    spec: SpecDecodeMetadata  # the sampling requests' drafts


@dataclass(slots=True)
class _DeviceInputs:
    """Tokens of the batch that are only on the device, placed after the host buffers are sent."""
    from_prev: list[tuple[int, int]]  # (flat position, row in prev): the previous step's last token
    drafts: list[tuple[int, torch.Tensor]]  # (flat position, drafts a device drafter left)
    shifted: list[tuple[int, int]]  # (batch index, row in prev) of requests prev's rejections shift


class StepBatchBuilder:
    def __init__(self, device: str, block_size: int, attn_builder: AttentionMetadataBuilder, max_num_tokens: int,
                 max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.device, self.block_size, self.attn_builder = device, block_size, attn_builder
        self.inputs = InputBatch(device, attn_builder.index_dtype, max_num_tokens, max_num_seqs, max_blocks_per_seq)

    def build(self, sched: SchedulerOutput, states: dict[str, CachedRequestState], prev: DeviceStep | None,
              speculator: Speculator | None) -> StepBatch:
        """Fills the host buffers with the step (decodes first), sends them to the device in one copy and has
        the backend's builder make the attention metadata over them."""
        counts = sched.num_scheduled_tokens
        order = sorted((states[rid] for rid in counts), key=lambda s: counts[s.req_id] != 1)
        query_lens = np.fromiter((counts[s.req_id] for s in order), dtype=np.int64, count=len(order))
        host = self.inputs.begin(int(query_lens.sum()), len(order), max(len(s.block_ids) for s in order))
        on_device = self._fill_tokens(host, order, sched, prev, speculator)
        seq_lens = self._fill_positions(host, order, query_lens)
        dev = self.inputs.commit()
        loc = host.query_start_loc.tolist()
        builder = self.attn_builder
        meta = builder.build(
            num_decodes=int(np.count_nonzero(query_lens == 1)), slot_mapping=dev.slot_mapping,
            block_tables=dev.block_tables, seq_lens=dev.seq_lens, query_start_loc=loc,
            seq_lens_host=seq_lens.tolist(), max_query_len=int(query_lens.max()),
            query_start_loc_device=dev.query_start_loc if builder.needs_device_query_start_loc else None)
        self._place_device_tokens(dev.input_ids, on_device, prev)
        query_ends = loc[1:]
        sampling = [(i, s) for i, s in enumerate(order) if s.pooling is None
                    and s.num_computed_tokens + counts[s.req_id] >= len(s.token_ids) + s.num_inflight]
        drafts = sched.scheduled_spec_decode_tokens
        spec = SpecDecodeMetadata.build([len(drafts.get(s.req_id, ())) for _, s in sampling],
                                        [query_ends[i] for i, _ in sampling], self.device)
        batch = StepBatch(dev.input_ids, dev.positions, meta, order, query_ends, sampling, spec)
        if on_device.shifted:
            self._shift_by_rejections(batch, on_device.shifted, prev)
        return batch

    @staticmethod
    def _fill_tokens(host: StepArrays, order: list[CachedRequestState], sched: SchedulerOutput,
                     prev: DeviceStep | None, speculator: Speculator | None) -> _DeviceInputs:
        """Each request's known query tokens and drafts; zeros where they are on the device (returned)."""
        ids, tables = host.input_ids, host.block_tables
        on_device = _DeviceInputs([], [], [])
        at = 0  # tokens placed so far
        for i, s in enumerate(order):
            start, blocks = s.num_computed_tokens, s.block_ids
            tables[i, :len(blocks)] = blocks
            drafts = sched.scheduled_spec_decode_tokens.get(s.req_id, ())
            known_end = start + sched.num_scheduled_tokens[s.req_id] - len(drafts)
            row = prev.rows.get(s.req_id) if prev is not None else None
            if row is None:
                ids[at:at + known_end - start] = s.token_ids[start:known_end]
                at += known_end - start
            else:  # async: the last input was emitted by the step before, whose results are not booked
                on_device.from_prev.append((at, row))
                ids[at] = 0
                at += 1
                if prev.num_drafts[row]:
                    on_device.shifted.append((i, row))
            if drafts and drafts[0] == PLACEHOLDER_DRAFT:
                on_device.drafts.append((at, speculator.device_drafts(s.req_id, len(drafts))))
                ids[at:at + len(drafts)] = 0
            else:
                ids[at:at + len(drafts)] = drafts
            at += len(drafts)
        return on_device

    def _fill_positions(self, host: StepArrays, order: list[CachedRequestState], query_lens: np.ndarray
                        ) -> np.ndarray:
        """Query starts, context lengths, each token's position and KV slot; returns the context lengths."""
        starts = np.fromiter((s.num_computed_tokens for s in order), dtype=np.int64, count=len(order))
        loc = host.query_start_loc
        loc[0] = 0
        np.cumsum(query_lens, out=loc[1:], dtype=np.int32)
        seq_lens = starts + query_lens
        host.seq_lens[:] = seq_lens
        # Each token's position: its request's start plus its offset in the request's query.
        num_tokens = len(host.positions)
        np.subtract(np.arange(num_tokens), np.repeat(loc[:-1] - starts, query_lens), out=host.positions)
        positions, slots = host.positions, host.slot_mapping
        slots[:] = host.block_tables[np.repeat(np.arange(len(order)), query_lens), positions // self.block_size]
        slots *= self.block_size
        slots += positions % self.block_size
        return seq_lens

    def _place_device_tokens(self, input_ids: torch.Tensor, on_device: _DeviceInputs, prev: DeviceStep | None
                             ) -> None:
        device = self.device
        if on_device.from_prev:
            at, rows = zip(*on_device.from_prev)
            last = prev.last_tokens(to_device(torch.tensor(rows), device))
            input_ids.index_copy_(0, to_device(torch.tensor(at), device), last)
        if on_device.drafts:
            at = [p + j for p, d in on_device.drafts for j in range(len(d))]
            input_ids.index_copy_(0, to_device(torch.tensor(at), device), torch.cat([d for _, d in on_device.drafts]))

    def _shift_by_rejections(self, batch: StepBatch, shifted: list[tuple[int, int]], prev: DeviceStep) -> None:
        """Moves requests back by the drafts the previous step rejected (known only on the device): the
        scheduler booked them as accepted. Positions, slots and context lengths are recomputed there;
        the rejected drafts' KV slots are simply written again."""
        dev, meta = self.device, batch.meta
        index, rows = (to_device(torch.tensor(x), dev) for x in zip(*shifted))
        drafts = to_device(torch.tensor([prev.num_drafts[r] for _, r in shifted]), dev)
        per_req = torch.zeros(len(batch.order), dtype=torch.long, device=dev)
        per_req.index_copy_(0, index, prev.rejected(rows, drafts).long())
        lens = to_device(torch.tensor(np.diff(meta.query_start_loc)), dev)
        num_tokens = meta.query_start_loc[-1]
        batch.positions = batch.positions - torch.repeat_interleave(per_req, lens, output_size=num_tokens)
        meta.seq_lens = meta.seq_lens - per_req.to(meta.seq_lens.dtype)
        owner = torch.repeat_interleave(torch.arange(len(batch.order), device=dev), lens, output_size=num_tokens)
        blocks = meta.block_tables[owner, batch.positions // self.block_size].long()
        meta.slot_mapping = blocks * self.block_size + batch.positions % self.block_size
        if dev != "cuda":  # the CPU backend reads host lengths (free here); the GPU backend never does
            meta.seq_lens_host = meta.seq_lens.tolist()
