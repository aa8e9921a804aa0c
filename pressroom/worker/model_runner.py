"""Owns the model, the KV cache tensors and per-request device-side state; runs one step.

Each step flattens the scheduled requests into one varlen batch (decodes first), runs the
model under a forward context carrying the attention metadata, and samples where a request's
known tokens are all computed. On CUDA, decode-only steps replay a captured graph when one fits.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pressroom.attention.backend import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder, forward_context
from pressroom.attention.torch_ref import make_cpu_backend
from pressroom.core.outputs import (
    PLACEHOLDER_DRAFT,
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TopLogprobs,
)
from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size
from pressroom.kv_offload.slab import SlabHandle
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.linear import QKVParallelLinear, head_split
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams
from pressroom.worker.device import to_device
from pressroom.worker.grammar import GrammarReader, RequestGrammar, constrain
from pressroom.worker.input_batch import InputBatch
from pressroom.worker.offload_copier import HeadRange, OffloadCopier
from pressroom.worker.pooler import Pooler, PoolRow
from pressroom.worker.proposer import DraftRequest, Proposer, TargetStep
from pressroom.worker.rejection_sampler import verify, verify_on_device
from pressroom.worker.sampler import SamplingRow, needs_host_history, sample, sample_on_device, top_logprobs


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    # Tokens steps in flight may emit, not yet appended to token_ids (async scheduling): 1 + drafts each.
    num_inflight: int = 0
    pooling: PoolingParams | None = None  # a pooling request: pooled after its prompt, never sampled
    grammar: RequestGrammar | None = None  # structured outputs: the matcher that masks its logits

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(self.params, self.token_ids[:self.num_prompt_tokens],
                           self.token_ids[self.num_prompt_tokens:], self.eos_token_id)


@dataclass(slots=True)
class DeviceStep:
    """The last launched step's emitted tokens, left on the device as the next step's inputs."""
    rows: dict[str, int]  # request id -> row
    tokens: torch.Tensor  # [rows, width]: accepted drafts, then the target's token; padded
    counts: torch.Tensor | None  # [rows] tokens emitted per row; None: one each
    num_drafts: list[int]  # per row, the drafts it verified (its next positions shift by the rejected ones)

    def last_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        if self.counts is None:
            return self.tokens[rows, 0]
        return self.tokens[rows, self.counts[rows] - 1]

    def rejected(self, rows: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
        return num_drafts - (self.counts[rows] - 1)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass(slots=True)
class PendingOutput(AsyncModelRunnerOutput):
    """A step's output whose emitted tokens may still be on their way from the device."""
    output: ModelRunnerOutput
    states: list[CachedRequestState]  # the sampled requests, in the order of `tokens`' rows
    tokens: torch.Tensor | None  # [rows, width] host copy (pinned, filled asynchronously on CUDA)
    counts: torch.Tensor | None = None  # [rows] tokens emitted per row; None: one each
    spans: list[int] | None = None  # per row, the tokens it had in flight (1 + drafts); None: one each
    copied: torch.cuda.Event | None = None
    resolved: bool = False
    transferred: torch.cuda.Event | None = None  # the step's KV offload copies (their slots return with the output)

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingOutput:
        return cls(output, [], None, resolved=True)

    @classmethod
    def start(cls, output: ModelRunnerOutput, states: list[CachedRequestState], tokens: torch.Tensor,
              counts: torch.Tensor | None = None, spans: list[int] | None = None) -> PendingOutput:
        if not tokens.is_cuda:
            return cls(output, states, tokens, counts, spans)
        tokens, counts = _pinned_copy(tokens), None if counts is None else _pinned_copy(counts)
        copied = torch.cuda.Event()
        copied.record()
        return cls(output, states, tokens, counts, spans, copied)

    def resolve(self) -> ModelRunnerOutput:
        """Waits for the tokens, appends them to the runner's request states (in step order)."""
        if self.transferred is not None:
            self.transferred.synchronize()
            self.transferred = None
        if self.resolved:
            return self.output
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.tokens.tolist()
        counts = self.counts.tolist() if self.counts is not None else [1] * len(rows)
        spans = self.spans or [1] * len(rows)
        for state, row, n, span in zip(self.states, rows, counts, spans):
            state.token_ids.extend(row[:n])
            state.num_inflight -= span
            self.output.sampled_token_ids[state.req_id] = row[:n]
        self.resolved = True
        return self.output


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[CachedRequestState]
    query_ends: list[int]  # exclusive end of each request's tokens in the flat batch


@dataclass(slots=True)
class Emission:
    """What a step emitted: its output (pending or resolved) and, per request that sampled, its tokens,
    which the next step (async scheduling) and a device drafter read on the device."""
    pending: PendingOutput
    sampling: list[tuple[int, CachedRequestState]]  # (batch index, state) of each request that sampled
    num_drafts: list[int]  # per sampled request: the drafts it verified
    tokens: torch.Tensor | None = None  # [sampled, width] on the device: accepted drafts, then the target's token
    counts: torch.Tensor | None = None  # [sampled] tokens emitted per row; None: one each
    emitted: list[list[int]] | None = None  # the same tokens on the host, where sampling ran there

    def device_tokens(self, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`tokens` and `counts`, sent to the device once where sampling ran on the host."""
        if self.tokens is None and self.emitted is not None:
            width = 1 + max(self.num_drafts)  # as the device path pads: a drafter reads 1 + k per row
            self.tokens = to_device(torch.tensor([e + [0] * (width - len(e)) for e in self.emitted]), device)
            self.counts = to_device(torch.tensor([len(e) for e in self.emitted]), device)
        return self.tokens, self.counts

    def device_step(self, device: str) -> DeviceStep | None:
        if not self.sampling:
            return None
        tokens, counts = self.device_tokens(device)
        return DeviceStep({s.req_id: j for j, (_, s) in enumerate(self.sampling)}, tokens, counts, self.num_drafts)


def make_backend(device: str, dtype: torch.dtype, batch_invariant: bool = False) -> AttentionBackend:
    if device == "cuda":
        from pressroom.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(batch_invariant)
    return make_cpu_backend(dtype, batch_invariant)


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, dtype: torch.dtype, seed: int = 0,
                 device: str = "cpu", async_scheduling: bool = False, kv_dtype: torch.dtype | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, batch_invariant: bool = False) -> None:
        """`max_num_seqs`, `max_num_batched_tokens`: the largest step the scheduler sends, which sizes the
        persistent input batch (a larger step grows it); `batch_invariant`: the attention backend's mode."""
        self.model, self.block_size, self.dtype, self.device = model, block_size, dtype, device
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.kv_dtype = kv_dtype or dtype  # the KV cache's element type (FP8 on CUDA when asked)
        self.async_scheduling = async_scheduling
        self.pending: PendingOutput | None = None  # the last step launched (async scheduling)
        # Its emitted tokens on the device, for requests whose results the scheduler has not booked yet.
        self.prev: DeviceStep | None = None
        self.proposer: Proposer | None = None  # speculative decoding's drafter (`set_proposer`)
        # Async scheduling with a drafter: it proposes on the device, drafts stay there and the scheduler
        # sends placeholders for them.
        self.device_drafting = False
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> q of its pending drafts
        self.next_drafts: dict[str, torch.Tensor] = {}  # request id -> its pending drafts, on the device
        self.synthetic_rates: list[float] | None = None  # rejection_sample_method="synthetic"
        self.states: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.backend = make_backend(device, dtype, batch_invariant)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.max_blocks_per_seq = 0
        self.attn_builder = self._make_builder()  # remade for the cache's table width by initialize_kv_cache
        self.input_batch: InputBatch | None = None  # made at the first step after initialize_kv_cache
        self.graphs = None  # CudaGraphs once captured
        self.kv_offload: OffloadCopier | None = None  # KV offload on: the steps' copies to and from the CPU tier
        self.pooler = Pooler()
        self.grammars = GrammarReader()

    # ---- set-up ----

    def set_proposer(self, proposer: Proposer | None) -> None:
        """The drafter for speculative decoding (None: off). Under async scheduling it drafts on the device."""
        if proposer is not None and self.async_scheduling and not proposer.works_on_device:
            raise ValueError(f"{type(proposer).__name__} drafts from host token ids, so it runs with synchronous "
                             "scheduling; set async_scheduling=False.")
        self.proposer = proposer
        self.device_drafting = self.async_scheduling and proposer is not None

    def _aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs every forward pass returns for the proposer."""
        return self.proposer.aux_layers() if self.proposer is not None else ()

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.attn_builder = self._make_builder()
        self.input_batch = None
        if self.graphs is not None:  # graphs captured before: decode steps still split as theirs do
            self.attn_builder.split_as_graphs(self.graphs.shapes.get(1, []))
        self.kv_caches = self._bind_kv_caches(num_blocks)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one cache block takes across every attention layer (a latent cache: one plane)."""
        return sum(math.prod(layer.cache_shape(1, self.block_size)) for layer in self.attention_layers) \
            * self.kv_dtype.itemsize

    def _make_builder(self) -> AttentionMetadataBuilder:
        kv_heads = self.attention_layers[0].num_kv_heads if self.attention_layers else 1
        return self.backend.make_metadata_builder(self.device, kv_heads, self.max_blocks_per_seq)

    def _bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        caches = []
        for layer in self.attention_layers:
            # Zeroed: padded attention positions read block 0 and must not hold NaN garbage.
            layer.kv_cache = torch.zeros(layer.cache_shape(num_blocks, self.block_size), dtype=self.kv_dtype,
                                         device=self.device)
            layer.backend = self.backend
            caches.append(layer.kv_cache)
        return caches

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_seqs: int, max_position: int) -> int:
        """Peak bytes allocated by a forward pass of `num_tokens` prompt tokens plus sampling `num_seqs`
        rows: what the activations need on top of the weights. Runs before the KV cache exists, on a
        one-block cache (every position maps to block 0 and nothing is written)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.initialize_kv_cache(1, self.block_size)
        chunk = min(num_tokens, max_position)
        lengths = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
        loc = np.concatenate(([0], np.cumsum(lengths))).tolist()
        index = self.attn_builder.index_dtype
        meta = self.attn_builder.build(
            num_decodes=0,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(len(lengths), -(-chunk // self.block_size), dtype=index, device=self.device),
            seq_lens=torch.tensor(lengths, dtype=index, device=self.device),
            query_start_loc=loc, seq_lens_host=lengths,
            query_start_loc_device=torch.tensor(loc, dtype=torch.int32, device=self.device),
            max_query_len=chunk)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        hidden = self.run_model(ids, positions, meta)
        rows = hidden[torch.arange(num_seqs, device=self.device) % num_tokens]
        logits = None
        if hasattr(self.model, "compute_logits"):  # an encoder has no LM head: it only pools
            logits = self.model.compute_logits(rows).float()
            torch.softmax(logits, dim=-1).sort(dim=-1)  # what top-p sampling of a full batch allocates
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del hidden, rows, logits
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def profile_step_costs(self, token_counts: list[int], tokens_per_request: int, context: int | None = None,
                           repeats: int = 2) -> list[tuple[int, float]]:
        """Seconds of a step (forward pass and logits at every query token) for each token count, the
        tokens split into requests of `tokens_per_request` query tokens after `context` cached tokens
        (default one block): single-token decodes or draft verifications, the shapes the speculative
        budget weighs. Every position maps into the padding block (zeroed again after), so no real
        cache is touched."""
        costs = []
        for n in token_counts:
            batch = self._profile_batch(n, tokens_per_request, context or self.block_size)
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms up
                self._sync()
                start = time.perf_counter()
                hidden = self.run_model(batch.input_ids, batch.positions, batch.meta)
                self.model.compute_logits(hidden).float()
                self._sync()
                best = min(best, time.perf_counter() - start)
            costs.append((n, best))
        for cache in self.kv_caches:
            cache[:, 0].zero_()
        return costs

    def _profile_batch(self, n: int, per_request: int, context: int) -> StepBatch:
        bs, dev = self.block_size, self.device
        lengths = [per_request] * (n // per_request) + ([n % per_request] if n % per_request else [])
        seq_lens = [context + q for q in lengths]
        loc = np.concatenate(([0], np.cumsum(lengths))).tolist()
        index = self.attn_builder.index_dtype
        decodes = len(lengths) if per_request == 1 else 0
        meta = self.attn_builder.build(
            num_decodes=decodes,
            slot_mapping=to_device(torch.cat([torch.arange(context, context + q) % bs for q in lengths]), dev),
            block_tables=torch.zeros(len(lengths), -(-max(seq_lens) // bs), dtype=index, device=dev),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=index), dev),
            query_start_loc=loc, seq_lens_host=seq_lens, max_query_len=max(lengths))
        positions = torch.cat([torch.arange(context, context + q) for q in lengths])
        return StepBatch(torch.zeros(n, dtype=torch.long, device=dev), positions.to(dev), meta, [], loc[1:])

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def capture_cudagraphs(self, shapes: dict[int, list[int]], max_rows: int) -> None:
        """`shapes`: see CompilationConfig.graph_shapes; `max_rows`: requests a step may hold."""
        from pressroom.worker.cuda_graphs import CudaGraphs
        self.graphs = CudaGraphs(self.model, shapes, max_rows, self.max_blocks_per_seq, self.attn_builder,
                                 self.device, self._aux_layers())
        self.graphs.capture()

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a step (computed as every step's are: with the proposer's aux layers)."""
        return self._forward(input_ids, positions, meta)[0]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states of a step and, where the proposer conditions on target layers, their outputs side
        by side ([tokens, layers * width]): a captured graph's where one fits the step's shape, else eager."""
        layers = self._aux_layers()
        if self.graphs is not None and self.graphs.aux_layers == layers:
            loc = meta.query_start_loc
            key = self.graphs.key_for(len(loc) - 1, meta.max_query_len, input_ids.shape[0])
            if key is not None:
                return self.graphs.replay(key, input_ids, positions, meta)
        with forward_context(meta):
            if not layers:
                return self.model(input_ids, positions), None
            hidden, aux = self.model(input_ids, positions, layers)
        return hidden, torch.cat(aux, dim=-1)

    # ---- one step ----

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """One step: prepare the batch, run the model, sample or verify, propose the next drafts.

        Every step's output is a PendingOutput, whose tokens may still be on their way from the device.
        Synchronous scheduling resolves it here; async scheduling returns it as it is (the engine
        schedules the next step meanwhile) and keeps the step's tokens on the device as the next step's
        inputs. Nothing else in the step depends on the scheduling mode."""
        self._update_states(sched)
        transferred = None if sched.kv_transfers is None else self.kv_offload.run(self.kv_caches, sched.kv_transfers)
        if sched.is_empty:
            self.prev = None  # the scheduler books the previous step's results before the next one
            self.pending = PendingOutput.done(ModelRunnerOutput({}))
        else:
            batch = self._prepare(sched)
            hidden, features = self._forward(batch.input_ids, batch.positions, batch.meta)
            pooled = self._pool(batch, sched, hidden)
            emission = self._emit(batch, sched, hidden)
            emission.pending.output.pooled = pooled
            self.pending = emission.pending
            self.prev = emission.device_step(self.device) if self.async_scheduling else None
            self._propose_next(batch, sched, emission, features)
        self.pending.transferred = transferred
        return self.pending if self.async_scheduling else self.pending.resolve()

    def kv_chunk_shape(self) -> tuple[int, ...]:
        """One block's KV over every attention layer and every KV head of the model, as the offload tiers
        hold it (head-major: worker/offload_copier.py): [kv_heads, layers, planes, block_size, head_dim]."""
        shapes = {layer.cache_shape(1, self.block_size) for layer in self.attention_layers}
        if len(shapes) != 1:
            raise ValueError("KV offloading needs every attention layer's cache in one shape; this model's "
                             "layers differ.")
        planes, _, block, _, dim = shapes.pop()
        return (self.kv_head_range().total, len(self.attention_layers), planes, block, dim)

    def kv_head_range(self) -> HeadRange:
        """This rank's KV heads among the model's (all of them without tensor parallelism)."""
        heads = self.attention_layers[0].num_kv_heads
        if get_tp_size() == 1:
            return HeadRange(0, heads, heads)
        qkv = next((m for m in self.model.modules() if isinstance(m, QKVParallelLinear)), None)
        if qkv is None or qkv.num_kv_heads != heads:
            raise ValueError("KV offloading with tensor parallelism needs a model whose attention projects "
                             "keys and values per KV head (QKVParallelLinear); this one does not.")
        rank = get_tp_rank()
        # a replicated KV head is written by the first rank that holds it
        previous = head_split(qkv.total_heads, qkv.total_kv_heads, get_tp_size(), rank - 1) if rank else None
        writes = previous is None or previous[2] != qkv.kv_start
        return HeadRange(qkv.kv_start, heads, qkv.total_kv_heads, writes)

    def attach_kv_offload(self, handle: SlabHandle) -> None:
        """Maps the offload CPU tier's slab; each step's copies go through it from here on."""
        self.kv_offload = OffloadCopier(handle, self.kv_head_range(), self.device)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
            self.draft_probs.pop(rid, None)
            self.next_drafts.pop(rid, None)
        if self.proposer is not None and sched.finished_req_ids:
            self.proposer.forget(sched.finished_req_ids)
        self.pooler.forget(sched.finished_req_ids)
        for new in sched.new_requests:
            self.states[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, new.eos_token_id, pooling=new.pooling,
                grammar=None if new.grammar is None else
                RequestGrammar.start(self.grammars.compiled(new.grammar), new.eos_token_id, new.num_prompt_tokens))
        for cached in sched.cached_requests:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _input_batch(self) -> InputBatch:
        if self.input_batch is None:
            self.input_batch = InputBatch(self.device, self.attn_builder.index_dtype, self.max_num_batched_tokens,
                                          self.max_num_seqs, self.max_blocks_per_seq)
        return self.input_batch

    def _prepare(self, sched: SchedulerOutput) -> StepBatch:
        """Fills the persistent input batch's host buffers with the step (decodes first), sends them to the
        device in one copy and has the backend's builder make the attention metadata over them."""
        counts = sched.num_scheduled_tokens
        reqs = sorted((self.states[rid] for rid in counts), key=lambda s: counts[s.req_id] != 1)
        num_reqs, prev = len(reqs), self.prev
        query_lens = np.fromiter((counts[s.req_id] for s in reqs), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in reqs), dtype=np.int64, count=num_reqs)
        num_tokens = int(query_lens.sum())
        inputs = self._input_batch()
        host = inputs.begin(num_tokens, num_reqs, max(len(s.block_ids) for s in reqs))
        ids, tables = host.input_ids, host.block_tables
        at = 0  # tokens placed so far
        from_prev: list[tuple[int, int]] = []  # (flat position, row in prev): the previous step's last token
        device_drafts: list[tuple[int, torch.Tensor]] = []  # (flat position, drafts held on the device)
        shifted: list[tuple[int, int]] = []  # (batch index, row in prev) of requests prev's rejections shift
        for i, s in enumerate(reqs):
            start, blocks = s.num_computed_tokens, s.block_ids
            tables[i, :len(blocks)] = blocks
            drafts = sched.scheduled_spec_decode_tokens.get(s.req_id, ())
            known_end = start + counts[s.req_id] - len(drafts)
            row = prev.rows.get(s.req_id) if prev is not None else None
            if row is None:
                ids[at:at + known_end - start] = s.token_ids[start:known_end]
                at += known_end - start
            else:  # async: the last input was emitted by the step before, whose results are not booked
                from_prev.append((at, row))
                ids[at] = 0
                at += 1
                if prev.num_drafts[row]:
                    shifted.append((i, row))
            if drafts and drafts[0] == PLACEHOLDER_DRAFT:
                device_drafts.append((at, self.next_drafts[s.req_id][:len(drafts)]))
                ids[at:at + len(drafts)] = 0
            else:
                ids[at:at + len(drafts)] = drafts
            at += len(drafts)
        loc = host.query_start_loc
        loc[0] = 0
        np.cumsum(query_lens, out=loc[1:], dtype=np.int32)
        seq_lens = starts + query_lens
        host.seq_lens[:] = seq_lens
        # Each token's position: its request's start plus its offset in the request's query.
        np.subtract(np.arange(num_tokens), np.repeat(loc[:-1] - starts, query_lens), out=host.positions)
        positions = host.positions
        slots = host.slot_mapping
        slots[:] = tables[np.repeat(np.arange(num_reqs), query_lens), positions // self.block_size]
        slots *= self.block_size
        slots += positions % self.block_size
        dev = inputs.commit()
        loc_host = loc.tolist()
        builder = self.attn_builder
        meta = builder.build(
            num_decodes=int(np.count_nonzero(query_lens == 1)), slot_mapping=dev.slot_mapping,
            block_tables=dev.block_tables, seq_lens=dev.seq_lens, query_start_loc=loc_host,
            seq_lens_host=seq_lens.tolist(), max_query_len=int(query_lens.max()),
            query_start_loc_device=dev.query_start_loc if builder.needs_device_query_start_loc else None)
        input_ids = dev.input_ids
        device = self.device
        if from_prev:
            at, rows = zip(*from_prev)
            last = prev.last_tokens(to_device(torch.tensor(rows), device))
            input_ids.index_copy_(0, to_device(torch.tensor(at), device), last)
        if device_drafts:
            at = [p + j for p, d in device_drafts for j in range(len(d))]
            input_ids.index_copy_(0, to_device(torch.tensor(at), device), torch.cat([d for _, d in device_drafts]))
        batch = StepBatch(input_ids, dev.positions, meta, reqs, loc_host[1:])
        if shifted:
            self._shift_by_rejections(batch, shifted)
        return batch

    def _shift_by_rejections(self, batch: StepBatch, shifted: list[tuple[int, int]]) -> None:
        """Moves requests back by the drafts the previous step rejected (known only on the device): the
        scheduler booked them as accepted. Positions, slots and context lengths are recomputed there;
        the rejected drafts' KV slots are simply written again."""
        dev, meta, prev = self.device, batch.meta, self.prev
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

    def _sampling_rows(self, batch: StepBatch, sched: SchedulerOutput) -> list[tuple[int, CachedRequestState]]:
        """(index in the batch, state) of each request whose step reaches the end of its known tokens."""
        counts = sched.num_scheduled_tokens
        return [(i, s) for i, s in enumerate(batch.order) if s.pooling is None
                and s.num_computed_tokens + counts[s.req_id] >= len(s.token_ids) + s.num_inflight]

    def _pool(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[str, list[float]]:
        """The vectors of the pooling requests whose prompts this step finished (worker/pooler.py)."""
        counts = sched.num_scheduled_tokens
        rows = [PoolRow(s.req_id, s.pooling, batch.query_ends[i] - counts[s.req_id], batch.query_ends[i],
                        s.num_computed_tokens, s.num_prompt_tokens)
                for i, s in enumerate(batch.order) if s.pooling is not None]
        return self.pooler.pool(hidden, rows) if rows else {}

    def _last_hidden(self, batch: StepBatch, hidden: torch.Tensor, rows: list[tuple[int, CachedRequestState]]):
        index = torch.tensor([batch.query_ends[i] - 1 for i, _ in rows])
        return hidden.index_select(0, to_device(index, hidden.device))

    def _sample_on_host(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                        sampling: list[tuple[int, CachedRequestState]], drafts: dict[str, list[int]]
                        ) -> ModelRunnerOutput:
        """Samples, and verifies `drafts` (the scheduled drafts' ids), on the host with each request's token
        history; appends the emitted tokens to the request states."""
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        for i, s in enumerate(batch.order):
            if s.params.prompt_logprobs is not None and s.num_computed_tokens < max(1, s.num_prompt_tokens - 1):
                out.prompt_logprobs[s.req_id] = self._prompt_logprobs(s, hidden, batch, i, sched)
        verifying = [(i, s) for i, s in sampling if s.req_id in drafts]
        plain = [(i, s) for i, s in sampling if s.req_id not in drafts]
        if verifying:
            self._verify(batch, drafts, hidden, verifying, out)
        if plain:
            logits = self.model.compute_logits(self._last_hidden(batch, hidden, plain)).float()
            self._constrain(logits, [s for _, s in plain])
            rows = [s.sampling_row() if needs_host_history(s.params) else SamplingRow(s.params, [], [], s.eos_token_id)
                    for _, s in plain]  # token histories are copied only where the sampler reads them
            tokens, lps = sample(logits, rows, self.generator)
            for (_, s), token, lp in zip(plain, tokens, lps):
                s.token_ids.append(token)
                out.sampled_token_ids[s.req_id] = [token]
                if lp is not None:
                    out.logprobs[s.req_id] = [lp]
        return out

    def _verify(self, batch: StepBatch, drafts: dict[str, list[int]], hidden: torch.Tensor,
                verifying: list[tuple[int, CachedRequestState]], out: ModelRunnerOutput) -> None:
        """Checks each request's drafts against the target's logits at its 1 + k positions (one LM-head
        call for all of them)."""
        all_logits = self.model.compute_logits(self._verify_hidden(batch, hidden, verifying, drafts)).float()
        self._constrain(all_logits, [s for _, s in verifying], drafts)
        start = 0
        for _, s in verifying:
            n = len(drafts[s.req_id]) + 1
            logits, start = all_logits[start:start + n], start + n
            self._verify_one(s, drafts[s.req_id], logits, out)

    @staticmethod
    def _verify_hidden(batch: StepBatch, hidden: torch.Tensor, rows: list[tuple[int, CachedRequestState]],
                       drafts: dict[str, list[int]]) -> torch.Tensor:
        """Hidden states at each row's last 1 + k positions (k: its drafts), row after row."""
        index = [p for i, s in rows
                 for p in range(batch.query_ends[i] - len(drafts.get(s.req_id, ())) - 1, batch.query_ends[i])]
        return hidden.index_select(0, to_device(torch.tensor(index), hidden.device))

    def _verify_one(self, s: CachedRequestState, drafts: list[int], logits: torch.Tensor,
                    out: ModelRunnerOutput) -> None:
        outputs = s.token_ids[s.num_prompt_tokens:]
        rows = [SamplingRow(s.params, s.token_ids[:s.num_prompt_tokens], outputs + drafts[:j], s.eos_token_id)
                for j in range(len(drafts) + 1)]
        q = self.draft_probs.pop(s.req_id, None)
        tokens = verify(logits, rows, drafts, None if q is None else q[:len(drafts)], self.generator,
                        self.synthetic_rates)
        s.token_ids.extend(tokens)
        out.sampled_token_ids[s.req_id] = tokens
        if s.params.logprobs is not None:
            raw = torch.log_softmax(logits, dim=-1)
            out.logprobs[s.req_id] = [top_logprobs(raw[j], t, s.params.logprobs) for j, t in enumerate(tokens)]

    def _hand_over_features(self, batch: StepBatch, sched: SchedulerOutput, out: ModelRunnerOutput,
                            features: torch.Tensor) -> None:
        """The target features (its aux layers) at each request's positions this step verified: every
        query token, except the rejected drafts of a verification."""
        for i, s in enumerate(batch.order):
            first = batch.query_ends[i - 1] if i else 0
            end = batch.query_ends[i]
            if s.req_id in sched.scheduled_spec_decode_tokens:  # the last verified token + the accepted drafts
                end = first + len(out.sampled_token_ids[s.req_id])
            self.proposer.observe_features(s.req_id, features[first:end])

    def _propose(self, states: list[CachedRequestState], out: ModelRunnerOutput, limits: dict[str, int]) -> None:
        """Drafts for each request's next step (at most its planned limit, where the budget plans them);
        their probabilities stay here until verification."""
        requests = [DraftRequest(s.req_id, s.token_ids,
                                 min(s.params.max_tokens - self._num_outputs(s) - 1, limits.get(s.req_id, 1 << 30)),
                                 s.params) for s in states]
        for s in states:
            self.draft_probs.pop(s.req_id, None)
        for rid, draft in self.proposer.propose(requests).items():
            out.draft_token_ids[rid] = self._grammar_prefix(self.states[rid], draft.token_ids)
            if draft.confidences is not None:
                out.draft_confidences[rid] = draft.confidences
            if draft.probs is not None:
                self.draft_probs[rid] = draft.probs

    @staticmethod
    def _grammar_prefix(s: CachedRequestState, drafts: list[int]) -> list[int]:
        """A structured request's drafts up to the first its grammar forbids (verifying past it is wasted)."""
        if s.grammar is None or s.grammar.broken:
            return drafts
        s.grammar.catch_up(s.token_ids)
        return drafts[:s.grammar.valid_prefix(drafts)]

    @staticmethod
    def _num_outputs(s: CachedRequestState) -> int:
        return len(s.token_ids) - s.num_prompt_tokens

    @torch.inference_mode()
    def step_logits(self, sched: SchedulerOutput) -> tuple[list[CachedRequestState], torch.Tensor]:
        """Runs a step and returns, instead of sampling, the logits of each request that reached the end
        of its tokens (a draft model's runner samples them itself)."""
        self._update_states(sched)
        batch = self._prepare(sched)
        hidden = self.run_model(batch.input_ids, batch.positions, batch.meta)
        rows = self._sampling_rows(batch, sched)
        return [s for _, s in rows], self.model.compute_logits(self._last_hidden(batch, hidden, rows)).float()

    # ---- sample or verify ----

    def _emit(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor) -> Emission:
        """Samples, or verifies the scheduled drafts: on the device, unless some request's sampling reads
        its token history or reports logprobs (then on the host)."""
        sampling = self._sampling_rows(batch, sched)
        if any(needs_host_history(s.params) for s in batch.order):
            return self._emit_on_host(batch, sched, hidden, sampling)
        return self._emit_on_device(batch, sched, hidden, sampling)

    def _emit_on_device(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                        sampling: list[tuple[int, CachedRequestState]]) -> Emission:
        """Samples (verifies, where drafts were scheduled) with no host round trip and starts the copy of
        the tokens home without waiting for it."""
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        if not sampling:
            return Emission(PendingOutput.done(out), [], [])
        num_drafts = [len(sched.scheduled_spec_decode_tokens.get(s.req_id, ())) for _, s in sampling]
        states = [s for _, s in sampling]
        if not any(num_drafts):
            logits = self.model.compute_logits(self._last_hidden(batch, hidden, sampling)).float()
            self._constrain(logits, states)
            rows = [SamplingRow(s.params, [], [], s.eos_token_id) for s in states]
            tokens, counts = sample_on_device(logits, rows, self.generator).unsqueeze(1), None
        else:
            spec = {s.req_id: [0] * k for s, k in zip(states, num_drafts)}
            logits = self.model.compute_logits(self._verify_hidden(batch, hidden, sampling, spec)).float()
            self._constrain(logits, states, {s.req_id: self._host_drafts(sched, s) for s in states})
            kmax = max(num_drafts)
            at = [batch.query_ends[i] - k + min(j, k - 1) if k else 0
                  for (i, _), k in zip(sampling, num_drafts) for j in range(kmax)]
            drafts = batch.input_ids[to_device(torch.tensor(at, dtype=torch.long), batch.input_ids.device)]
            drafts = drafts.view(len(sampling), kmax)
            tokens, counts = verify_on_device(logits, [s.params for s in states], num_drafts, drafts,
                                              self._draft_q(sampling, num_drafts), self.generator,
                                              self.synthetic_rates)
        spans = [1 + k for k in num_drafts]
        for s, span in zip(states, spans):
            s.num_inflight += span
        pending = PendingOutput.start(out, states, tokens, counts, spans if counts is not None else None)
        return Emission(pending, sampling, num_drafts, tokens, counts)

    def _emit_on_host(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                      sampling: list[tuple[int, CachedRequestState]]) -> Emission:
        """Samples and verifies on the host, once the step in flight (async scheduling) is resolved: the
        sampler reads complete token histories. Drafts left on the device are fetched first."""
        if self.pending is not None:
            self.pending.resolve()
        drafts = {rid: self.next_drafts[rid][:len(d)].tolist() if d and d[0] == PLACEHOLDER_DRAFT else list(d)
                  for rid, d in sched.scheduled_spec_decode_tokens.items()}
        out = self._sample_on_host(batch, sched, hidden, sampling, drafts)
        return Emission(PendingOutput.done(out), sampling, [len(drafts.get(s.req_id, ())) for _, s in sampling],
                        emitted=[out.sampled_token_ids[s.req_id] for _, s in sampling])

    def _constrain(self, logits: torch.Tensor, states: list[CachedRequestState],
                   drafts: dict[str, list[int]] | None = None) -> None:
        """Masks the tokens each structured request's grammar forbids, at each of its 1 + k logits rows (k: its
        drafts). Under async scheduling the step in flight is resolved first: the matchers advance on its
        tokens (the device is busy with this step's forward meanwhile, so little is lost)."""
        if all(s.grammar is None for s in states):
            return
        if self.pending is not None:
            self.pending.resolve()
        constrain(logits, [(s.grammar, s.token_ids, drafts.get(s.req_id, ()) if drafts else ()) for s in states])

    def _host_drafts(self, sched: SchedulerOutput, s: CachedRequestState) -> list[int]:
        """The drafts a request verifies this step: their ids where its grammar must see them (fetched from the
        device under async drafting), else placeholders that only count."""
        drafts = sched.scheduled_spec_decode_tokens.get(s.req_id, [])
        if s.grammar is None or not drafts or drafts[0] != PLACEHOLDER_DRAFT:
            return drafts
        return self.next_drafts[s.req_id][:len(drafts)].tolist()

    def _draft_q(self, sampling: list[tuple[int, CachedRequestState]], num_drafts: list[int]) -> torch.Tensor | None:
        """[rows, kmax, vocab]: q of each sampled (not greedy) row's drafts; None when no such row has drafts
        or the proposal is deterministic (verification then takes q as one-hot)."""
        kmax = max(num_drafts)
        wanted = [s for (_, s), k in zip(sampling, num_drafts) if k and not s.params.greedy]
        if not wanted or not self.proposer.gives_probabilities:
            return None
        missing = [s.req_id for s in wanted if s.req_id not in self.draft_probs]
        if missing:  # treating such drafts as certain would bias the sample: a bug, not a fallback
            raise RuntimeError(f"No draft probabilities for sampled requests {missing}.")
        some = next(iter(self.draft_probs.values()))
        q = some.new_zeros(len(sampling), kmax, some.shape[-1])  # greedy rows: never read
        for j, (_, s) in enumerate(sampling):
            probs = self.draft_probs.get(s.req_id)
            if probs is not None:  # a host drafter's rows differ in length; a device drafter's are K long
                q[j, :min(kmax, len(probs))] = probs[:kmax]
        return q

    def _propose_next(self, batch: StepBatch, sched: SchedulerOutput, emission: Emission,
                      features: torch.Tensor | None) -> None:
        """Drafts for the next step: on the device right away where the proposer drafts there under async
        scheduling, else from the step's tokens once they are on the host (synchronous scheduling only:
        `set_proposer` sees to that)."""
        if self.proposer is None:
            return
        if self.device_drafting:
            self._launch_drafts(batch, sched, emission)
            return
        out = emission.pending.resolve()
        if features is not None:
            self._hand_over_features(batch, sched, out, features)
        self._propose([s for _, s in emission.sampling], out, sched.draft_limits)

    def _launch_drafts(self, batch: StepBatch, sched: SchedulerOutput, emission: Emission) -> None:
        """Hands the step to the device drafter (which mirrors every target step in its own cache) and keeps
        its drafts on the device for the next step."""
        sampling = emission.sampling
        tokens, counts = emission.device_tokens(self.device) if sampling else (None, None)
        if tokens is not None and counts is None:  # one token each
            counts = torch.ones(len(sampling), dtype=torch.long, device=tokens.device)
        step = TargetStep(batch.input_ids, batch.positions, batch.meta, [i for i, _ in sampling],
                          emission.num_drafts, tokens, counts, [s.params for _, s in sampling],
                          [sched.draft_limits.get(s.req_id, 1 << 30) for _, s in sampling],
                          [s.req_id for s in batch.order], [s.token_ids for s in batch.order],
                          [s.num_computed_tokens for s in batch.order])
        proposed = self.proposer.propose_on_device(step)
        if proposed is None:
            return
        drafts, probs = proposed
        for j, (_, s) in enumerate(sampling):
            self.next_drafts[s.req_id] = drafts[j]
            if probs is not None and not s.params.greedy:
                self.draft_probs[s.req_id] = probs[j]
            else:
                self.draft_probs.pop(s.req_id, None)

    def _prompt_logprobs(self, s: CachedRequestState, hidden: torch.Tensor, batch: StepBatch, i: int,
                         sched: SchedulerOutput) -> list[TopLogprobs | None]:
        """Logprob of each next prompt token at the positions this chunk computed."""
        start, n = s.num_computed_tokens, sched.num_scheduled_tokens[s.req_id]
        end = min(start + n, s.num_prompt_tokens - 1)
        first = batch.query_ends[i] - n
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[first:first + end - start]).float(), dim=-1)
        result: list[TopLogprobs | None] = [None] if start == 0 else []
        for j, pos in enumerate(range(start, end)):
            result.append(top_logprobs(logprobs[j], s.token_ids[pos + 1], s.params.prompt_logprobs))
        return result
