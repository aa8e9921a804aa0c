"""Owns the model, the KV cache tensors and the request states; runs one step.

A step is prepare -> forward -> sample or verify -> propose. Each step flattens the scheduled requests
into one varlen batch (worker/step_batch.py), runs the model under a forward context carrying the
attention metadata (a captured CUDA graph's replay where one fits), samples where a request's known
tokens are all computed, and verifies the drafts it scheduled (worker/speculator.py lays them out once).
Its output (worker/step_output.py) may still be on its way from the device; its tokens are booked into
the request states here, in `_book`, and nowhere else.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pressroom.attention.backend import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder, forward_context
from pressroom.attention.state import StateMetadata
from pressroom.attention.torch_ref import make_cpu_backend
from pressroom.core.outputs import ModelRunnerOutput, SchedulerOutput, TopLogprobs
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.kv_offload.slab import SlabHandle
from pressroom.lora.layers import lora_step
from pressroom.lora.manager import LoRAManager
from pressroom.model.layers.attention import Attention
from pressroom.multimodal.inputs import MediaRows
from pressroom.multimodal.step_inputs import MultimodalInputs, StepSpan
from pressroom.worker.device import to_device
from pressroom.worker.grammar import GrammarReader, constrain
from pressroom.worker.offload_copier import OffloadCopier, kv_head_range
from pressroom.worker.pooler import Pooler, PoolRow
from pressroom.worker.proposer import Proposer, TargetStep
from pressroom.worker.rejection_sampler import verify, verify_on_device
from pressroom.worker.request_state import CachedRequestState
from pressroom.worker.sampler import needs_host_history, sample, sample_on_device, takes_raw_argmax, top_logprobs
from pressroom.worker.speculator import NO_LIMIT, Speculator
from pressroom.worker.state_cache import StateCache
from pressroom.worker.step_batch import StepBatch, StepBatchBuilder
from pressroom.worker.step_output import DeviceStep, Emission, PendingOutput

if TYPE_CHECKING:
    from pressroom.worker.cuda_graphs import DecodeHead

ENCODER_CACHE_MIN_ROWS = 16384  # encoder output rows kept for reuse (an image is some hundreds to thousands)

logger = logging.getLogger("pressroom")


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
        self.speculator: Speculator | None = None  # speculative decoding (`set_proposer`)
        # Launched steps' outputs whose tokens are not booked into the states yet, in step order.
        self._unbooked: list[PendingOutput] = []
        # The last step's emitted tokens on the device, for requests whose results are not booked yet.
        self.prev: DeviceStep | None = None
        self.states: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.backend = make_backend(device, dtype, batch_invariant)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.state_cache = StateCache.of(model, device)  # recurrent layers' states (None: the model has none)
        self.max_blocks_per_seq = 0
        self.attn_builder = self._make_builder()  # remade for the cache's table width by initialize_kv_cache
        self._batches: StepBatchBuilder | None = None  # made at the first step after initialize_kv_cache
        self.graphs = None  # CudaGraphs once captured
        self.encoder_graphs = None  # EncoderGraphs (worker/encoder_graphs.py) once captured
        self.kv_offload: OffloadCopier | None = None  # KV offload on: the steps' copies to and from the CPU tier
        self.pooler = Pooler()
        self.grammars = GrammarReader()
        self.lora: LoRAManager | None = None  # --enable-lora: the adapters' slots (set by the worker)
        # A model that takes images: their encoder cache and each step's merged embeddings (multimodal/).
        self.multimodal = MultimodalInputs(model, max(ENCODER_CACHE_MIN_ROWS, 4 * max_num_batched_tokens)) \
            if getattr(model, "supports_multimodal", False) else None

    # ---- set-up ----

    def set_proposer(self, proposer: Proposer | None, synthetic_rates: list[float] | None = None) -> None:
        """The drafter for speculative decoding (None: off); it is built for this runner, so it comes after
        construction. Under async scheduling it drafts on the device. `synthetic_rates`: verification
        accepts drafts at these rates (rejection_sample_method="synthetic")."""
        if proposer is not None and self.async_scheduling and not proposer.works_on_device:
            raise ValueError(f"{type(proposer).__name__} drafts from host token ids, so it runs with synchronous "
                             "scheduling; set async_scheduling=False.")
        if proposer is not None and self.async_scheduling and self.multimodal is not None \
                and self.multimodal.uses_mrope:
            # rejected device drafts shift positions on the device, past the M-RoPE rows built on the host
            raise ValueError(f"{type(self.model).__name__} drafts with synchronous scheduling only; set "
                             "async_scheduling=False.")
        self.speculator = None if proposer is None else Speculator(proposer, self.async_scheduling, synthetic_rates)

    @property
    def proposer(self) -> Proposer | None:
        return None if self.speculator is None else self.speculator.proposer

    @property
    def device_drafting(self) -> bool:
        """Async scheduling with a drafter: it proposes on the device and the scheduler sends placeholders."""
        return self.speculator is not None and self.speculator.on_device

    def _aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs every forward pass returns for the proposer."""
        return self.proposer.aux_layers() if self.proposer is not None else ()

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int, num_state_slots: int = 1) -> None:
        """`num_state_slots`: rows of each recurrent layer's state tensors (core/state_pool.py's count; 1, the
        padding slot, for a profile's throw-away steps)."""
        if self.state_cache is not None:
            self.state_cache.bind(num_state_slots)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.attn_builder = self._make_builder()
        self._batches = None
        if self.graphs is not None:  # graphs captured before: decode steps still split as theirs do
            self.attn_builder.split_as_graphs(self.graphs.shapes.get(1, []))
        self.kv_caches = self._bind_kv_caches(num_blocks)

    def release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []
        if self.state_cache is not None:
            self.state_cache.release()

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one cache block takes across every attention layer (a latent cache: one plane)."""
        return sum(math.prod(layer.cache_shape(1, self.block_size)) for layer in self.attention_layers) \
            * self.kv_dtype.itemsize

    def state_bytes_per_slot(self) -> int:
        """Bytes one request's recurrent state takes across every recurrent layer (0: none)."""
        return 0 if self.state_cache is None else self.state_cache.bytes_per_slot()

    def _make_builder(self) -> AttentionMetadataBuilder:
        kv_heads = self.attention_layers[0].num_kv_heads if self.attention_layers else 1
        return self.backend.make_metadata_builder(self.device, kv_heads, self.max_blocks_per_seq)

    def _bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        caches = []
        for layer in self.attention_layers:
            # Zeroed: padded attention positions read block 0 and must not hold NaN garbage.
            layer.kv_cache = torch.zeros(layer.cache_shape(num_blocks, self.block_size), dtype=self.kv_dtype,
                                         device=self.device)
            layer.block_size, layer.backend = self.block_size, self.backend
            caches.append(layer.kv_cache)
        return caches

    def attach_kv_offload(self, handle: SlabHandle) -> None:
        """Maps the offload CPU tier's slab; each step's copies go through it from here on."""
        self.kv_offload = OffloadCopier(handle, kv_head_range(self.model, self.attention_layers), self.device)

    def capture_cudagraphs(self, shapes: dict[int, list[int]], max_rows: int, decode_head: bool = False) -> None:
        """`shapes`: see CompilationConfig.graph_shapes; `max_rows`: requests a step may hold; `decode_head`:
        decode graphs also run the LM head and the greedy argmax, where the head is graph-safe (`_head_in_graphs`;
        a runner whose steps sample asks for it, a drafter's, which computes its own logits, does not)."""
        from pressroom.worker.cuda_graphs import CudaGraphs
        self.graphs = CudaGraphs(self.model, shapes, max_rows, self.max_blocks_per_seq, self.attn_builder,
                                 self.device, self._aux_layers(), recurrent=self.state_cache is not None,
                                 lora_slots=self.lora.config.max_loras if self.lora else 0,
                                 head=decode_head and self._head_in_graphs())
        self.graphs.capture()

    def _head_in_graphs(self) -> bool:
        """Whether the model's LM head may run inside a decode graph: one rank's whole vocabulary (a tensor-parallel
        head gathers its slices across ranks, a collective left out of graphs until checked on several GPUs).
        Adapters never reach the head (lora/adapter.py refuses LM-head weights); media steps run eager anyway."""
        return get_tp_size() == 1 and callable(getattr(self.model, "compute_logits", None))

    def capture_encoder_graphs(self, buckets: Sequence[int]) -> bool:
        """The media tower's CUDA graphs at these patch counts (worker/encoder_graphs.py), where the model has
        them; a step's missing media go through them from here on. Whether any were captured."""
        from pressroom.worker.encoder_graphs import EncoderGraphs, supports_encoder_graphs
        if self.multimodal is None or not supports_encoder_graphs(self.model):
            return False
        graphs = EncoderGraphs(self.model, buckets)
        if not graphs.buckets:
            logger.warning("no --encoder-cudagraph-sizes bucket holds one of %s's media items: its encoder runs "
                           "eager", type(self.model).__name__)
            return False
        self.encoder_graphs = graphs
        graphs.capture()
        self.multimodal.encode = self.encoder_graphs.encode_media
        return True

    def release_cuda_graphs(self) -> None:
        """Drops the captured graphs and their memory pool (sleep mode: the addresses they replay are freed)."""
        self.graphs = self.encoder_graphs = None
        if self.multimodal is not None:
            self.multimodal.encode = self.model.encode_media

    def discard_inflight(self) -> None:
        """Drops the async carry-over (launched steps and their tokens on the device) after a step failed:
        the requests they held are ended, and a stale output must not be booked."""
        self._unbooked.clear()
        self.prev = None

    # ---- forward ----

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a step (computed as every step's are: with the proposer's aux layers)."""
        return self._forward(input_ids, positions, meta)[0]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 media: MediaRows | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, DecodeHead | None]:
        """Hidden states of a step and, where the proposer conditions on target layers, their outputs side
        by side ([tokens, layers * width]): a captured graph's where one fits the step's shape, else eager.
        Third, where a decode graph ran the LM head, its logits and argmax for the step's rows (else None).
        `media`: the step's media rows and the tokens they replace (multimodal models; eager)."""
        layers = self._aux_layers()
        if media is not None or positions.dim() > 1:
            return self._forward_multimodal(input_ids, positions, meta, media, layers)
        if self.state_cache is not None and meta.state is None:  # a profile's throw-away step: padding slot
            meta.state = StateMetadata.one_round(meta.query_start_loc, [0] * (len(meta.query_start_loc) - 1),
                                                 self.device, meta.num_decodes)
        # a step with adapters replays graphs captured with them; its layers' hooks are what layer_by_layer keeps
        # (the CPU's fused decode stack has none)
        if self.graphs is not None and self.graphs.aux_layers == layers \
                and (not meta.layer_by_layer or self.graphs.lora_slots):
            loc = meta.query_start_loc
            key = self.graphs.key_for(len(loc) - 1, meta.max_query_len, input_ids.shape[0], meta.state)
            if key is not None:
                return self.graphs.replay(key, input_ids, positions, meta)
        with forward_context(meta):
            if not layers:
                return self.model(input_ids, positions), None, None
            hidden, aux = self.model(input_ids, positions, layers)
        return hidden, torch.cat(aux, dim=-1), None

    def _forward_multimodal(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                            media: MediaRows | None, layers: tuple[int, ...]
                            ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        with forward_context(meta):
            if not layers:
                return self.model(input_ids, positions, media=media), None, None
            hidden, aux = self.model(input_ids, positions, layers, media=media)
        return hidden, torch.cat(aux, dim=-1), None

    def _multimodal_inputs(self, batch: StepBatch, sched: SchedulerOutput
                           ) -> tuple[MediaRows | None, torch.Tensor]:
        """The step's media rows and where they go (None: no placeholder in the step) and its positions (M-RoPE
        rows where a request with media is in the step)."""
        if self.multimodal is None or not self.multimodal.requests:  # no request with media is running
            return None, batch.positions
        counts = sched.num_scheduled_tokens
        spans = [StepSpan(s.req_id, s.num_computed_tokens, counts[s.req_id], end - counts[s.req_id])
                 for s, end in zip(batch.order, batch.query_ends)]
        return self.multimodal.step_inputs(batch.input_ids, batch.positions, spans)

    def _logits_at(self, hidden: torch.Tensor, positions: list[int], head: DecodeHead | None = None) -> torch.Tensor:
        """fp32 logits at the given flat positions: the decode graph's where it ran the head (a decode step's
        positions are its rows), else the LM head over those rows of `hidden`."""
        if head is not None:
            return _rows_at(head.logits, positions).float()
        rows = hidden.index_select(0, to_device(torch.tensor(positions), hidden.device))
        return self.model.compute_logits(rows).float()

    # ---- one step ----

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """One step: prepare the batch, run the model, sample or verify, propose the next drafts.

        Every step's output is a PendingOutput, whose tokens may still be on their way from the device.
        Synchronous scheduling resolves it here; async scheduling returns it as it is (the engine
        schedules the next step meanwhile) and keeps the step's tokens on the device as the next step's
        inputs. Nothing else in the step depends on the scheduling mode."""
        self._book(wait=False)
        self._update_states(sched)
        transferred = None if sched.kv_transfers is None else self.kv_offload.run(self.kv_caches, sched.kv_transfers)
        if sched.is_empty:
            self.prev = None  # the scheduler books the previous step's results before the next one
            pending = PendingOutput.done(ModelRunnerOutput({}))
        else:
            batch = self._batch_builder().build(sched, self.states, self.prev, self.speculator)
            if self.state_cache is not None:
                order = batch.order
                batch.meta.state = self.state_cache.metadata([s.req_id for s in order], [s.state_slot for s in order],
                                                             batch.meta.query_start_loc, batch.meta.num_decodes,
                                                             sched.state_saves)
            adapters = self.lora.step([s.lora for s in batch.order], batch.query_ends) if self.lora else None
            batch.meta.layer_by_layer = adapters is not None
            media, positions = self._multimodal_inputs(batch, sched)
            with lora_step(adapters):
                hidden, features, head = self._forward(batch.input_ids, positions, batch.meta, media)
            pooled = self._pool(batch, sched, hidden)
            emission = self._emit(batch, sched, hidden, head)
            pending = emission.pending
            pending.output.pooled = pooled
            self.prev = emission.device_step(self.device) if self.async_scheduling else None
            self._propose_next(batch, sched, emission, features)
        pending.transferred = transferred
        if self.async_scheduling:
            return pending
        self._book(wait=True)
        return pending.resolve()

    @torch.inference_mode()
    def step_logits(self, sched: SchedulerOutput) -> tuple[list[CachedRequestState], torch.Tensor]:
        """Runs a step and returns, instead of sampling, the logits of each request that reached the end
        of its tokens (a draft model's runner samples them itself)."""
        self._update_states(sched)
        batch = self._batch_builder().build(sched, self.states, None, None)
        hidden = self.run_model(batch.input_ids, batch.positions, batch.meta)
        rows = range(len(batch.sampling))
        return [s for _, s in batch.sampling], self._logits_at(hidden, batch.spec.logits_positions(rows))

    def _update_states(self, sched: SchedulerOutput) -> None:
        finished = sched.finished_req_ids
        for rid in finished:
            self.states.pop(rid, None)
            if self.multimodal is not None:
                self.multimodal.finish(rid)
        if self.speculator is not None:
            self.speculator.forget(finished)
        self.pooler.forget(finished)
        for new in sched.new_requests:
            self.states[new.req_id] = CachedRequestState.start(new, self.grammars, self.device)
            if self.multimodal is not None:
                self.multimodal.start(new.req_id, new.num_prompt_tokens, new.mm_features)
            elif new.mm_features:
                raise ValueError(f"{type(self.model).__name__} takes no images.")
        if self.state_cache is not None and sched.new_requests:
            self.state_cache.start_requests(sched.new_requests)
        for cached in sched.cached_requests:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _batch_builder(self) -> StepBatchBuilder:
        if self._batches is None:
            self._batches = StepBatchBuilder(self.device, self.block_size, self.attn_builder,
                                             self.max_num_batched_tokens, self.max_num_seqs, self.max_blocks_per_seq)
        return self._batches

    def _book(self, wait: bool) -> None:
        """Appends launched steps' emitted tokens to their requests' states, in step order: every step's
        where `wait` (the host needs complete token histories), else those whose outputs were resolved."""
        while self._unbooked and (wait or self._unbooked[0].resolved):
            pending = self._unbooked.pop(0)
            pending.resolve()
            for state, tokens, span in pending.emitted():
                state.token_ids.extend(tokens)
                state.num_inflight -= span

    # ---- sample or verify ----

    def _emit(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
              head: DecodeHead | None = None) -> Emission:
        """Samples, or verifies the scheduled drafts: on the device, unless some request's sampling reads
        its token history or reports logprobs (then on the host). `head`: the decode graph's LM head outputs."""
        if any(needs_host_history(s.params) for s in batch.order):
            emission = self._emit_on_host(batch, sched, hidden, head)
        else:
            emission = self._emit_on_device(batch, sched, hidden, head)
        self._unbooked.append(emission.pending)
        self._book(wait=False)  # a step sampled on the host is booked at once
        return emission

    def _emit_on_device(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                        head: DecodeHead | None) -> Emission:
        """Samples (verifies, where drafts were scheduled) with no host round trip and starts the copy of
        the tokens home without waiting for it. Where the decode graph ran the head and every row takes the
        raw argmax, its argmax are the tokens."""
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        sampling, spec = batch.sampling, batch.spec
        if not sampling:
            return Emission(PendingOutput.done(out), [], [])
        states = [s for _, s in sampling]
        positions = spec.logits_positions(range(len(sampling)))
        if head is not None and not spec.max_drafts and all(takes_raw_argmax(s.params) for s in states):
            tokens = _rows_at(head.argmax, positions).clone().unsqueeze(1)  # a copy: the next replay overwrites
            return self._start_pending(out, batch, states, tokens, None)
        logits = self._logits_at(hidden, positions, head)
        if not spec.max_drafts:
            self._constrain(logits, states)
            rows = [s.bare_sampling_row() for s in states]
            tokens, counts = sample_on_device(logits, rows, self.generator).unsqueeze(1), None
        else:
            self._constrain(logits, states, {s.req_id: self._grammar_drafts(sched, s) for s in states})
            speculator = self.speculator
            tokens, counts = verify_on_device(logits, [s.params for s in states], spec.num_drafts,
                                              batch.input_ids[spec.draft_index], speculator.draft_q(sampling, spec),
                                              self.generator, speculator.synthetic_rates)
        return self._start_pending(out, batch, states, tokens, counts)

    @staticmethod
    def _start_pending(out: ModelRunnerOutput, batch: StepBatch, states: list[CachedRequestState],
                       tokens: torch.Tensor, counts: torch.Tensor | None) -> Emission:
        """The device's tokens in flight: each row's span counted, their copy home started."""
        spec = batch.spec
        for s, span in zip(states, spec.spans):
            s.num_inflight += span
        pending = PendingOutput.start(out, states, tokens, counts, spec.spans)
        return Emission(pending, batch.sampling, spec.num_drafts, tokens, counts)

    def _grammar_drafts(self, sched: SchedulerOutput, s: CachedRequestState) -> list[int]:
        """The drafts a request verifies this step: their ids where its grammar must see them (fetched from the
        device under async drafting), else as scheduled (placeholders only count)."""
        drafts = sched.scheduled_spec_decode_tokens.get(s.req_id, [])
        return drafts if s.grammar is None else self.speculator.host_drafts(drafts, s.req_id)

    def _emit_on_host(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                      head: DecodeHead | None) -> Emission:
        """Samples and verifies on the host, once the steps in flight (async scheduling) are booked: the
        sampler reads complete token histories. Drafts left on the device are fetched first."""
        self._book(wait=True)
        scheduled = sched.scheduled_spec_decode_tokens
        drafts = {rid: self.speculator.host_drafts(d, rid) for rid, d in scheduled.items()} if scheduled else {}
        out = self._sample_on_host(batch, sched, hidden, drafts, head)
        states = [s for _, s in batch.sampling]
        return Emission(PendingOutput.on_host(out, states), batch.sampling, batch.spec.num_drafts,
                        emitted=[out.sampled_token_ids[s.req_id] for s in states])

    def _sample_on_host(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor,
                        drafts: dict[str, list[int]], head: DecodeHead | None = None) -> ModelRunnerOutput:
        """Samples, and verifies `drafts` (the scheduled drafts' ids), on the host with each request's token
        history. `head`: the decode graph's logits, where it ran the head."""
        out = ModelRunnerOutput({s.req_id: [] for s in batch.order})
        for i, s in enumerate(batch.order):
            if s.params.prompt_logprobs is not None and s.num_computed_tokens < max(1, s.num_prompt_tokens - 1):
                out.prompt_logprobs[s.req_id] = self._prompt_logprobs(s, hidden, batch, i, sched)
        verifying = [j for j, (_, s) in enumerate(batch.sampling) if s.req_id in drafts]
        plain = [j for j, (_, s) in enumerate(batch.sampling) if s.req_id not in drafts]
        if verifying:
            self._verify(batch, hidden, verifying, drafts, out)
        if plain:
            states = [batch.sampling[j][1] for j in plain]
            logits = self._logits_at(hidden, batch.spec.logits_positions(plain), head)
            self._constrain(logits, states)
            rows = [s.sampling_row() if needs_host_history(s.params) else s.bare_sampling_row() for s in states]
            tokens, lps = sample(logits, rows, self.generator)
            for s, token, lp in zip(states, tokens, lps):
                out.sampled_token_ids[s.req_id] = [token]
                if lp is not None:
                    out.logprobs[s.req_id] = [lp]
        return out

    def _verify(self, batch: StepBatch, hidden: torch.Tensor, rows: list[int], drafts: dict[str, list[int]],
                out: ModelRunnerOutput) -> None:
        """Checks the given sampled rows' drafts against the target's logits at their 1 + k positions (one
        LM-head call for all of them)."""
        states = [batch.sampling[j][1] for j in rows]
        all_logits = self._logits_at(hidden, batch.spec.logits_positions(rows))
        self._constrain(all_logits, states, drafts)
        starts = batch.spec.logits_starts(rows)
        for s, start, end in zip(states, starts, starts[1:]):
            self._verify_one(s, drafts[s.req_id], all_logits[start:end], out)

    def _verify_one(self, s: CachedRequestState, drafts: list[int], logits: torch.Tensor,
                    out: ModelRunnerOutput) -> None:
        rows = [s.sampling_row(drafts[:j]) for j in range(len(drafts) + 1)]
        speculator = self.speculator
        tokens = verify(logits, rows, drafts, speculator.take_probs(s.req_id, len(drafts)), self.generator,
                        speculator.synthetic_rates)
        out.sampled_token_ids[s.req_id] = tokens
        if s.params.logprobs is not None:
            raw = torch.log_softmax(logits, dim=-1)
            out.logprobs[s.req_id] = [top_logprobs(raw[j], t, s.params.logprobs) for j, t in enumerate(tokens)]

    def _constrain(self, logits: torch.Tensor, states: Sequence[CachedRequestState],
                   drafts: dict[str, list[int]] | None = None) -> None:
        """Masks the tokens each structured request's grammar forbids, at each of its 1 + k logits rows (k: its
        drafts). Under async scheduling the steps in flight are booked first: the matchers advance on their
        tokens (the device is busy with this step's forward meanwhile, so little is lost)."""
        if all(s.grammar is None for s in states):
            return
        self._book(wait=True)
        constrain(logits, [(s.grammar, s.token_ids, drafts.get(s.req_id, ()) if drafts else ()) for s in states])

    def _pool(self, batch: StepBatch, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[str, list[float]]:
        """The vectors of the pooling requests whose prompts this step finished (worker/pooler.py)."""
        counts = sched.num_scheduled_tokens
        rows = [PoolRow(s.req_id, s.pooling, batch.query_ends[i] - counts[s.req_id], batch.query_ends[i],
                        s.num_computed_tokens, s.num_prompt_tokens)
                for i, s in enumerate(batch.order) if s.pooling is not None]
        return self.pooler.pool(hidden, rows) if rows else {}

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

    # ---- propose ----

    def _propose_next(self, batch: StepBatch, sched: SchedulerOutput, emission: Emission,
                      features: torch.Tensor | None) -> None:
        """Drafts for the next step: on the device right away where the proposer drafts there under async
        scheduling, else from the step's tokens once they are on the host (synchronous scheduling only:
        `set_proposer` sees to that)."""
        speculator = self.speculator
        if speculator is None:
            return
        if speculator.on_device:
            speculator.launch(self._target_step(batch, sched, emission), emission.sampling)
            return
        self._book(wait=True)
        out = emission.pending.output
        if features is not None:
            speculator.hand_over_features(batch.order, batch.query_ends, sched, out, features)
        speculator.propose([s for _, s in emission.sampling], out, sched.draft_limits)

    def _target_step(self, batch: StepBatch, sched: SchedulerOutput, emission: Emission) -> TargetStep:
        """The step as a device drafter sees it: its inputs and, per sampled request, its tokens on the device."""
        sampling = emission.sampling
        tokens, counts = emission.device_tokens(self.device) if sampling else (None, None)
        if tokens is not None and counts is None:  # one token each
            counts = torch.ones(len(sampling), dtype=torch.long, device=tokens.device)
        return TargetStep(batch.input_ids, batch.positions, batch.meta, [i for i, _ in sampling],
                          emission.num_drafts, tokens, counts, [s.params for _, s in sampling],
                          [sched.draft_limits.get(s.req_id, NO_LIMIT) for _, s in sampling],
                          [s.req_id for s in batch.order], [s.token_ids for s in batch.order],
                          [s.num_computed_tokens for s in batch.order])


def _rows_at(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t`'s given rows: a view where they are its first ones in order (a decode step where every row samples),
    else a gathered copy."""
    if rows == list(range(len(rows))):
        return t[:len(rows)]
    return t.index_select(0, to_device(torch.tensor(rows), t.device))
