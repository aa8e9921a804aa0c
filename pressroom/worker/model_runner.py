"""Owns the model, the KV cache tensors and per-request device-side state; runs one step.

Each step flattens the scheduled requests into one varlen batch (decodes first), runs the
model under a forward context carrying the attention metadata, and samples where a request's
known tokens are all computed. On CUDA, decode-only steps replay a captured graph when one fits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pressroom.attention.backend import AttentionBackend, AttentionMetadata, forward_context
from pressroom.attention.torch_ref import make_cpu_backend
from pressroom.core.outputs import ModelRunnerOutput, SchedulerOutput, TopLogprobs
from pressroom.model.layers.attention import Attention
from pressroom.sampling_params import SamplingParams
from pressroom.spec_decode.proposer import DraftRequest, Proposer
from pressroom.worker.device import to_device
from pressroom.worker.rejection_sampler import verify
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
    num_inflight: int = 0  # sampled tokens not yet appended to token_ids (async scheduling)

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(self.params, self.token_ids[:self.num_prompt_tokens],
                           self.token_ids[self.num_prompt_tokens:], self.eos_token_id)


@dataclass(slots=True)
class PendingOutput:
    """A step's output whose sampled tokens may still be on their way from the device."""
    output: ModelRunnerOutput
    states: list[CachedRequestState]  # the sampled requests, in the order of `tokens`
    tokens: torch.Tensor | None  # host copy (pinned, filled asynchronously on CUDA)
    copied: torch.cuda.Event | None = None
    resolved: bool = False

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingOutput:
        return cls(output, [], None, resolved=True)

    @classmethod
    def start(cls, output: ModelRunnerOutput, states: list[CachedRequestState], tokens: torch.Tensor
              ) -> PendingOutput:
        if not tokens.is_cuda:
            return cls(output, states, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(output, states, host, copied)

    def resolve(self) -> ModelRunnerOutput:
        """Waits for the tokens, appends them to the runner's request states (in step order)."""
        if self.resolved:
            return self.output
        if self.copied is not None:
            self.copied.synchronize()
        for state, token in zip(self.states, self.tokens.tolist()):
            state.token_ids.append(token)
            state.num_inflight -= 1
            self.output.sampled_token_ids[state.req_id] = [token]
        self.resolved = True
        return self.output


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[CachedRequestState]
    query_ends: list[int]  # exclusive end of each request's tokens in the flat batch

    @property
    def decode_only(self) -> bool:
        return self.meta.num_decodes == len(self.order)


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim * dtype.itemsize


def make_backend(device: str, dtype: torch.dtype) -> AttentionBackend:
    if device == "cuda":
        from pressroom.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    return make_cpu_backend(dtype)


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, dtype: torch.dtype, seed: int = 0,
                 device: str = "cpu", async_scheduling: bool = False) -> None:
        self.model, self.block_size, self.dtype, self.device = model, block_size, dtype, device
        self.async_scheduling = async_scheduling
        self.pending: PendingOutput | None = None  # the last step launched (async scheduling)
        self.prev_tokens: torch.Tensor | None = None  # its sampled tokens, on the device
        self.prev_rows: dict[str, int] = {}  # request id -> row in prev_tokens
        self.proposer: Proposer | None = None  # set by the engine when speculative decoding is on
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> q of its pending drafts
        self.synthetic_rates: list[float] | None = None  # rejection_sample_method="synthetic"
        self.states: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.backend = make_backend(device, dtype)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.max_blocks_per_seq = 0
        self.graphs = None  # CudaGraphs once captured

    # ---- set-up ----

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv_caches = self._bind_kv_caches(num_blocks)

    def _bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        caches = []
        for layer in self.attention_layers:
            # Zeroed: padded attention positions read block 0 and must not hold NaN garbage.
            layer.kv_cache = torch.zeros(2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                         dtype=self.dtype, device=self.device)
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
        meta = AttentionMetadata(
            num_decodes=0, num_decode_tokens=0,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(len(lengths), -(-chunk // self.block_size), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=self.device),
            query_start_loc=loc, seq_lens_host=lengths,
            query_start_loc_device=torch.tensor(loc, dtype=torch.int32, device=self.device),
            max_query_len=chunk)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        with forward_context(meta):
            hidden = self.model(ids, positions)
        rows = hidden[torch.arange(num_seqs, device=self.device) % num_tokens]
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
                with forward_context(batch.meta):
                    hidden = self.model(batch.input_ids, batch.positions)
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
        index = torch.int32 if dev == "cuda" else torch.int64
        decodes = len(lengths) if per_request == 1 else 0
        meta = AttentionMetadata(
            num_decodes=decodes, num_decode_tokens=decodes,
            slot_mapping=to_device(torch.cat([torch.arange(context, context + q) % bs for q in lengths]), dev),
            block_tables=torch.zeros(len(lengths), -(-max(seq_lens) // bs), dtype=index, device=dev),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=index), dev),
            query_start_loc=loc, seq_lens_host=seq_lens,
            query_start_loc_device=to_device(torch.tensor(loc, dtype=torch.int32), dev) if dev == "cuda" else None,
            max_query_len=max(lengths), num_kv_splits=self._num_kv_splits(decodes))
        positions = torch.cat([torch.arange(context, context + q) for q in lengths])
        return StepBatch(torch.zeros(n, dtype=torch.long, device=dev), positions.to(dev), meta, [], loc[1:])

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def capture_cudagraphs(self, sizes: list[int]) -> None:
        from pressroom.worker.cuda_graphs import CudaGraphs
        self.graphs = CudaGraphs(self.model, sizes, self.max_blocks_per_seq, self._num_kv_splits, self.device)
        self.graphs.capture()

    def _num_kv_splits(self, num_decodes: int) -> int:
        if self.device != "cuda":
            return 1
        from pressroom.attention.triton_backend import num_kv_splits
        if self.graphs is not None and num_decodes and self.graphs.fits(num_decodes):
            num_decodes = self.graphs.padded_size(num_decodes)  # split as the graph of that size does
        return num_kv_splits(num_decodes, self.attention_layers[0].num_kv_heads, self.max_blocks_per_seq)

    # ---- one step ----

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """Sync: the step's output. Async: a PendingOutput, resolved once its tokens reach the host; the
        step's sampled tokens stay on the device as the next step's inputs."""
        self._update_states(sched)
        if sched.is_empty:
            out = ModelRunnerOutput({})
            return PendingOutput.done(out) if self.async_scheduling else out
        batch = self._prepare(sched)
        if self.graphs is not None and batch.decode_only and self.graphs.fits(len(batch.order)):
            hidden = self.graphs.replay(batch.input_ids, batch.positions, batch.meta)
        else:
            with forward_context(batch.meta):
                hidden = self.model(batch.input_ids, batch.positions)
        if not self.async_scheduling:
            return self._sample(batch, sched, hidden)
        if any(needs_host_history(s.params) for s in batch.order):
            if self.pending is not None:
                self.pending.resolve()  # this step's sampler reads complete token histories
            self.pending = PendingOutput.done(self._sample(batch, sched, hidden))
        else:
            self.pending = self._sample_ahead(batch, sched, hidden)
        return self.pending

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
            self.draft_probs.pop(rid, None)
        if self.proposer is not None and sched.finished_req_ids:
            self.proposer.forget(sched.finished_req_ids)
        for new in sched.new_requests:
            self.states[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, new.eos_token_id)
        for cached in sched.cached_requests:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare(self, sched: SchedulerOutput) -> StepBatch:
        counts = sched.num_scheduled_tokens
        reqs = sorted((self.states[rid] for rid in counts), key=lambda s: counts[s.req_id] != 1)
        num_decodes = sum(1 for s in reqs if counts[s.req_id] == 1)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        loc = [0]
        inflight_at: list[int] = []  # flat positions whose input is a token still on the device
        inflight_from: list[int] = []  # its row in the previous step's sampled tokens
        # int32 tables for the GPU kernels; the CPU paths index with int64.
        tables = np.zeros((len(reqs), max(len(s.block_ids) for s in reqs)),
                          dtype=np.int32 if self.device == "cuda" else np.int64)
        for i, s in enumerate(reqs):
            start, n = s.num_computed_tokens, counts[s.req_id]
            end, blocks = start + n, s.block_ids
            tables[i, :len(blocks)] = blocks
            drafts = sched.scheduled_spec_decode_tokens.get(s.req_id, ())
            known_end = end - len(drafts)
            ids.extend(s.token_ids[start:known_end])
            if known_end > len(s.token_ids):  # async: the last input was sampled by the step in flight
                inflight_at.append(len(ids))
                inflight_from.append(self.prev_rows[s.req_id])
                ids.append(0)
            ids.extend(drafts)
            if n == 1:
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(blocks)[pos // bs] * bs + pos % bs).tolist())
            seq_lens.append(end)
            loc.append(loc[-1] + n)
        dev = self.device
        cuda = dev == "cuda"
        meta = AttentionMetadata(
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), dev),
            block_tables=to_device(torch.from_numpy(tables), dev),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32 if cuda else torch.int64), dev),
            query_start_loc=loc, seq_lens_host=seq_lens,
            query_start_loc_device=to_device(torch.tensor(loc, dtype=torch.int32), dev) if cuda else None,
            max_query_len=max(loc[i + 1] - loc[i] for i in range(len(reqs))),
            num_kv_splits=self._num_kv_splits(num_decodes))
        input_ids = to_device(torch.tensor(ids, dtype=torch.long), dev)
        if inflight_at:
            rows = to_device(torch.tensor(inflight_from), dev)
            input_ids.index_copy_(0, to_device(torch.tensor(inflight_at), dev), self.prev_tokens.index_select(0, rows))
        return StepBatch(input_ids, to_device(torch.tensor(positions, dtype=torch.long), dev), meta, reqs, loc[1:])

    def _sampling_rows(self, batch: StepBatch, sched: SchedulerOutput) -> list[tuple[int, CachedRequestState]]:
        """(index in the batch, state) of each request whose step reaches the end of its known tokens."""
        counts = sched.num_scheduled_tokens
        return [(i, s) for i, s in enumerate(batch.order)
                if s.num_computed_tokens + counts[s.req_id] >= len(s.token_ids) + s.num_inflight]

    def _last_hidden(self, batch: StepBatch, hidden: torch.Tensor, rows: list[tuple[int, CachedRequestState]]):
        index = torch.tensor([batch.query_ends[i] - 1 for i, _ in rows])
        return hidden.index_select(0, to_device(index, hidden.device))

    def _sample(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor) -> ModelRunnerOutput:
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        sampling = self._sampling_rows(batch, sched)
        for i, s in enumerate(batch.order):
            if s.params.prompt_logprobs is not None and s.num_computed_tokens < max(1, s.num_prompt_tokens - 1):
                out.prompt_logprobs[s.req_id] = self._prompt_logprobs(s, hidden, batch, i, sched)
        verifying = [(i, s) for i, s in sampling if s.req_id in sched.scheduled_spec_decode_tokens]
        sampling = [(i, s) for i, s in sampling if s.req_id not in sched.scheduled_spec_decode_tokens]
        if verifying:
            self._verify(batch, sched, hidden, verifying, out)
        if sampling:
            logits = self.model.compute_logits(self._last_hidden(batch, hidden, sampling)).float()
            rows = [s.sampling_row() if needs_host_history(s.params) else SamplingRow(s.params, [], [], s.eos_token_id)
                    for _, s in sampling]  # token histories are copied only where the sampler reads them
            tokens, lps = sample(logits, rows, self.generator)
            for (_, s), token, lp in zip(sampling, tokens, lps):
                s.token_ids.append(token)
                out.sampled_token_ids[s.req_id] = [token]
                if lp is not None:
                    out.logprobs[s.req_id] = [lp]
        if self.proposer is not None:
            if hasattr(self.proposer, "observe_features"):
                self._hand_over_features(batch, sched, out)
            self._propose([s for _, s in sampling + verifying], out)
        self.prev_tokens, self.prev_rows = None, {}
        return out

    def _verify(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                verifying: list[tuple[int, CachedRequestState]], out: ModelRunnerOutput) -> None:
        """Checks each request's drafts against the target's logits at its 1 + k positions (one LM-head
        call for all of them)."""
        spans = []
        for i, s in verifying:
            n = len(sched.scheduled_spec_decode_tokens[s.req_id]) + 1
            spans.append(range(batch.query_ends[i] - n, batch.query_ends[i]))
        index = to_device(torch.tensor([p for span in spans for p in span]), hidden.device)
        all_logits = self.model.compute_logits(hidden.index_select(0, index)).float()
        start = 0
        for (_, s), span in zip(verifying, spans):
            logits, start = all_logits[start:start + len(span)], start + len(span)
            self._verify_one(s, sched.scheduled_spec_decode_tokens[s.req_id], logits, out)

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

    def _hand_over_features(self, batch: StepBatch, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The target features (its aux layers) at each request's positions this step verified: every
        query token, except the rejected drafts of a verification."""
        features = torch.cat(self.model.model.aux_hidden, dim=-1)
        for i, s in enumerate(batch.order):
            first = batch.query_ends[i - 1] if i else 0
            end = batch.query_ends[i]
            if s.req_id in sched.scheduled_spec_decode_tokens:  # the last verified token + the accepted drafts
                end = first + len(out.sampled_token_ids[s.req_id])
            self.proposer.observe_features(s.req_id, features[first:end])

    def _propose(self, states: list[CachedRequestState], out: ModelRunnerOutput) -> None:
        """Drafts for each request's next step; their probabilities stay here until verification."""
        requests = [DraftRequest(s.req_id, s.token_ids, s.params.max_tokens - self._num_outputs(s) - 1, s.params)
                    for s in states]
        for s in states:
            self.draft_probs.pop(s.req_id, None)
        for rid, draft in self.proposer.propose(requests).items():
            out.draft_token_ids[rid] = draft.token_ids
            if draft.confidences is not None:
                out.draft_confidences[rid] = draft.confidences
            if draft.probs is not None:
                self.draft_probs[rid] = draft.probs

    @staticmethod
    def _num_outputs(s: CachedRequestState) -> int:
        return len(s.token_ids) - s.num_prompt_tokens

    @torch.inference_mode()
    def step_logits(self, sched: SchedulerOutput) -> tuple[list[CachedRequestState], torch.Tensor]:
        """Runs a step and returns, instead of sampling, the logits of each request that reached the end
        of its tokens (a draft model's runner samples them itself)."""
        self._update_states(sched)
        batch = self._prepare(sched)
        with forward_context(batch.meta):
            hidden = self.model(batch.input_ids, batch.positions)
        rows = self._sampling_rows(batch, sched)
        return [s for _, s in rows], self.model.compute_logits(self._last_hidden(batch, hidden, rows)).float()

    def _sample_ahead(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor) -> PendingOutput:
        """Samples on the device and starts the copy home without waiting for it."""
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        sampling = self._sampling_rows(batch, sched)
        if not sampling:
            return PendingOutput.done(out)
        logits = self.model.compute_logits(self._last_hidden(batch, hidden, sampling)).float()
        rows = [SamplingRow(s.params, [], [], s.eos_token_id) for _, s in sampling]
        tokens = sample_on_device(logits, rows, self.generator)
        states = [s for _, s in sampling]
        for s in states:
            s.num_inflight += 1
        self.prev_tokens, self.prev_rows = tokens, {s.req_id: j for j, s in enumerate(states)}
        return PendingOutput.start(out, states, tokens)

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
