"""One token budget per step, shared by every request; no prefill or decode phases.

Each step, running requests get their next tokens first (1 for a decode, a chunk for a long
prompt), then waiting requests are admitted in priority order while budget and blocks last.
When blocks run out, the worst running request is preempted and later recomputed.

A prompt gets at most `long_prefill_token_threshold` of a step (vLLM's knob), so a long one leaves room for
others. With `prefill_cost_context` set, the step's budget and that threshold count cost, not tokens: a prompt
chunk's attention grows with the context already computed, so a long prompt's later chunks count for more and
shrink. Both are set by default (config.py: the CPU's measured, CUDA's from the model's FLOPs), so a step's time
stays bounded while a long prompt is prefilled. Where the engine gives a step-time model and `step_time_factor` is set
(CUDA's default), a step's prompt tokens beside running decodes are also held to a multiple of the decodes' own step
time, estimated (core/step_time.py), so a wave of new prompts no longer stalls every running stream.

A client's request fans out into many (n samples, a list of prompts): a group (`Request.group`). Among requests
of equal priority, the better rank goes to the one whose group runs fewer requests, then to the earlier arrival
(`_fair_key`), a group's own requests keeping their order: a single request arriving behind one of n = 128 is
admitted before the 65th sample. When every slot (max_num_seqs) is taken, a group running two or more requests
more than a waiting one gives it its latest slot (`_share_slots`); running out of blocks, the latest sibling of
the largest group is preempted first.

Progress is booked when a step is scheduled: a step that reaches the end of a request's tokens
leaves output placeholders, one per token it may emit (1 + its drafts), given back when its tokens
come back. So the next step can be scheduled before the previous one's tokens are known (async
scheduling), or right after (sync). With speculative decoding under async scheduling the booking is
optimistic (every draft accepted); the runner shifts the next step's positions by the rejections it
finds on the device, and the scheduler gives the rejected progress back when the step resolves.

Pooling requests (embeddings) are prompts without outputs: they take their share of the same budget, never
take prefix-cache hits (every token's hidden state is pooled), and finish with the step that completes their
prompt, carrying the runner's vector; an encoder's prompt (`whole_prompt`) is scheduled whole or waits.

A request with structured outputs waits in the queue until its grammar has compiled (its `grammar` future, on the
engine core's compile threads; vLLM's WAITING_FOR_FSM); the others are admitted past it meanwhile.

The requests of a step that failed become suspects (`suspect`): each is recomputed from scratch and runs
alone until one of its steps samples, so a second failure names its culprit. Meanwhile the other requests
go on in steps of their own, taking turns with the suspect's.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from pressroom.config import SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.media_schedule import EncoderBudget, media_chunk
from pressroom.core.outputs import (
    PLACEHOLDER_DRAFT,
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pressroom.core.request import Request, RequestStatus
from pressroom.core.spec_budget import AdaptiveBudget
from pressroom.core.spec_calibration import ReliabilityTable
from pressroom.core.step_time import StepTimeBound, StepTimeModel
from pressroom.core.structured_outputs import grammar_ready
from pressroom.kv_offload.manager import OffloadStats

# vLLM's buckets of tokens per engine step (vllm:iteration_tokens_total): the scheduler counts its steps by them
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec: SpecDecodingStats | None = None
    offload: OffloadStats | None = None
    # LoRA adapters (their names) of the running and the waiting requests, each once (vLLM's lora_requests_info)
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    kv_transfer: KVTransferStats | None = None  # a KV connector's counters, if one runs
    # of num_waiting, the requests held back by something passing rather than by room (vLLM's "deferred" reason):
    # a sibling's prompt, a grammar compiling, --max-loras adapters running, KV on its way from a tier or an engine
    num_waiting_deferred: int = 0
    # tokens scheduled per step, per ITERATION_TOKENS_BUCKETS bucket (not cumulative; the last: above them all)
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    iteration_tokens_sum: int = 0
    # a KV connector's lookups (vLLM's external prefix cache): prompt tokens of the requests it was asked about
    # at their first scheduling, and of those the ones it loaded from another engine
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # the engine core's sleep (vLLM's sleep mode; set by the core, not the scheduler): asleep at all (a level-0
    # pause included), and the level of its last sleep while asleep (0: awake or only paused)
    sleeping: bool = False
    sleep_level: int = 0
    # --enable-mfu-metrics: the engine core's estimates over its steps since start, per GPU (engine/step_cost.py;
    # set by the core, not the scheduler; 0 without the flag)
    estimated_flops: int = 0
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0


@dataclass(slots=True)
class KVTransferStats:
    """A KV connector's counters since start (distributed/kv_transfer/): vLLM's KV connector figures, in
    pressroom's terms."""
    bytes_received: int = 0  # chunk bytes read from other engines and checked
    tokens_received: int = 0  # prompt tokens whose KV came from another engine and was used
    transfers_done: int = 0  # reads that completed and passed their checks
    transfers_failed: int = 0  # reads that failed, timed out or came back corrupt: the prompt was computed here
    corrupt_chunks: int = 0  # chunks whose header or checksum did not hold
    bytes_staged: int = 0  # a producer's chunk bytes staged for other engines
    bytes_sent: int = 0  # of those, the ones a consumer confirmed it read
    transfers_staged: int = 0
    transfers_expired: int = 0  # staged chunks no consumer read within abort_request_timeout_s
    staging_slots_used: int = 0  # chunks of the staging buffer held now (a gauge)
    staging_slots: int = 0
    # E/P/D: media items' encoder outputs staged for, and read from, other engines; the encoder's runs here
    media_staged: int = 0
    media_received: int = 0  # read, checked and put into the encoder cache: not encoded here
    media_failed: int = 0  # reads that failed or were corrupt: encoded here instead
    encoder_runs: int = 0  # media items this engine's encoder computed (as of its last finished request)

    def copy(self) -> KVTransferStats:
        return replace(self)


@dataclass(slots=True)
class SpecDecodingStats:
    """Counters with vLLM's meaning: mean acceptance length = 1 + accepted / drafts."""
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # A drafter's stated per-token confidences against verification's outcomes (spec_calibration.py): as it
    # states them, and as confidence-scheduled verification plans with them (after calibration).
    stated: ReliabilityTable = field(default_factory=ReliabilityTable)
    calibrated: ReliabilityTable = field(default_factory=ReliabilityTable)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def observe_confidences(self, stated: list[float], calibrated: list[float] | None, num_draft: int,
                            num_accepted: int) -> None:
        """Each draft verified on its own (the ones before it accepted): its confidence against its fate."""
        for j in range(min(num_accepted + 1, num_draft, len(stated))):
            self.stated.add(stated[j], j < num_accepted)
            if calibrated is not None and j < len(calibrated):
                self.calibrated.add(calibrated[j], j < num_accepted)

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos), self.stated.copy(), self.calibrated.copy())


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, *, spec_budget: AdaptiveBudget | None = None,
                 lookahead: int = 0, async_drafts: int = 0, kv_connector: Any = None,
                 step_time: StepTimeModel | None = None) -> None:
        """`spec_budget`: the adaptive speculative budget (None: every draft, up to the drafter's K);
        `lookahead`: slots each request keeps past its scheduled tokens for a drafter that writes into its
        blocks (a device drafter, or MTP in the target's block tables); `async_drafts`: under async scheduling
        with a device drafter, the placeholder drafts every sampling step leaves for the next one (their ids
        stay on the device); `kv_connector`: the scheduler side of a KV connector (distributed/kv_transfer/:
        prompt KV loaded from other engines, a finished request's staged for them), or None; `step_time`: the
        device's step-time estimates, which config.step_time_factor bounds a step's prompt tokens by (None, or a
        factor of 0: no such bound)."""
        self.config = config
        self.connector = kv_connector
        self._external: dict[str, int] = {}  # request -> prompt tokens a KV connector loaded at its first scheduling
        self.kv = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[tuple, int, Request]] = []  # heap
        self.running: list[Request] = []
        self._tiebreak = itertools.count()
        # each request's place among equal keys, kept when it is preempted: it goes back to its place in the queue
        # (before the siblings that arrived with it and have not run yet)
        self._order: dict[str, int] = {}
        self._seen_by_runner: set[str] = set()
        self._stale: set[str] = set()
        self.num_preemptions = 0
        self._encoder = EncoderBudget(config.encoder_budget)  # the step's, renewed by each _schedule
        self._step_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # steps per tokens-scheduled bucket
        self._step_tokens_sum = 0
        self._external_queries = self._external_hits = 0
        # Waiting requests their last admission pass skipped for something passing, not for a lack of room (vLLM's
        # "deferred" waiting reason): a sibling's prompt, a grammar compiling, --max-loras, KV on its way.
        self._deferred: set[str] = set()
        self.spec_stats = SpecDecodingStats()
        self.spec_budget, self.lookahead, self.async_drafts = spec_budget, lookahead, async_drafts
        # Requests of a failed step, in the order they run alone (see suspect()).
        self.suspects: dict[str, Request] = {}
        self._solo_turn = False
        # the step-time bound (core/step_time.py), renewed each step; None: off
        self.time_bound = StepTimeBound(step_time, config.step_time_factor) \
            if step_time is not None and config.step_time_factor else None

    # ---- request table ----

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._order[request.request_id] = next(self._tiebreak)
        self._enqueue(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting = [e for e in self.waiting if e[2] is not req]
                heapq.heapify(self.waiting)
            self._finish(req, status)

    def suspect(self, request_ids: list[str]) -> None:
        """Requests of a step that failed: each is preempted (recomputed from scratch, its tokens so far kept,
        its runner state dropped) and then runs alone until one of its steps samples; if that step fails
        too, the engine ends it as the culprit."""
        reqs = [self.requests[rid] for rid in request_ids if rid in self.requests]
        for req in sorted(reqs, key=self._key):
            if req.status == RequestStatus.RUNNING:
                self._preempt(req)
            req.follows = None  # alone, it cannot wait for a sibling's prompt: that sibling may be waiting
            self.suspects[req.request_id] = req

    def preempt_all(self) -> None:
        """Preempts every running request, to be recomputed when next scheduled (the engine core's sleep with
        mode "keep", which frees the KV cache under them, as vLLM resets running requests)."""
        for req in list(self.running):
            self._preempt(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage(), self.num_preemptions,
                              self.kv.stats.queries, self.kv.stats.hits,
                              self.spec_stats.copy(),
                              self.kv.offload.snapshot() if self.kv.offload is not None else None,
                              *self._adapters_in_use(),
                              self.connector.stats() if self.connector is not None else None,
                              len(self._deferred),
                              list(self._step_tokens), self._step_tokens_sum,
                              self._external_queries, self._external_hits)

    def _count_step(self, tokens: int) -> None:
        """One step's scheduled tokens into vLLM's iteration_tokens buckets (an empty step is no step)."""
        if tokens:
            bucket = next((i for i, b in enumerate(ITERATION_TOKENS_BUCKETS) if tokens <= b),
                          len(ITERATION_TOKENS_BUCKETS))
            self._step_tokens[bucket] += 1
            self._step_tokens_sum += tokens

    def _adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The running and the waiting requests' LoRA adapters, each name once (empty without --enable-lora)."""
        if not self.config.max_loras:
            return [], []
        running = dict.fromkeys(r.lora.lora_name for r in self.running if r.lora is not None)
        waiting = dict.fromkeys(e[2].lora.lora_name for e in self.waiting if e[2].lora is not None)
        return list(running), list(waiting)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """The next step. While suspects are left, steps take turns: the first suspect alone, then the
        other requests without it (when there are others), so the requests that did not fail keep going."""
        if not self.suspects:
            sched = self._schedule()
        else:
            first = next(iter(self.suspects.values()))
            self._solo_turn = not self._solo_turn or not self._others_left()
            if self._solo_turn:
                sched = self._schedule_among(lambda r: r is first)
            else:
                sched = self._schedule_among(lambda r: r.request_id not in self.suspects)
        self._count_step(sched.total_num_scheduled_tokens)
        return sched

    def _others_left(self) -> bool:
        return any(r.request_id not in self.suspects for r in self.running) or \
            any(e[2].request_id not in self.suspects for e in self.waiting)

    def _schedule_among(self, keep: Callable[[Request], bool]) -> SchedulerOutput:
        """A step of the requests `keep` picks; the others sit this step out untouched."""
        running, waiting = self.running, self.waiting
        self.running = [r for r in running if keep(r)]
        self.waiting = [e for e in waiting if keep(e[2])]
        heapq.heapify(self.waiting)
        try:
            return self._schedule()
        finally:
            self.running += [r for r in running if not keep(r)]
            self.waiting += [e for e in waiting if not keep(e[2])]
            heapq.heapify(self.waiting)

    def _schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._encoder = EncoderBudget(self.config.encoder_budget)  # the step's encoder rows (core/media_schedule.py)
        scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        sampling: list[Request] = []  # requests whose step ends at their last token: they draft after it
        preempted_now = False

        # Best first, so a victim (the worst) is never one already scheduled this step.
        self._sort_running()
        self._share_slots()
        if self.spec_budget is not None:
            self.spec_budget.tick()
            # Async drafting with a planning budget: the placeholders are the plan's, priced already.
            if not (self.async_drafts and self.spec_budget.draft_costs is not None):
                self._trim_drafts(budget)
        wanted = [(req, self._num_new_tokens(req, budget)) for req in self.running]
        if self.time_bound is not None:  # the decodes' own step is its baseline
            self.time_bound.begin((1 + len(r.spec_token_ids), r.num_computed_tokens) for r, n in wanted if n == 1)
        for req, n in wanted:
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            n = self._prefill_chunk(min(n, budget), req.num_computed_tokens, budget)
            n = self._within_step_time(req, n, req.num_computed_tokens)
            n = media_chunk(req.mm_features, req.num_computed_tokens, n, budget, self._encoder)
            if n == 0:
                continue
            prompt_chunk = n > 1  # else a decode: its step time is the bound's baseline already
            drafts = self._drafts_that_fit(req, n, budget)
            cost = self._cost(n, req.num_computed_tokens) + len(drafts)
            n += len(drafts)
            old_len = len(self.kv.req_blocks.get(req.request_id, ()))
            while not self.kv.allocate_slots(req, n + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled[req.request_id] = n
            if drafts:
                spec_tokens[req.request_id] = drafts
            budget = max(0, budget - cost)
            if prompt_chunk and self.time_bound is not None:
                self.time_bound.take(n, req.num_computed_tokens)
            new_blocks = self.kv.block_ids(req.request_id)[old_len:]
            cached_reqs.append(CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens))
            if self._book(req, n, len(drafts)):
                sampling.append(req)

        # Admitting new work in a step that had to preempt would just thrash.
        if not preempted_now:
            self._admit_waiting(budget, scheduled, new_reqs, sampling)

        stale, self._stale = self._stale, set()
        return SchedulerOutput(new_reqs, cached_reqs, scheduled, sum(scheduled.values()), stale, spec_tokens,
                               self._plan_drafts(sampling), self.kv.take_transfers(), self.kv.take_state_saves())

    def _plan_drafts(self, sampling: list[Request]) -> dict[str, int]:
        """Where drafting costs a forward pass per draft position (a draft model), how many drafts each
        request sampling this step should draft for the next, planned before any drafting: at high
        concurrency none, so the drafter is not run for drafts the next step would not verify."""
        budget = self.spec_budget
        if budget is None or budget.draft_costs is None or not sampling:
            return {}
        def room(r: Request) -> int:
            # Async: the step's placeholders count as if every draft were accepted (the next step's are
            # placed now); sync: the runner caps the drafts by the exact room once the tokens are known.
            in_flight = r.num_output_placeholders if self.async_drafts else 0
            return r.sampling_params.max_tokens - r.num_output_tokens - in_flight - 1

        allowed = {r.request_id: max(0, min(budget.k, room(r))) for r in sampling}
        base = min(self.config.max_num_batched_tokens,
                   sum(max(1, r.num_tokens - r.num_computed_tokens) for r in self.running))
        contexts = {r.request_id: r.num_computed_tokens for r in sampling}
        limits = budget.plan(allowed, max(1, base), contexts, sum(r.num_computed_tokens for r in self.running))
        if self.async_drafts:  # the placeholders the next step verifies at most
            for r in sampling:
                r.spec_token_ids = r.spec_token_ids[:limits[r.request_id]]
        return limits

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self.kv.transfers_done(sched.kv_transfers)
        if sched.state_saves:
            self.kv.checkpoints_done(sched.state_saves)
        results = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted since this step was scheduled: drop its tokens
            if req.pooling is not None:
                results += self._finish_pooled(req, out.pooled.get(rid))
                continue
            new_ids = out.sampled_token_ids.get(rid, [])
            drafts = sched.scheduled_spec_decode_tokens.get(rid)
            if new_ids:
                req.num_output_placeholders -= 1 + len(drafts or ())
                if self.suspects:
                    self.suspects.pop(rid, None)  # a step of its own sampled: it is cleared
            if drafts:  # give back the slots of rejected drafts: their KV is overwritten later
                accepted = len(new_ids) - 1
                req.num_computed_tokens -= len(drafts) - accepted
                self.spec_stats.observe(len(drafts), accepted)
                stated = req.spec_confidences[:len(drafts)]
                if stated:  # judged before this outcome teaches the calibrator
                    planned = self.spec_budget.calibrated(stated) if self.spec_budget is not None else None
                    self.spec_stats.observe_confidences(stated, planned, len(drafts), accepted)
                if self.spec_budget is not None:
                    self.spec_budget.observe(rid, len(drafts), accepted, stated)
            if not self.async_drafts:  # else the next step's drafts are placeholders, booked at schedule time
                req.spec_token_ids = out.draft_token_ids.get(rid, [])
                req.spec_confidences = out.draft_confidences.get(rid, [])
            kept = self._append_tokens(req, new_ids)
            prompt_lps = out.prompt_logprobs.get(rid)
            if not kept and prompt_lps is None:
                continue
            lps = out.logprobs.get(rid)
            results.append(EngineCoreOutput(
                rid, kept, req.status.finish_reason, req.stop_reason,
                lps[:len(kept)] if lps is not None else None, prompt_lps, max(req.num_cached_tokens, 0),
                num_external_tokens=self._external.get(rid, 0), num_preemptions=req.num_preemptions))
            if req.status.finished:
                self._free(req)
        return results

    # ---- internals ----

    def _finish_pooled(self, req: Request, pooled: list[float] | None) -> list[EngineCoreOutput]:
        """A pooling request ends with the step that finishes its prompt (its vector); earlier chunks say nothing."""
        if pooled is None:
            return []
        req.status = RequestStatus.FINISHED_STOPPED
        self._free(req)
        return [EngineCoreOutput(req.request_id, [], req.status.finish_reason, pooled=pooled)]

    def _admit_waiting(self, budget: int, scheduled: dict[str, int], new_reqs: list[NewRequestData],
                       sampling: list[Request]) -> None:
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs or self._time_is_up():
            return
        admitted = 0
        for entry in self._fair_order():
            req = entry[2]
            self._deferred.add(req.request_id)  # until it is found waiting for room, or admitted
            if not req.is_ready() or not grammar_ready(req.grammar):  # a sibling's prompt; a grammar compiling
                continue
            if not self._adapter_fits(req):  # --max-loras adapters run already
                continue
            sources = self._prefix_sources(req)
            if sources is None:  # its prefix is on its way from an offload tier or another engine
                continue
            hits, num_hit, loaded, external = sources
            self._deferred.discard(req.request_id)  # from here on, only room (budget, blocks) holds it back
            req.num_computed_tokens = 0
            n = self._first_chunk(req, num_hit + external, budget)
            if n == 0:  # it waits for a step with room (tokens, or encoder budget for its next image) for it
                continue
            if not self.kv.allocate_slots(req, external + n + self.lookahead, hits, loaded):
                break
            num_hit = self._take_prefix(req, len(hits), num_hit, external)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted += 1
            scheduled[req.request_id] = n
            budget = max(0, budget - self._cost(n, num_hit))
            if self.time_bound is not None:
                self.time_bound.take(n, num_hit)
            new_reqs.append(NewRequestData(req.request_id, req.all_token_ids, req.num_prompt_tokens,
                                           req.sampling_params, self.kv.block_ids(req.request_id), num_hit,
                                           req.eos_token_id, req.pooling,
                                           req.grammar.result() if req.grammar is not None else None,
                                           *self.kv.state_slots(req.request_id), lora=req.lora,
                                           mm_features=req.mm_features))
            if self._book(req, n, 0):
                sampling.append(req)
            self._seen_by_runner.add(req.request_id)
            if budget == 0 or len(self.running) >= self.config.max_num_seqs or self._time_is_up():
                break
        if admitted:
            self.waiting = [e for e in self.waiting if e[2].status != RequestStatus.RUNNING]
            heapq.heapify(self.waiting)

    def _prefix_sources(self, req: Request) -> tuple[list, int, tuple, int] | None:
        """Where `req`'s prompt KV comes from before it computes: the device's prefix hits, the chunks an offload
        tier holds past them (both in num_hit) and the tokens a KV connector loads from another engine after those
        (external); None while any of them is still on its way."""
        if req.pooling is None:
            hits, num_hit = self.kv.get_computed_blocks(req)
            loaded = self.kv.offloaded_chunks(req, len(hits))
        else:  # pooling reads the hidden states of every prompt token: no prefix hits
            hits, num_hit, loaded = [], 0, ()
        if loaded is None:
            return None
        num_hit += len(loaded) * self.kv.block_size
        external = 0
        if self.connector is not None and req.pooling is None:
            external = self.connector.get_num_new_matched_tokens(req, num_hit)
            if external is None:
                return None
        return hits, num_hit, loaded, external

    def _first_chunk(self, req: Request, computed: int, budget: int) -> int:
        """The prompt tokens `req` computes in its first step after `computed` known ones (0: it waits). An
        encoder's prompt is never chunked; a chunk never ends inside an image's bidirectional run."""
        if req.whole_prompt:
            return req.num_tokens if req.num_tokens <= budget else 0
        n = self._prefill_chunk(min(req.num_tokens - computed, budget), computed, budget)
        n = self._within_step_time(req, n, computed)
        return media_chunk(req.mm_features, computed, n, budget, self._encoder)

    def _within_step_time(self, req: Request, n: int, computed: int) -> int:
        """A prompt chunk of n tokens after `computed`, cut to what the step-time bound holds (core/step_time.py);
        a single token (a decode's, counted in the bound's baseline) and an encoder's whole prompt are not cut."""
        if self.time_bound is None or n <= 1 or req.whole_prompt:
            return n
        return self.time_bound.fit(n, computed)

    def _time_is_up(self) -> bool:
        """Whether the step-time bound holds no more prompt tokens this step (admission can stop)."""
        return self.time_bound is not None and self.time_bound.full

    def _take_prefix(self, req: Request, num_hit_blocks: int, num_hit: int, external: int) -> int:
        """Books an admitted request's known prompt tokens (the connector told of its blocks, the first admission's
        cache and connector counts); returns them, external tokens included."""
        if external:
            self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), num_hit_blocks, external)
            num_hit += external
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            if self.connector is not None and req.pooling is None:
                self._external_queries += req.num_tokens
                self._external_hits += external
            if external:
                self._external[req.request_id] = external
        return num_hit

    def _adapter_fits(self, req: Request) -> bool:
        """Whether the running requests with `req` hold at most max_loras distinct LoRA adapters."""
        if req.lora is None or not self.config.max_loras:
            return True
        running = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        return req.lora.lora_int_id in running or len(running) < self.config.max_loras

    def _fair_order(self) -> Iterator[tuple[tuple, int, Request]]:
        """The waiting entries, best first by `_fair_key`, each group's rank counting its requests running and
        those admitted meanwhile (an entry the caller admits is RUNNING when the next one is asked for); a
        group's own entries keep their queue order."""
        running = Counter(r.group for r in self.running)
        groups: dict[str, list[tuple[tuple, int, Request]]] = {}
        for entry in sorted(self.waiting):
            groups.setdefault(entry[2].group, []).append(entry)
        heads = [(self._fair_key(members[0][0], running[g]), members[0][1], g, 0) for g, members in groups.items()]
        heapq.heapify(heads)
        while heads:
            _, _, g, i = heapq.heappop(heads)
            members = groups[g]
            yield members[i]
            if members[i][2].status == RequestStatus.RUNNING:
                running[g] += 1
            if i + 1 < len(members):
                nxt = members[i + 1]
                heapq.heappush(heads, (self._fair_key(nxt[0], running[g]), nxt[1], g, i + 1))

    def _share_slots(self) -> None:
        """While every slot is taken, the first ready request of a waiting group with c requests running takes a
        slot from a group of its priority with c + 2 or more: that group's latest running sibling is preempted
        (recomputed later, its blocks left to the prefix cache), and this step's admission takes the newcomer
        first. A single newcomer gets a slot at once, and two large groups converge to equal shares without
        trading slots back and forth (each move narrows their gap). Groups of one are never preempted here, and
        no priority takes a slot from another (as before: priorities order the queue, they do not preempt).
        Expects `running` sorted (`_sort_running`): the last of a priority is its largest group's latest."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        running = Counter(r.group for r in self.running)
        heads: dict[str, tuple[tuple, int, Request]] = {}
        for entry in sorted(self.waiting):
            req = entry[2]
            if req.group not in heads and req.is_ready() and grammar_ready(req.grammar):
                heads[req.group] = entry
        victims: dict[int, list[Request]] = {}  # per priority, the worst last
        for req in self.running:
            victims.setdefault(self._key(req)[0], []).append(req)
        for entry in sorted(heads.values(), key=lambda e: (self._fair_key(e[0], running[e[2].group]), e[1])):
            group, same_priority = entry[2].group, victims.get(entry[0][0])
            # a gap of one at most: a move would only swap the two groups' shares (nor will a later candidate
            # of this priority gain: its group runs as many or more)
            if not same_priority or running[group] + 2 > running[same_priority[-1].group]:
                victims.pop(entry[0][0], None)
                continue
            victim = same_priority.pop()
            self._preempt(victim)
            running[victim.group] -= 1
            running[group] += 1

    def _trim_drafts(self, budget: int) -> None:
        """Keeps, per running request, the drafts the adaptive budget expects to pay off this step."""
        offered = {r.request_id: len(r.spec_token_ids) for r in self.running if r.spec_token_ids}
        if not offered:
            return
        base = sum(self._prefill_chunk(self._num_new_tokens(r, budget), r.num_computed_tokens, budget)
                   for r in self.running)
        room = self.config.max_num_seqs - len(self.running)  # only these waiting prompts may join this step
        base += sum(e[2].num_tokens for e in heapq.nsmallest(max(0, room), self.waiting))  # capped below
        contexts = {r.request_id: r.num_computed_tokens for r in self.running}
        confidences = {r.request_id: r.spec_confidences for r in self.running if r.spec_confidences}
        chosen = self.spec_budget.choose(offered, max(1, min(base, budget)), contexts, sum(contexts.values()),
                                         confidences)
        for r in self.running:
            if r.request_id in chosen:
                r.spec_token_ids = r.spec_token_ids[:chosen[r.request_id]]

    def _drafts_that_fit(self, req: Request, n: int, budget: int) -> list[int]:
        """A decode's drafts, cut to the step budget, the context length and its remaining max_tokens."""
        if not req.spec_token_ids or n != 1:
            return []
        # Placeholders count as outputs: under async scheduling they bound what the step in flight emits.
        room = min(budget - 1, self.config.max_model_len - req.num_computed_tokens - 1,
                   req.sampling_params.max_tokens - req.num_output_tokens - req.num_output_placeholders - 1)
        return req.spec_token_ids[:max(0, room)]

    def _cost(self, n: int, context: int) -> int:
        """What n tokens computed after `context` ones count against the step budget: n * (1 + context / K)
        for a prompt chunk with cost-based chunking on (K = prefill_cost_context; see config.py for how it
        was measured), else n. A single token (a decode) counts 1: its attention is a memory-bound kernel
        whose total the KV cache's size bounds."""
        k = self.config.prefill_cost_context
        return n if not k or n <= 1 else -(-n * (k + context) // k)

    def _prefill_chunk(self, n: int, context: int, budget: int) -> int:
        """The most of a prompt's next n tokens (n <= budget) whose cost (`_cost`) fits the budget and
        long_prefill_token_threshold; at least one, so a prompt progresses in every step that has budget."""
        if n <= 1:
            return n
        threshold = self.config.long_prefill_token_threshold
        limit = min(budget, threshold) if threshold else budget
        k = self.config.prefill_cost_context
        return max(1, min(n, limit * k // (k + context) if k else limit))

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        if req.num_output_placeholders and req.num_output_tokens + req.num_output_placeholders >= \
                req.sampling_params.max_tokens:
            return 0  # the token in flight is its last one
        n = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
        return max(0, min(n, budget, self.config.max_model_len - req.num_computed_tokens))

    def _append_tokens(self, req: Request, new_ids: list[int]) -> list[int]:
        kept = []
        for token in new_ids:
            req.output_token_ids.append(token)
            kept.append(token)
            status = self._check_stop(req, token)
            if status is not None:
                req.status = status
                break
        return kept

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a token still in flight is dropped; recomputation samples it again
        req.spec_token_ids, req.spec_confidences = [], []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_in_runner(req)
        self._enqueue(req)

    def _key(self, req: Request) -> tuple[int, float]:
        return req.sort_key() if self.config.policy == "priority" else (0, req.arrival_time)

    @staticmethod
    def _fair_key(key: tuple[int, float], rank: int) -> tuple[int, int, float]:
        """A request's rank among others: its priority (`_key`'s first part), then how many of its group come
        before it (running ones, for a waiting request), then its arrival."""
        return key[0], rank, key[1]

    def _sort_running(self) -> None:
        """Best first by `_fair_key`, each request ranked by its place in its group's queue order."""
        self.running.sort(key=lambda r: (self._key(r), self._order[r.request_id]))
        ranks, seen = {}, Counter()
        for req in self.running:
            ranks[req] = seen[req.group]
            seen[req.group] += 1
        self.running.sort(key=lambda r: self._fair_key(self._key(r), ranks[r]))

    def _enqueue(self, req: Request) -> None:
        heapq.heappush(self.waiting, (self._key(req), self._order[req.request_id], req))

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._free(req)

    def _free(self, req: Request) -> None:
        self._deferred.discard(req.request_id)
        if req in self.running:
            self.running.remove(req)
        self.suspects.pop(req.request_id, None)
        self._order.pop(req.request_id, None)
        if self.spec_budget is not None:
            self.spec_budget.forget(req.request_id)
        if self.connector is not None:
            self.connector.request_finished(req, self.kv.block_ids(req.request_id))
            self._external.pop(req.request_id, None)
        self.kv.free(req)
        self._forget_in_runner(req)
        self.requests.pop(req.request_id, None)

    def _forget_in_runner(self, req: Request) -> None:
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self._stale.add(req.request_id)

    def _book(self, req: Request, n: int, num_drafts: int) -> bool:
        """Counts a scheduled step's tokens as computed (its drafts as accepted); one that reaches the end
        emits up to 1 + num_drafts tokens, and under async drafting leaves placeholder drafts. True: the
        step samples."""
        req.num_computed_tokens += n
        if req.num_computed_tokens < req.num_tokens + req.num_output_placeholders:
            return False
        req.num_output_placeholders += 1 + num_drafts
        if self.async_drafts:
            req.spec_token_ids = [PLACEHOLDER_DRAFT] * self.async_drafts
        return True
