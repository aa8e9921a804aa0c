"""The synchronous engine: request table, scheduling, one model step, detokenization, outputs.

`add_request` validates before touching any state, so a bad request never disturbs the others.
Each `step` schedules, runs the model once, and returns a cumulative RequestOutput for every
request that moved.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pressroom.config import EngineArgs, EngineConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TopLogprobs
from pressroom.core.request import Request, RequestStatus
from pressroom.core.scheduler import Scheduler, SchedulerStats
from pressroom.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from pressroom.model.loader import load_model
from pressroom.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from pressroom.sampling_params import RequestOutputKind, SamplingParams
from pressroom.spec_decode.budget import AdaptiveBudget
from pressroom.spec_decode.proposer import make_proposer
from pressroom.worker.model_runner import ModelRunner, PendingOutput, kv_cache_bytes_per_block

logger = logging.getLogger("pressroom")

MAX_LOGPROBS = 20
_CUDA_GRAPH_RESERVE = 1 << 30  # graphs' memory pool is allocated after the KV cache; measured and logged at capture
PromptType = str | list[int] | dict


@dataclass(slots=True)
class _Child:
    """Output-side state of one sample of a request."""
    index: int
    detok: IncrementalDetokenizer | None
    request_id: str = ""  # the engine-internal id the scheduler knows it by
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    session_id: str | None = None

    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


def _relax_gc() -> None:
    """Cyclic-GC passes over the engine's many long-lived objects took half of the host's time per step
    at 1,000 requests (benchmarks/host_overhead.py): collect the young generation 14x less often, and the
    old ones rarely. Only raised, never lowered; cycles are still collected (gc.freeze would keep
    a deleted engine's cycles, and its GPU memory, alive)."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, 10_000), max(middle, 20), max(old, 100))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        loaded = load_model(config.model, config.device)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.model_path = loaded.source
        self.decode = fast_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_id = self._eos_token_id()
        self.runner = ModelRunner(self.model, config.cache.block_size, config.model.dtype, config.model.seed,
                                  config.device, config.scheduler.async_scheduling, config.cache.cache_dtype)
        self.runner.proposer = make_proposer(config.speculative, self.runner)
        # Async scheduling with speculation (config allows it only for drafters that work on the device).
        self.runner.device_drafting = config.scheduler.async_scheduling and config.speculative is not None
        if self.runner.device_drafting and not hasattr(self.runner.proposer, "propose_on_device"):
            raise ValueError(f'Speculative method "{config.speculative.method}" runs with synchronous scheduling; '
                             "set async_scheduling=False.")
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
        self.vocab_size = self.hf_config.vocab_size
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        self._ids = itertools.count()
        _relax_gc()
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine ready in %.1fs: %s on %s, max_model_len %d", self.startup_seconds, self.model_path,
                    config.device, self.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

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
        if hasattr(self.runner.proposer, "kv_bytes_per_block"):  # a draft model's cache has as many blocks
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
        drafts = first = None
        if hasattr(self.runner.proposer, "profile_decode_steps"):  # each draft position has a cost of its own
            drafts = self.runner.proposer.profile_decode_steps([n for n in ladder if n <= sched.max_num_seqs])
            if hasattr(self.runner.proposer, "profile_first_draft_steps"):  # a draft model mirroring under async
                first = self.runner.proposer.profile_first_draft_steps([n for n in ladder if n <= sched.max_num_seqs])
            logger.info("drafting one more position: %s; the first: %s", _curve(drafts), first and _curve(first))
        blocks = None
        if hasattr(self.runner.proposer, "profile_block_passes"):  # a block drafter's shared pass
            blocks = self.runner.proposer.profile_block_passes([n for n in ladder if n <= sched.max_num_seqs])
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
        if hasattr(self.runner.proposer, "capture_cudagraphs"):
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

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, session_id: str | None = None) -> None:
        """`session_id` (optional) groups requests of one conversation or user; it comes back on every
        RequestOutput of this request. It does not change scheduling."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        params = self._with_think_markers(params)
        self._validate(request_id, token_ids, params)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(token_ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = [_Child(i, self._detokenizer(token_ids, params), f"{next(self._ids)}",
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
                    for i in range(params.n)]
        parent = _Parent(request_id, text, token_ids, params, children, RequestMetrics(arrival),
                         prompt_logprobs=[] if params.prompt_logprobs is not None else None,
                         session_id=session_id)
        self.parents[request_id] = parent
        lead = None
        for child in children:
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + child.index)
            req = Request(child.request_id, token_ids, child_params, self.eos_token_id, arrival, priority, follows=lead)
            lead = lead or req
            self.child_to_parent[child.request_id] = (parent, child)
            self.scheduler.add_request(req)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) exactly as add_request would see them (BOS per the model)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("This engine was started with skip_tokenizer_init: give prompts as token ids.")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=self._add_bos()) if prompt else []
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"A prompt is a string, a list of token ids or a dict; got {type(prompt).__name__}.")

    def think_marker_ids(self, start: str = "<think>", end: str = "</think>") -> tuple[list[int], list[int]] | None:
        """Token ids of the thinking span's markers when the vocabulary has both as single tokens, else None."""
        if self.tokenizer is None:
            return None
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in (start, end)]
        unk = self.tokenizer.unk_token_id
        if any(i is None or i == unk or i < 0 for i in ids):
            return None
        return [ids[0]], [ids[1]]

    def _with_think_markers(self, params: SamplingParams) -> SamplingParams:
        """A thinking budget without marker ids gets the tokenizer's `<think>` / `</think>`."""
        if params.thinking_token_budget is None or params.think_end_token_ids:
            return params
        markers = self.think_marker_ids()
        if markers is None:
            raise ValueError("thinking_token_budget needs think_end_token_ids: this tokenizer has no "
                             "`<think>` / `</think>` tokens.")
        start = markers[0] if params.think_start_token_ids is None else params.think_start_token_ids
        return params.clone(think_start_token_ids=start, think_end_token_ids=markers[1])

    def _add_bos(self) -> bool:
        return bool(getattr(self.hf_config, "add_bos_token", True))

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if not token_ids:
            raise ValueError("The prompt is empty; give at least one token.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"The prompt is {len(token_ids)} tokens long, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; shorten the prompt.")
        if any(type(t) is not int or not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"Prompt token ids must lie in [0, {self.vocab_size}) and be integers.")
        if params.stop_strings and self.decode is None:
            raise ValueError("Stop strings need a tokenizer; this engine was started with skip_tokenizer_init.")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {self.vocab_size}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name}={value} exceeds the maximum of {MAX_LOGPROBS}.")
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {self.vocab_size}).")
        for name in ("think_start_token_ids", "think_end_token_ids"):
            if any(not 0 <= t < self.vocab_size for t in getattr(params, name) or []):
                raise ValueError(f"{name} must lie in [0, {self.vocab_size}).")

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize or self.decode is None:
            return None
        return IncrementalDetokenizer(self.decode, prompt_ids, params.skip_special_tokens, params.stop_strings,
                                      params.include_stop_str_in_output, params.min_tokens)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            child_ids = [c.request_id for c in parent.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for cid in child_ids:
                self.child_to_parent.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step. With async scheduling the step is launched and the previous
        one's results are returned, so the host's work overlaps the device's."""
        sched = self.scheduler.schedule()
        self._mark_scheduled(sched.new_requests)
        result = self.runner.execute_model(sched)
        if not isinstance(result, PendingOutput):
            return self._process(sched, result)
        previous, self._inflight = self._inflight, (sched, result)
        return self._process(previous[0], previous[1].resolve()) if previous is not None else []

    def _process(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        core_outputs = self.scheduler.update_from_output(sched, runner_out)
        now = time.monotonic()
        moved: dict[str, _Parent] = {}
        for out in core_outputs:
            entry = self.child_to_parent.get(out.req_id)
            if entry is not None:
                self._absorb(entry[0], entry[1], out, now)
                moved[entry[0].request_id] = entry[0]
        outputs = []
        for parent in moved.values():
            finished = parent.finished()
            if finished or parent.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._finish_or_report(parent, finished, now))
        return outputs

    def _mark_scheduled(self, new_requests) -> None:
        now = time.monotonic()
        for new in new_requests:
            entry = self.child_to_parent.get(new.req_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = now

    def _absorb(self, parent: _Parent, child: _Child, out: EngineCoreOutput, now: float) -> None:
        if out.prompt_logprobs is not None and len(parent.prompt_logprobs) < len(parent.prompt_token_ids):
            parent.prompt_logprobs.extend(self._position_logprobs(lp) for lp in out.prompt_logprobs)
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.new_token_ids and parent.metrics.first_token_time is None:
            parent.metrics.first_token_time = now
        last = len(out.new_token_ids) - 1
        for k, token in enumerate(out.new_token_ids):
            child.token_ids.append(token)
            if out.logprobs is not None:
                position = self._position_logprobs(out.logprobs[k])
                child.logprobs.append(position)
                child.cumulative_logprob += position[token].logprob
            stop_token = k == last and out.finish_reason == "stop" and not parent.params.include_stop_str_in_output
            if child.detok is not None and not stop_token and child.detok.add(token) is not None:
                self._stop_on_string(parent, child)
                break
        if out.new_token_ids:
            parent.metrics.last_token_time = now
        if out.finish_reason is not None and child.finish_reason is None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason

    def _stop_on_string(self, parent: _Parent, child: _Child) -> None:
        child.finish_reason, child.stop_reason = "stop", child.detok.stopped_by
        self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED)

    def _position_logprobs(self, top: TopLogprobs | None) -> PositionLogprobs | None:
        if top is None:
            return None
        ids, lps, ranks = top
        decode = self.decode or (lambda ids, skip: None)
        return {t: Logprob(lp, rank, decode([t], False)) for t, lp, rank in zip(ids, lps, ranks)}

    def _finish_or_report(self, parent: _Parent, finished: bool, now: float) -> RequestOutput:
        if finished:
            parent.metrics.finished_time = now
            self.parents.pop(parent.request_id, None)
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)
        return self._request_output(parent, finished)

    def _request_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        outputs = [CompletionOutput(c.index, c.detok.visible_text(c.finish_reason is not None) if c.detok else "",
                                    list(c.token_ids), c.cumulative_logprob,
                                    list(c.logprobs) if c.logprobs is not None else None,
                                    c.finish_reason, c.stop_reason)
                   for c in parent.children]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.prompt_logprobs, parent.num_cached_tokens, parent.metrics, parent.session_id)


def _curve(costs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{n} tok {1000 * t:.1f} ms" for n, t in costs)
