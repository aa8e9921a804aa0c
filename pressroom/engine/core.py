"""The engine core: the scheduler and the executor, token ids in and token ids out (no text).

It runs in-process under the offline `LLM`, and in a process of its own under the server
(engine/core_client.py), where a busy loop feeds it requests and ships its outputs over ZMQ.
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from pressroom.config import EngineConfig
from pressroom.core.cache_plan import CachePlan, default_checkpoint_interval, plan_cache
from pressroom.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pressroom.core.outputs import AsyncModelRunnerOutput, EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pressroom.core.request import Request, RequestStatus
from pressroom.core.scheduler import Scheduler, SchedulerStats
from pressroom.core.spec_budget import AdaptiveBudget
from pressroom.core.state_pool import StatePool
from pressroom.core.structured_outputs import COMPILE_TIMEOUT_S, GrammarCompiler, compile_error
from pressroom.distributed.kv_transfer.base import check_kv_transfer_params, kv_transfer_params
from pressroom.engine.step_cost import (
    ModelShape,
    StepCostMeter,
    StepTimer,
    device_roofline,
    load_of,
    local_gpu_name,
    request_steps,
    weight_bytes,
)
from pressroom.executor import FATAL_ERRORS, make_executor
from pressroom.executor.process import relax_gc
from pressroom.logger import printable
from pressroom.lora.request import LoRARequest
from pressroom.model.loader import load_hf_config, load_tokenizer, resolve_model_path
from pressroom.multimodal.inputs import MediaItem
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams
from pressroom.worker.sleep import check_wake_tags
from pressroom.worker.worker import ModelSpec

logger = logging.getLogger("pressroom")

MAX_FAILED_STEPS = 3  # in a row: past that the fault is the engine's, not a request's
# vLLM's: 0 pauses scheduling, 1 also offloads the weights and frees the KV cache, 2 frees both
SLEEP_LEVELS = (0, 1, 2)
PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's: what a sleep does with the requests in flight


def check_sleep_args(enabled: bool, level: int, mode: str) -> None:
    """A sleep's arguments as vLLM takes them; ValueError naming the fix otherwise."""
    check_sleep_enabled(enabled)
    if level not in SLEEP_LEVELS:
        raise ValueError(f"Sleep level must be 0, 1 or 2; got {level!r}.")
    if mode not in PAUSE_MODES:
        raise ValueError(f"Invalid pause mode: {mode!r}; the modes are {', '.join(PAUSE_MODES)}.")


def check_sleep_enabled(enabled: bool) -> None:
    if not enabled:
        raise ValueError("Sleep mode is not enabled in the model config: start the engine with "
                         "enable_sleep_mode=True (--enable-sleep-mode).")


@dataclass(slots=True)
class CoreRequest:
    """One sequence to generate (a request with n > 1 becomes n of these)."""
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    follows: str | None = None  # a sibling whose prompt is computed first (it fills the prefix cache)
    pooling: PoolingParams | None = None  # resolved pooling: prefill only, the request ends with its vector
    data_parallel_rank: int | None = None  # the engine core that must serve it (None: the client balances)
    # the client's request it is one prompt of (a prompt list's), whose prompts the scheduler counts as one
    # group; None: the group of the sibling it follows, else its own (core/request.py)
    group: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    cache_salt: str | None = None  # keys its prefix-cache blocks apart from other salts' (vLLM's cache_salt)
    mm_features: list[MediaItem] | None = None  # its images, placeholders expanded in prompt_token_ids


@dataclass(slots=True)
class CoreOutputs:
    """One step's results."""
    outputs: list[EngineCoreOutput]
    scheduled: list[str]  # requests the step scheduled afresh (their queue time ends)
    stats: SchedulerStats | None = None  # sent along by the core process, for /metrics
    engine_index: int = 0  # which data-parallel engine core sent it
    scheduled_time: float = 0.0  # time.monotonic() when the step was scheduled: `scheduled`'s queue time ends then
    reply: str | None = None  # a sleep's or wake_up's answer from the core process: "" done, else its error


@dataclass(slots=True)
class CoreInfo:
    """What the front-end needs to know of the core it talks to."""
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    model_path: str
    startup_seconds: float
    cuda_graphs: bool
    startup_phases: dict[str, float] = field(default_factory=dict)  # seconds each part of the start took
    kv_fingerprint: str | None = None  # a KV connector's model fingerprint (hex): a decode's params must carry it


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_id: int | None = None) -> None:
        """`eos_token_id`: the tokenizer's, which the front-end loaded (the core loads one only to compile
        structured outputs' grammars, on their threads, at the first such request)."""
        start = time.perf_counter()
        self.config, self.eos_token_id = config, eos_token_id
        self.startup_phases: dict[str, float] = {}
        with self._phase("workers"):
            self.executor = make_executor(config)
        try:
            self._start(config)
        except BaseException:
            self.executor.shutdown()
            raise
        self.requests: dict[str, Request] = {}
        self._inflight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        self._failed_steps = 0  # faults in a row (see step)
        self._unexplained = False  # the last fault was a batch's, whose culprit is not found yet
        model = config.model
        self.grammars = GrammarCompiler(lambda: load_tokenizer(model.tokenizer or resolve_model_path(model.model)),
                                        self.model_spec.vocab_size, eos_token_id,
                                        portable=config.parallel.distributed_executor_backend != "uni")
        self._workers_read_grammars = False  # portable grammars: the workers have the tokenizer info
        self._compiling: dict[str, float] = {}  # request id -> when it stops waiting for its grammar
        # sleep mode: scheduling paused (any sleep), the workers' memory asleep (tags), and the last sleep's level
        self._paused = False
        self._asleep: set[str] = set()
        self._sleep_level = 0
        # (speculation's steps: its CUDA graphs; an encoder runs no decode steps to warm up)
        if config.device == "cuda" and config.speculative is None and not config.model.encoder_only:
            with self._phase("warm-up steps"):
                self._warm_up_step_shapes()
        if config.device == "cuda":  # the kernels this start compiled, for the next start's precompile
            self.executor.collective_rpc("save_kernel_manifest")
        relax_gc()
        self.info = CoreInfo(self.max_model_len, self.model_spec.vocab_size, eos_token_id,
                             self.model_spec.model_path, time.perf_counter() - start, self.cuda_graphs,
                             self.startup_phases,
                             self.kv_connector.fingerprint.hex() if self.kv_connector is not None else None)

    @contextmanager
    def _phase(self, name: str):
        """Times one part of the start (issue 44's time to ready: which part to cut)."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.startup_phases[name] = time.perf_counter() - begin

    def _start(self, config: EngineConfig) -> None:
        with self._phase("weights"):
            spec = self.model_spec = self.executor.load_model()
        with self._phase("memory profile"):
            plan = self._plan_cache(spec)
        num_blocks = plan.num_blocks
        self.max_model_len = self._max_model_len(spec, num_blocks)
        # the core's config from here on: its scheduler's holds the length the KV cache allows
        config = self.config = replace(config, scheduler=replace(config.scheduler, max_model_len=self.max_model_len))
        states = StatePool(plan.num_live_slots, plan.num_checkpoints) if plan.num_live_slots else None
        with self._phase("KV cache"):
            self.executor.initialize_kv_cache(num_blocks, self.max_model_len + spec.lookahead,
                                              states.num_slots if states else 1)
        self._log_capacity(num_blocks)
        if states is not None:
            self._log_states(plan)
        with self._phase("compile and graphs"):
            self.cuda_graphs = self.executor.compile_or_warm_up_model()
        self.kv_offload = self._make_offload(spec)
        self.kv_connector = self._make_kv_connector(spec)
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                       self.kv_offload, states, plan.checkpoint_interval)
        adaptive = config.speculative is not None and config.speculative.adaptive_token_budget
        budget = self._adaptive_budget(config.speculative.num_speculative_tokens) if adaptive else None
        self.step_timer = self._make_step_timer(spec) if config.scheduler.step_time_factor else None
        self._last_resolved: float | None = None  # when the last step in flight was resolved (the fit's clock)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, spec_budget=budget, lookahead=spec.lookahead,
                                   async_drafts=spec.device_drafts, kv_connector=self.kv_connector,
                                   step_time=self.step_timer)
        self.step_cost = self._make_step_cost(spec) if config.enable_mfu_metrics else None

    def _make_step_cost(self, spec: ModelSpec) -> StepCostMeter | None:
        """--enable-mfu-metrics: the per-step estimates from the model's shape (None for a shape they do not
        cover)."""
        try:
            return StepCostMeter(self._model_shape(spec))
        except (ValueError, TypeError) as e:  # a config the shape cannot be read from: no estimates, still serving
            logger.warning("--enable-mfu-metrics: no FLOP or byte estimates for this model (%s)", e)
            return None

    def _make_step_timer(self, spec: ModelSpec) -> StepTimer | None:
        """The scheduler's step-time estimates (SchedulerConfig.step_time_factor): the model's shape over the
        device's roofline (None for a shape they do not cover: no step-time bound)."""
        try:
            shape = self._model_shape(spec)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # on by default: never fails a start
            logger.info("no step-time bound for this model (%s)", e)
            return None
        timer = StepTimer(shape, device_roofline(self.config.device, local_gpu_name()))
        roof = timer.roofline
        logger.info("step-time bound: beside running decodes a step's prompt tokens keep its estimate within %gx "
                    "the decodes' own, at least %d a step (%s: %.3g TFLOP/s, %.3g TB/s)",
                    self.config.scheduler.step_time_factor, timer.floor_tokens, roof.name,
                    roof.flops_per_s / 1e12, roof.bytes_per_s / 1e12)
        return timer

    def _model_shape(self, spec: ModelSpec) -> ModelShape:
        """The model's shape per GPU for the step estimates; ValueError or TypeError for a config the shape cannot
        be read from."""
        model, cache = self.config.model, self.config.cache
        hf_config = load_hf_config(spec.model_path, model.hf_overrides)
        dtype_bytes = model.dtype.itemsize
        return ModelShape.from_hf_config(
            hf_config, tp_size=self.config.parallel.tensor_parallel_size,
            weight_bytes=weight_bytes(model.quantization, hf_config, dtype_bytes), activation_bytes=dtype_bytes,
            kv_bytes=(cache.cache_dtype or model.dtype).itemsize)

    # ---- set-up ----

    def _make_offload(self, spec: ModelSpec):
        """The KV offload tiers (None when off); the worker copies blocks in and out of them."""
        offload = self.config.offload
        if offload is None:
            return None
        from pressroom.kv_offload.layout import model_fingerprint
        from pressroom.kv_offload.manager import TieredKVStore
        model, cache = self.config.model, self.config.cache
        kv_dtype = cache.cache_dtype or model.dtype
        # only tiers that outlive the process need it (its first computation reads every weight file)
        fingerprint = model_fingerprint(spec.model_path, model, kv_dtype, cache.block_size, spec.kv_chunk_shape) \
            if offload.secondary else bytes(16)
        store = TieredKVStore(offload, fingerprint, spec.kv_chunk_shape, kv_dtype, pin=self.config.device == "cuda")
        self.executor.collective_rpc("attach_kv_offload", store.cpu.handle)
        logger.info("KV offload: CPU tier %.2f GiB (%d chunks of %d tokens)%s", offload.cpu_bytes / (1 << 30),
                    offload.cpu_bytes // store.chunk_bytes, cache.block_size,
                    "".join(f", then {label}" for label in store.labels[1:]))
        return store

    def _make_kv_connector(self, spec: ModelSpec):
        """The KV connector that moves prompts' KV between engines (None when off); the workers map its staging
        buffer for their copies."""
        transfer = self.config.kv_transfer
        if transfer is None:
            return None
        if spec.state_bytes_per_slot:
            raise ValueError(f"{transfer.kv_connector} does not move recurrent layers' states yet; drop "
                             "--kv-transfer-config for this model.")
        from pressroom.distributed.kv_transfer.nixl_connector import NixlConnector
        from pressroom.kv_offload.layout import model_fingerprint
        model, cache = self.config.model, self.config.cache
        kv_dtype = cache.cache_dtype or model.dtype
        fingerprint = model_fingerprint(spec.model_path, model, kv_dtype, cache.block_size, spec.kv_chunk_shape)
        connector = NixlConnector(transfer, fingerprint=fingerprint, chunk_shape=spec.kv_chunk_shape,
                                  kv_dtype=kv_dtype, block_size=cache.block_size,
                                  tp_size=self.config.parallel.tensor_parallel_size, pin=self.config.device == "cuda")
        try:
            self.executor.collective_rpc("attach_kv_connector", connector.staging.handle)
        except BaseException:
            connector.close()
            raise
        return connector

    def _plan_cache(self, spec: ModelSpec) -> CachePlan:
        """KV blocks alone, or for a model with recurrent layers, blocks and state slots from one budget."""
        if not spec.state_bytes_per_slot:
            return CachePlan(self._num_blocks(spec), 0, 0, 0)
        self._refuse_for_recurrent_state()
        cache, sched = self.config.cache, self.config.scheduler
        interval = cache.mamba_block_size or default_checkpoint_interval(
            spec.kv_bytes_per_block, spec.state_bytes_per_slot, cache.block_size)
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = self.executor.determine_available_memory()
        # a checkpoint past the model's longest context is never written (Whisper's cross-attention state against
        # its 448 tokens): no memory for checkpoint slots then; the interval stays the prefix cache's rule
        reachable = interval <= spec.max_position
        plan = plan_cache(budget, spec.kv_bytes_per_block, spec.state_bytes_per_slot, cache.block_size, interval,
                          sched.max_num_seqs, cache.enable_prefix_caching and reachable, self._bookkeeping_blocks(spec),
                          self.config.model.max_model_len or spec.max_position)
        if cache.enable_prefix_caching and not reachable:
            plan = replace(plan, checkpoint_interval=interval)
        if cache.num_blocks is not None:
            plan = replace(plan, num_blocks=cache.num_blocks + 1)
        return plan

    def _refuse_for_recurrent_state(self) -> None:
        """What a model with recurrent layers cannot do yet, said at start rather than wrong at run time."""
        config = self.config  # speculation: each layer says at load (RecurrentLayer.reserve_draft_rows)
        if config.offload is not None:
            raise ValueError("KV offloading does not hold recurrent layers' states yet; drop --kv-offloading-size "
                             "for this model.")

    def _log_states(self, plan: CachePlan) -> None:
        spec, bs = self.model_spec, self.config.cache.block_size
        per_token = spec.kv_bytes_per_block / bs + spec.state_bytes_per_slot / self.max_model_len
        logger.info("recurrent state: %d bytes per request; %d live slots (max concurrency %d); %d prefix checkpoints "
                    "every %d tokens; KV + state bytes per token at max_model_len %d: %.1f",
                    spec.state_bytes_per_slot, plan.num_live_slots, plan.num_live_slots, plan.num_checkpoints,
                    plan.checkpoint_interval, self.max_model_len, per_token)
        if spec.full_attention_bytes_per_block:
            full = spec.full_attention_bytes_per_block / bs
            logger.info("full-attention equivalent (every layer like its attention layers): %.1f KV bytes per token; "
                        "capacity multiplier %.2fx at max_model_len %d", full, full / per_token, self.max_model_len)

    def _num_blocks(self, spec: ModelSpec) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks + 1  # block 0 is the padding block
        if spec.kv_bytes_per_block == 0:  # an encoder keeps no KV: blocks only count a step's tokens
            return self._bookkeeping_blocks(spec)
        budget = self.executor.determine_available_memory()
        if budget < 2 * spec.kv_bytes_per_block:
            raise ValueError(f"Only {budget / (1 << 30):.2f} GiB is left for the KV cache, less than two blocks; "
                             "raise gpu_memory_utilization or lower max_num_batched_tokens.")
        return budget // spec.kv_bytes_per_block

    def _bookkeeping_blocks(self, spec: ModelSpec) -> int:
        """Blocks for a model without a KV cache: enough for the largest step (a block per request plus the
        step's tokens) and for one prompt of the model's longest length; they cost no memory."""
        sched, size = self.config.scheduler, self.config.cache.block_size
        tokens = max(sched.max_num_batched_tokens + sched.max_num_seqs * size, spec.max_position)
        return -(-tokens // size) + 2

    def _adaptive_budget(self, max_drafts: int) -> AdaptiveBudget:
        costs = self.executor.profile_step_costs(max_drafts, self.max_model_len)
        logger.info("step costs for the speculative budget: decodes %s; verifications %s; attention %.3g us "
                    "per query per context token", _curve(costs.decode), _curve(costs.verify),
                    1e6 * costs.per_context_token)
        if costs.drafts is not None:
            logger.info("drafting one more position: %s; the first: %s", _curve(costs.drafts),
                        costs.first_draft and _curve(costs.first_draft))
        if costs.block_passes is not None:
            logger.info("block drafter passes: %s", _curve(costs.block_passes))
        return AdaptiveBudget(max_drafts, costs.verify, costs.decode, costs.per_context_token, costs.drafts,
                              first_draft_costs=costs.first_draft, block_costs=costs.block_passes)

    def _log_capacity(self, num_blocks: int) -> None:
        tokens = (num_blocks - 1) * self.config.cache.block_size
        kv_dtype = self.config.cache.cache_dtype or self.config.model.dtype
        per_token = self.model_spec.kv_bytes_per_block // self.config.cache.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %s, %d bytes per token); max concurrency %.1fx "
                    "at max_model_len %d", num_blocks, self.config.cache.block_size, tokens,
                    str(kv_dtype).removeprefix("torch."), per_token, tokens / self.max_model_len, self.max_model_len)

    def _max_model_len(self, spec: ModelSpec, num_blocks: int) -> int:
        limit, asked = spec.max_position, self.config.model.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit} tokens.")
        length = asked or limit
        capacity = (num_blocks - 1) * self.config.cache.block_size - spec.lookahead
        if length > capacity:
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds no more", length, capacity)
            length = capacity
        return length

    def _warm_up_step_shapes(self) -> None:
        """Runs a few real steps of throw-away requests so that Triton compiles the attention kernel's
        variants before the first client comes: each (rows per program, request-count class, direct or
        prefix-sum program lookup) is a kernel of its own, and in an 8 s profile of the served H200 benchmark
        half the core's samples were compiling them. A mixed step of n requests (n - 1 decodes, one prompt
        chunk of q tokens) for each class of n and q; then, for each class of m, a step of m prompt chunks
        (one long, the rest 2 tokens: the prefix-sum lookup, which a served run's uneven chunks take)."""
        start = time.perf_counter()
        offload, self.kv_cache.offload = self.kv_cache.offload, None  # throw-away KV is not worth keeping
        try:
            self._run_warm_up_steps()
        finally:
            self.kv_cache.offload = offload
            if self.step_timer is not None:  # those steps' times were Triton's compiles
                self.step_timer.forget()
            self._last_resolved = None
        logger.info("warmed up step shapes in %.1fs", time.perf_counter() - start)

    def _run_warm_up_steps(self) -> None:
        sched = self.config.scheduler
        counts = [n for n in (1, 2, 65, 129, 257, 513, 1025) if n <= sched.max_num_seqs]
        queries = [q for q in (2, 3, 5, 9, 17, 33, 64) if q < sched.max_num_batched_tokens - max(counts)]
        params = SamplingParams(temperature=0.0, max_tokens=len(queries) + 2, ignore_eos=True)
        ids = itertools.count()
        chunked = [m for m in counts[1:] if queries and queries[-1] + 2 * m <= sched.max_num_batched_tokens]
        bar = _warm_up_bar(len(counts) * (1 + len(queries)) + len(chunked))
        for n in counts:
            decodes = [f"warm-up-{next(ids)}" for _ in range(n - 1)]
            for rid in decodes:
                self.add_request(CoreRequest(rid, [1], params, 0.0))
            self.step()  # the decodes' one-token prompts
            bar.update(1)
            for q in queries:
                k = next(ids)  # a prompt of its own: a prefix-cache hit would shorten the chunk
                prompt = [(k * 101 + j) % (self.model_spec.vocab_size - 1) + 1 for j in range(q)]
                rid = f"warm-up-{k}"
                self.add_request(CoreRequest(rid, prompt, params, 0.0))
                self.step()
                bar.update(1)
                self.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            self.finish_requests(decodes, RequestStatus.FINISHED_ABORTED)
        for m in chunked:
            rids = []
            for length in [queries[-1]] + [2] * (m - 1):
                k = next(ids)
                rids.append(f"warm-up-{k}")
                prompt = [(k * 101 + j) % (self.model_spec.vocab_size - 1) + 1 for j in range(length)]
                self.add_request(CoreRequest(rids[-1], prompt, params, 0.0))
            self.step()
            bar.update(1)
            self.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        bar.close()
        if self._inflight is not None:
            self._update(self._inflight[0], self._inflight[1].resolve())
            self._inflight = None
        self.step()  # an empty step: the runner forgets the finished requests
        self.kv_cache.reset_prefix_cache()
        self.kv_cache.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0

    # ---- requests ----

    def add_request(self, request: CoreRequest) -> None:
        self._check_kv_transfer(request)
        lead = self.requests.get(request.follows) if request.follows is not None else None
        req = Request(request.req_id, request.prompt_token_ids, request.params, self.eos_token_id,
                      request.arrival_time, request.priority, follows=lead, group=request.group or "",
                      pooling=request.pooling,
                      whole_prompt=request.pooling is not None and self.config.model.encoder_only, lora=request.lora,
                      cache_salt=request.cache_salt, mm_features=request.mm_features)
        if request.params.structured_outputs is not None:
            req.grammar = self.grammars.compile(request.params.structured_outputs)
            self._compiling[req.request_id] = time.monotonic() + COMPILE_TIMEOUT_S
        self.requests[request.req_id] = req
        self.scheduler.add_request(req)

    def _check_kv_transfer(self, request: CoreRequest) -> None:
        """A request's kv_transfer_params must be ones this engine's connector serves (ValueError otherwise)."""
        params = kv_transfer_params(request.params)
        if self.kv_connector is not None:
            self.kv_connector.check_request(params)
        else:
            check_kv_transfer_params(params, None, self.config.cache.block_size)

    def try_add_request(self, request: CoreRequest) -> EngineCoreOutput | None:
        """add_request for a core in its own process: a request it cannot take ends alone, with
        finish_reason "error" (returned), instead of taking the core down."""
        try:
            self.add_request(request)
        except Exception:  # noqa: BLE001 — whatever it was, it was this request's
            logger.exception("request %s could not be added; it ends with finish_reason \"error\"", request.req_id)
            self.finish_requests([request.req_id], RequestStatus.FINISHED_ERROR)
            return _error_output(request.req_id)
        return None

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """Ends requests the front-end is done with (aborted, or stopped by a stop string)."""
        self.scheduler.finish_requests(req_ids, status)
        for rid in req_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or KV offload copies not done (steps run until chunks reach the tiers)."""
        return bool(self.requests) or self.kv_cache.has_transfers

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.sleeping, stats.sleep_level = self.is_sleeping(), self._sleep_level if self._asleep else 0
        if self.step_cost is not None:
            total = self.step_cost.total
            stats.estimated_flops, stats.estimated_read_bytes = total.flops, total.read_bytes
            stats.estimated_write_bytes = total.write_bytes
        return stats

    # ---- sleep mode ----

    def sleep(self, level: int = 1, mode: str = "abort") -> list[EngineCoreOutput]:
        """vLLM's sleep: scheduling pauses (requests added meanwhile wait for wake_up), and from level 1 the
        workers free their memory (worker.sleep) after the prefix cache is emptied, its blocks' KV being lost.
        `mode`, for the requests in flight: "abort" ends them (their outputs, finish_reason "abort", are
        returned, with the last step's); "keep" keeps them, recomputed after wake_up where their KV is freed
        (from level 1); "wait" needs none in flight (the core process drains them before it calls this). A
        second sleep while asleep changes nothing (vLLM warns, as here)."""
        check_sleep_args(self.config.model.enable_sleep_mode, level, mode)
        if mode == "wait" and self.has_unfinished_requests():
            raise ValueError(f"Sleep mode 'wait' needs no request in flight here ({len(self.requests)} are): the "
                             "engine core process waits for them; in-process, sleep with mode 'abort' or 'keep'.")
        outputs = self._book_inflight()
        if mode == "abort":
            outputs += self._abort_all()
        if level >= 1 and self._asleep:
            logger.warning("the engine is asleep already; sleep(level=%d) changes nothing", level)
        elif level >= 1:
            self.scheduler.preempt_all()  # "keep": recomputed after waking (their KV goes)
            self.kv_cache.reset_prefix_cache()
            started = time.perf_counter()
            self.executor.collective_rpc("sleep", level)
            self._asleep, self._sleep_level = {"weights", "kv_cache"}, level
            logger.info("It took %.3f seconds to fall asleep (level %d).", time.perf_counter() - started, level)
        self._paused = True
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: the workers restore `tags` (None: weights and kv_cache; "scheduling" alone: only a
        level-0 pause ends), and scheduling resumes once nothing is asleep. The KV cache comes back empty."""
        check_sleep_enabled(self.config.model.enable_sleep_mode)
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            todo = [t for t in check_wake_tags(tags) if t in self._asleep]
            if todo:
                started = time.perf_counter()
                self.executor.collective_rpc("wake_up", todo)
                self._asleep.difference_update(todo)
                logger.info("It took %.3f seconds to wake up tags %s.", time.perf_counter() - started, todo)
        if not self._asleep:
            self._paused, self._sleep_level = False, 0

    def is_sleeping(self) -> bool:
        """Asleep at any level (a level-0 pause included), as vLLM's is_sleeping."""
        return self._paused or bool(self._asleep)

    def _book_inflight(self) -> list[EngineCoreOutput]:
        """The outputs of the step in flight (async scheduling), booked now."""
        if self._inflight is None:
            return []
        sched, pending = self._inflight
        self._inflight = None
        return self._update(sched, pending.resolve())

    def _abort_all(self) -> list[EngineCoreOutput]:
        """Ends every request (finish_reason "abort") and, unless paused, runs an empty step so the runner forgets
        them; their outputs, for the front-end."""
        aborted = list(self.requests)
        self.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
        if not self._paused:
            self.step()
            self._book_inflight()
        return [EngineCoreOutput(rid, [], finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason)
                for rid in aborted]

    # ---- one step ----

    def step(self) -> CoreOutputs:
        """Schedules and runs one step. With async scheduling the step is launched and the previous
        one's results are returned, so the host's work overlaps the device's.

        A step that raises and ran one request ends it (finish_reason "error"). One that ran several (with
        the step in flight, under async scheduling) makes them suspects: each is recomputed and runs alone
        until a step of its samples, and a suspect whose solo step fails is the culprit, ended the same way;
        the others go on. While suspects are left, each step is resolved before the next is scheduled, so
        a failure names its own step's requests.

        A worker's death ends the engine, and so do MAX_FAILED_STEPS faults in a row (no step with work
        succeeding between them: a broken device). A failed batch and the culprit found right after it
        count as one fault: three culprits in a row end the engine, and so does a failed batch whose
        first three suspects fail alone too."""
        if self._paused:  # asleep: requests wait for wake_up
            return CoreOutputs([], [])
        failed = self._check_compiles() if self._compiling else []
        isolating = bool(self.scheduler.suspects)
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.step_cost is not None:
            self.step_cost.count(sched)
        scheduled, scheduled_time = [new.req_id for new in sched.new_requests], time.monotonic()
        if self.kv_connector is not None:
            self._connector_before_step(sched)
        if self.grammars.portable and not self._workers_read_grammars and any(n.grammar for n in sched.new_requests):
            self.executor.collective_rpc("set_grammar_tokenizer", self.grammars.tokenizer_info_json())
            self._workers_read_grammars = True
        inflight = self._inflight  # None while isolating: those steps are resolved at once
        try:
            result = self.executor.execute_model(sched)
            if isinstance(result, AsyncModelRunnerOutput) and not isolating:
                self._inflight = (sched, result)
                outputs = self._update(inflight[0], self._resolve_pipelined(inflight)) if inflight is not None else []
            else:
                if isinstance(result, AsyncModelRunnerOutput):
                    result = result.resolve()  # isolating: a failure must name this step's requests
                outputs = self._update(sched, result)
                seconds = time.perf_counter() - started
                self._time_step(sched, seconds)
                self._observe_step_time(sched, seconds)
                self._last_resolved = None
        except FATAL_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 — any fault of a step is its requests' alone, up to a limit
            steps = [sched] + ([inflight[0]] if inflight is not None else [])
            return CoreOutputs(failed + self._fail_step(steps, e), scheduled, scheduled_time=scheduled_time)
        if not sched.is_empty:
            self._failed_steps, self._unexplained = 0, False
        return CoreOutputs(failed + outputs, scheduled, scheduled_time=scheduled_time)

    def _time_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A synchronous step's wall time, for the adaptive budget to check its profiled curves against: decode
        steps only (a token per request, plus its drafts), the steps the curves were profiled on."""
        budget = self.scheduler.spec_budget
        if budget is None or sched.is_empty:
            return
        drafts = sum(len(d) for d in sched.scheduled_spec_decode_tokens.values())
        if sched.total_num_scheduled_tokens != len(sched.num_scheduled_tokens) + drafts:
            return
        context = sum(r.num_computed_tokens for r in self.scheduler.running)
        budget.observe_step(seconds, sched.total_num_scheduled_tokens, bool(sched.scheduled_spec_decode_tokens),
                            sched.draft_limits, context)

    def _resolve_pipelined(self, inflight: tuple[SchedulerOutput, AsyncModelRunnerOutput]) -> ModelRunnerOutput:
        """The step in flight's output. Its time, for the step-time fit, is the gap since the step before it was
        resolved in the call before: while steps follow each other that is the engine's step cadence (the device's
        time where it is the slower, the host's where that is), what a running stream waits between its tokens; an
        empty step in between (an idle engine) starts the clock again."""
        output = inflight[1].resolve()
        now = time.perf_counter()
        previous, self._last_resolved = self._last_resolved, (now if not inflight[0].is_empty else None)
        if previous is not None:
            self._observe_step_time(inflight[0], now - previous)
        return output

    def _observe_step_time(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's measured time into the step-time bound's fit (engine/step_cost.py's StepTimer)."""
        if self.step_timer is not None and not sched.is_empty:
            self.step_timer.observe(load_of(request_steps(sched)), seconds)

    def _check_compiles(self) -> list[EngineCoreOutput]:
        """Ends the requests whose grammar failed to compile or took too long (finish_reason "error"); when
        nothing else can run, waits briefly for a compile instead of spinning."""
        now, ended = time.monotonic(), []
        for rid, deadline in list(self._compiling.items()):
            req = self.requests.get(rid)
            if req is None or req.grammar.done() and compile_error(req.grammar) is None:
                del self._compiling[rid]
                continue
            why = compile_error(req.grammar) or (now > deadline and f"not compiled within {COMPILE_TIMEOUT_S:g} s")
            if why:
                # the compiler's message may quote the request's schema or regex: escaped
                logger.error("request %s: its structured output's grammar failed: %s", rid, printable(why))
                del self._compiling[rid]
                self.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                ended.append(_error_output(rid))
        if self._compiling and not self.scheduler.running and len(self._compiling) == len(self.scheduler.waiting):
            futures.wait([self.requests[rid].grammar for rid in self._compiling], timeout=0.005,
                         return_when=futures.FIRST_COMPLETED)
        return ended

    def _fail_step(self, failed: list[SchedulerOutput], error: Exception) -> list[EngineCoreOutput]:
        """Ends the step's request if it ran one (the culprit), else makes its requests suspects."""
        req_ids = sorted({rid for sched in failed for rid in sched.num_scheduled_tokens if rid in self.requests})
        for sched in failed:
            self.kv_cache.transfers_done(sched.kv_transfers, ok=False)
            if sched.state_saves:
                self.kv_cache.checkpoints_done(sched.state_saves, ok=False)
        culprit = len(req_ids) == 1
        self._count_fault(culprit, error)
        self._inflight = None
        self.executor.discard_inflight()
        self.kv_cache.reset_prefix_cache()  # the step may have left its blocks' KV half-written
        if not culprit:
            logger.warning("a step of %d requests failed; each runs alone until it samples, to find the culprit: "
                           "%s", len(req_ids), ", ".join(req_ids[:8]), exc_info=error)
            self.scheduler.suspect(req_ids)
            return []
        logger.error("a step of request %s failed; it ends with finish_reason \"error\"", req_ids[0], exc_info=error)
        self.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        return [_error_output(req_ids[0])]

    def _count_fault(self, culprit: bool, error: Exception) -> None:
        """Raises on the MAX_FAILED_STEPS-th fault in a row. A culprit found right after a failed batch
        is that batch's fault, not a new one."""
        if not (culprit and self._unexplained):
            self._failed_steps += 1
        self._unexplained = not culprit
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{self._failed_steps} steps in a row failed; the last: {error!r}") from error

    def _connector_before_step(self, sched: SchedulerOutput) -> None:
        """The step's loads of KV read from other engines, on every rank before its forward pass; with nothing
        to run but requests waiting for their KV, a short pause instead of a spin."""
        self.kv_connector.before_step(self.executor.collective_rpc)
        if sched.is_empty and self.kv_connector.waiting_for_remote:
            time.sleep(0.002)

    def _update(self, sched: SchedulerOutput, runner_out) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(sched, runner_out)
        if self.kv_connector is not None:  # stages the finished requests' KV before their outputs leave
            self.kv_connector.after_update(outputs, self.executor.collective_rpc)
        for out in outputs:
            if out.finish_reason is not None:
                self.requests.pop(out.req_id, None)
        return outputs

    def shutdown(self) -> None:
        """Drops the scheduler's state and has the executor free the workers' models and device memory;
        the offload tiers finish their queued writes first (a restart finds them)."""
        self._inflight = None
        self.requests.clear()
        if getattr(self, "grammars", None) is not None:
            self.grammars.shutdown()
        if getattr(self, "kv_offload", None) is not None:
            self.kv_offload.close()
            self.kv_offload = None
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.close()
            self.kv_connector = None
        self.executor.shutdown()


def _error_output(req_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, [], finish_reason=RequestStatus.FINISHED_ERROR.finish_reason)


def _curve(costs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{n} tok {1000 * t:.1f} ms" for n, t in costs)


def _warm_up_bar(total: int):
    """A tqdm bar over the warm-up's steps (vLLM shows one while it captures its graphs)."""
    from tqdm import tqdm
    return tqdm(total=total, desc="Warming up step shapes", unit="step", dynamic_ncols=True)
