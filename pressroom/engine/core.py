"""The engine core: the scheduler and the model runner, token ids in and token ids out (no text).

It runs in-process under the offline `LLM`, and in a process of its own under the server
(engine/core_client.py), where a busy loop feeds it requests and ships its outputs over ZMQ.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from pressroom.config import EngineConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import EngineCoreOutput, SchedulerOutput
from pressroom.core.request import Request, RequestStatus
from pressroom.core.scheduler import Scheduler, SchedulerStats
from pressroom.model.loader import load_model
from pressroom.sampling_params import SamplingParams
from pressroom.spec_decode import make_proposer
from pressroom.spec_decode.budget import AdaptiveBudget
from pressroom.worker.model_runner import ModelRunner, PendingOutput, kv_cache_bytes_per_block

logger = logging.getLogger("pressroom")

_CUDA_GRAPH_RESERVE = 1 << 30  # graphs' memory pool is allocated after the KV cache; measured and logged at capture


@dataclass(slots=True)
class CoreRequest:
    """One sequence to generate (a request with n > 1 becomes n of these)."""
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    follows: str | None = None  # a sibling whose prompt is computed first (it fills the prefix cache)


@dataclass(slots=True)
class CoreOutputs:
    """One step's results."""
    outputs: list[EngineCoreOutput]
    scheduled: list[str]  # requests the step scheduled afresh (their queue time ends)
    stats: SchedulerStats | None = None  # sent along by the core process, for /metrics


@dataclass(slots=True)
class CoreInfo:
    """What the front-end needs to know of the core it talks to."""
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    model_path: str
    startup_seconds: float
    cuda_graphs: bool


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        loaded = load_model(config.model, config.device)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.model_path = loaded.source
        self.eos_token_id = self._eos_token_id()
        self.runner = ModelRunner(self.model, config.cache.block_size, config.model.dtype, config.model.seed,
                                  config.device, config.scheduler.async_scheduling, config.cache.cache_dtype)
        self.runner.set_proposer(make_proposer(config.speculative, self.runner))
        lookahead = config.speculative.num_speculative_tokens if self.runner.device_drafting else 0
        if config.speculative is not None and config.speculative.rejection_sample_method == "synthetic":
            self.runner.synthetic_rates = config.speculative.synthetic_acceptance_rates
        self._inflight: tuple[SchedulerOutput, PendingOutput] | None = None
        num_blocks = self._num_blocks()
        self.max_model_len = self._max_model_len(num_blocks, lookahead)
        config.scheduler.max_model_len = self.max_model_len
        self.runner.initialize_kv_cache(num_blocks, self.max_model_len + lookahead)
        self._log_capacity(num_blocks)
        if config.device == "cuda" and not config.compilation.enforce_eager:
            self._capture_cudagraphs()
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.scheduler.async_drafts = lookahead
        if config.speculative is not None and config.speculative.adaptive_token_budget:
            self.scheduler.spec_budget = self._adaptive_budget(config.speculative.num_speculative_tokens)
        self.requests: dict[str, Request] = {}
        _relax_gc()
        self.info = CoreInfo(self.max_model_len, self.hf_config.vocab_size, self.eos_token_id, str(self.model_path),
                             time.perf_counter() - start, self.runner.graphs is not None)

    # ---- set-up ----

    def _eos_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks + 1  # block 0 is the padding block
        per_block = kv_cache_bytes_per_block(self.hf_config, cache.block_size, self.runner.kv_dtype)
        if self.runner.proposer is not None:  # a draft model's cache has as many blocks
            per_block += self.runner.proposer.kv_bytes_per_block()
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = self._profiled_kv_budget()
        if budget < 2 * per_block:
            raise ValueError(f"Only {budget / (1 << 30):.2f} GiB is left for the KV cache, less than two blocks; "
                             "raise gpu_memory_utilization or lower max_num_batched_tokens.")
        return budget // per_block

    def _profiled_kv_budget(self) -> int:
        """vLLM's rule: gpu_memory_utilization of the card, minus the weights and the activation peak of
        a max_num_batched_tokens forward pass (both in the profiled peak), memory outside torch's
        allocator (CUDA context, cuBLAS workspaces) and a reserve for CUDA graphs."""
        sched, cache = self.config.scheduler, self.config.cache
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        peak = self.runner.profile_peak_memory(sched.max_num_batched_tokens, sched.max_num_seqs, limit)
        free, total = torch.cuda.mem_get_info()
        outside_torch = (total - free) - torch.cuda.memory_reserved()
        graphs = 0 if self.config.compilation.enforce_eager else _CUDA_GRAPH_RESERVE
        budget = int(total * cache.gpu_memory_utilization) - peak - outside_torch - graphs
        logger.info("memory profile: %.2f GiB of %.2f GiB usable; weights + activation peak %.2f GiB, outside "
                    "torch %.2f GiB, CUDA graph reserve %.2f GiB -> KV cache %.2f GiB",
                    total * cache.gpu_memory_utilization / (1 << 30), total / (1 << 30), peak / (1 << 30),
                    outside_torch / (1 << 30), graphs / (1 << 30), budget / (1 << 30))
        return budget

    def _adaptive_budget(self, max_drafts: int) -> AdaptiveBudget:
        """Profiles two step shapes up to the largest decode step (max_num_seqs requests, each with
        every draft): plain decodes, and verifications (1 + K query tokens per request)."""
        sched = self.config.scheduler
        largest = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + max_drafts))
        ladder = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if n < largest] + [largest]
        decode = self.runner.profile_step_costs([n for n in ladder if n <= sched.max_num_seqs], 1)
        verify = self.runner.profile_step_costs(ladder, 1 + max_drafts)
        # Attention grows with the context each query reads: one more measurement at a long context.
        bs, rows = self.config.cache.block_size, min(64, largest)  # rows is on the ladder: measured at short context
        long_ctx = max(2 * bs, min(1024, self.max_model_len // 2) // bs * bs)
        short_t = dict(verify)[rows]
        long_t = self.runner.profile_step_costs([rows], 1 + max_drafts, long_ctx)[0][1]
        per_context_token = max(0.0, (long_t - short_t) / (rows * (long_ctx - bs)))
        logger.info("step costs for the speculative budget: decodes %s; verifications %s; attention %.3g us "
                    "per query per context token", _curve(decode), _curve(verify), 1e6 * per_context_token)
        proposer, counts = self.runner.proposer, [n for n in ladder if n <= sched.max_num_seqs]
        drafts = proposer.profile_decode_steps(counts)  # each draft position has a cost of its own
        first = proposer.profile_first_draft_steps(counts) if drafts is not None else None  # mirroring under async
        if drafts is not None:
            logger.info("drafting one more position: %s; the first: %s", _curve(drafts), first and _curve(first))
        blocks = proposer.profile_block_passes(counts)  # a block drafter's shared pass
        if blocks is not None:
            logger.info("block drafter passes: %s", _curve(blocks))
        return AdaptiveBudget(max_drafts, verify, decode, per_context_token, drafts,
                              first_draft_costs=first, block_costs=blocks)

    def _capture_cudagraphs(self) -> None:
        """Decode steps, and with speculation the verification steps (up to 1 + K query tokens per
        request); a draft model captures its own passes."""
        sched, spec, compilation = self.config.scheduler, self.config.speculative, self.config.compilation
        k = spec.num_speculative_tokens if spec is not None else 0
        self.runner.capture_cudagraphs(
            compilation.graph_shapes(sched.max_num_seqs, sched.max_num_batched_tokens, 1 + k), sched.max_num_seqs)
        if self.runner.proposer is not None:
            self.runner.proposer.capture_cudagraphs(compilation, sched.max_num_seqs, sched.max_num_batched_tokens)

    def _log_capacity(self, num_blocks: int) -> None:
        tokens = (num_blocks - 1) * self.config.cache.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %s); max concurrency %.1fx at max_model_len %d",
                    num_blocks, self.config.cache.block_size, tokens, str(self.runner.kv_dtype).removeprefix("torch."),
                    tokens / self.max_model_len, self.max_model_len)

    def _max_model_len(self, num_blocks: int, lookahead: int = 0) -> int:
        """`lookahead`: slots a request keeps past its step for a device drafter's writes."""
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True):
            limit = min(limit, window)  # no sliding-window attention yet: stay inside the window
        asked = self.config.model.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit} tokens.")
        length = asked or limit
        capacity = (num_blocks - 1) * self.config.cache.block_size - lookahead
        if length > capacity:
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds no more", length, capacity)
            length = capacity
        return length

    # ---- requests ----

    def add_request(self, request: CoreRequest) -> None:
        lead = self.requests.get(request.follows) if request.follows is not None else None
        req = Request(request.req_id, request.prompt_token_ids, request.params, self.eos_token_id,
                      request.arrival_time, request.priority, follows=lead)
        self.requests[request.req_id] = req
        self.scheduler.add_request(req)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """Ends requests the front-end is done with (aborted, or stopped by a stop string)."""
        self.scheduler.finish_requests(req_ids, status)
        for rid in req_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- one step ----

    def step(self) -> CoreOutputs:
        """Schedules and runs one step. With async scheduling the step is launched and the previous
        one's results are returned, so the host's work overlaps the device's."""
        sched = self.scheduler.schedule()
        scheduled = [new.req_id for new in sched.new_requests]
        result = self.runner.execute_model(sched)
        if not isinstance(result, PendingOutput):
            return CoreOutputs(self._update(sched, result), scheduled)
        previous, self._inflight = self._inflight, (sched, result)
        return CoreOutputs(self._update(previous[0], previous[1].resolve()) if previous is not None else [], scheduled)

    def _update(self, sched: SchedulerOutput, runner_out) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(sched, runner_out)
        for out in outputs:
            if out.finish_reason is not None:
                self.requests.pop(out.req_id, None)
        return outputs

    def shutdown(self) -> None:
        """Drops the model, its caches and the scheduler's state, and returns the device's memory. The
        model's modules hold cycles (parameters keep their layer's bound weight loaders), so nothing
        is freed until a collection: one runs here rather than whenever the collector gets to it."""
        for name in ("runner", "model", "scheduler", "kv_cache", "requests", "_inflight"):
            self.__dict__.pop(name, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _relax_gc() -> None:
    """Cyclic-GC passes over the engine's many long-lived objects took half of the host's time per step
    at 1,000 requests (benchmarks/host_overhead.py): collect the young generation 14x less often, and the
    old ones rarely. Only raised, never lowered; cycles are still collected (gc.freeze would keep
    a deleted engine's cycles, and its GPU memory, alive)."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, 10_000), max(middle, 20), max(old, 100))


def _curve(costs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{n} tok {1000 * t:.1f} ms" for n, t in costs)
