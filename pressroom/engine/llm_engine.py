"""The engine's front: prompts in, RequestOutputs out.

It tokenizes and validates a request (before touching any state, so a bad request never disturbs the
others), hands its sequences to the engine core (engine/core.py: scheduler and model runner) as token
ids, and turns the core's per-step token ids into cumulative RequestOutputs: incremental
detokenization, stop strings, logprobs, n > 1 siblings. The core is in this process (`LLM`), or in one
of its own behind a client with the same methods (engine/core_client.py, under the server).

A fault while handling one request's outputs (any exception type, a tokenizer's panic included) ends that
request alone: its samples finish with finish_reason "error" (vLLM's), the core drops them, and the other
requests go on. A request that fails while being added leaves nothing behind.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pressroom.config import EngineArgs, EngineConfig, ModelConfig, default_of, read_checkpoint_facts
from pressroom.core.media_schedule import check_runs_fit
from pressroom.core.outputs import EngineCoreOutput, TopLogprobs
from pressroom.core.request import RequestStatus
from pressroom.core.scheduler import SchedulerStats
from pressroom.core.structured_outputs import check as check_structured_outputs
from pressroom.distributed.kv_transfer.base import check_kv_transfer_params, kv_transfer_params
from pressroom.engine.core import CoreInfo, CoreOutputs, CoreRequest, EngineCore
from pressroom.engine.detokenizer import IncrementalDetokenizer, StopStrings, fast_decoder
from pressroom.engine.inputs import media_items
from pressroom.lora.adapter import check_adapter_files
from pressroom.lora.request import LoRARequest
from pressroom.model.loader import (
    download_hub_model,
    is_hub_repo_id,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)
from pressroom.model.pooling import model_pooling_defaults
from pressroom.multimodal.inputs import MediaItem
from pressroom.multimodal.processor import ImageProcessor, MediaProcessor
from pressroom.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pressroom.platforms import set_up_process
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    bad_words_token_ids,
    truncated_prompt,
)

logger = logging.getLogger("pressroom")

MAX_LOGPROBS = default_of(ModelConfig, "max_logprobs")  # beam search's bound: each step asks 2 * beams
PromptType = str | list[int] | dict
ERROR = "error"  # the finish reason of a request whose output handling failed (vLLM's FinishReason.ERROR)
_NOT_CAUGHT = (KeyboardInterrupt, SystemExit)  # a per-request fault is any other exception (pyo3 panics too)


def start_config(args: EngineArgs) -> EngineConfig:
    """An engine's start: what resolution needs of the checkpoint is read, the configs are resolved, and this
    process is set up (torch's threads; on the CPU, the line saying which path runs)."""
    args = _with_local_model(args)
    config = args.create_engine_config(read_checkpoint_facts(args.model))
    set_up_process(config.device, config.num_threads, str(args.dtype), config.model.dtype)
    return config


def _with_local_model(args: EngineArgs) -> EngineArgs:
    """A hub repository id (`org/name`) resolved to its snapshot in the HF cache, the model and its tokenizer."""
    if args.model and is_hub_repo_id(args.model):
        args = replace(args, model=download_hub_model(args.model, args.revision, args.download_dir))
    if args.tokenizer and is_hub_repo_id(args.tokenizer):
        args = replace(args, tokenizer=download_hub_model(args.tokenizer, args.tokenizer_revision or args.revision,
                                                          args.download_dir))
    return args


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
    num_preemptions: int = 0


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
    pooling: PoolingParams | None = None  # a pooling request (resolved), which ends with `pooled`
    pooled: list[float] | None = None
    kv_transfer_params: dict | None = None  # a KV producer's, for the request's final output
    num_external_tokens: int = 0  # prompt tokens a KV connector loaded from another engine

    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, make_core: Callable[[EngineConfig, int | None], Any] = EngineCore) -> None:
        """`make_core(config, eos_token_id)`: the engine core, built here in this process by default, or a
        client of one running elsewhere (engine/core_client.py). The tokenizer is loaded here, once: the
        core only needs its end-of-sequence id."""
        if config.parallel.data_parallel_size > 1 and make_core is EngineCore:
            raise ValueError("data_parallel_size > 1 runs behind the server (pressroom serve --data-parallel-size "
                             "N); the offline LLM drives one engine core.")
        self.config = config
        path = resolve_model_path(config.model.model)
        if getattr(make_core, "EOS_FUTURE", False):
            # A core process starts first and is sent the end-of-sequence id later: its imports and this
            # process's config and tokenizer loads (a second or two each) overlap.
            with ThreadPoolExecutor(1, thread_name_prefix="pressroom-tokenizer") as pool:
                eos = pool.submit(self._load_config_and_tokenizer, path)
                core = make_core(config, eos)
            eos.result()
        else:
            core = make_core(config, self._load_config_and_tokenizer(path))
        self.core = core
        info: CoreInfo = core.info
        self.max_model_len, self.vocab_size, self.eos_token_id = info.max_model_len, info.vocab_size, info.eos_token_id
        self.model_path, self.startup_seconds = info.model_path, info.startup_seconds
        self.startup_phases = info.startup_phases
        self.kv_fingerprint = info.kv_fingerprint  # a KV connector's model fingerprint: a decode's params must match
        self.decode = fast_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, tuple[_Parent, _Child]] = {}
        self._ids = itertools.count()
        self.pooling_defaults = self._pooling_defaults(path) if config.model.runner == "pooling" else None
        self._media_processor: MediaProcessor | None = None  # made at the first prompt with media
        logger.info("engine ready in %.1fs (%s): %s on %s, max_model_len %d", self.startup_seconds,
                    ", ".join(f"{name} {s:.1f}s" for name, s in self.startup_phases.items()), self.model_path,
                    config.device, self.max_model_len)

    def _load_config_and_tokenizer(self, path: str) -> int | None:
        """Sets hf_config and tokenizer; returns the end-of-sequence id the core needs."""
        self.hf_config = load_hf_config(path, self.config.model.hf_overrides)
        skip = self.config.model.skip_tokenizer_init
        self.tokenizer = None if skip else load_tokenizer(self.config.model.tokenizer or path)
        return _eos_token_id(self.tokenizer, self.hf_config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(start_config(args))

    # The in-process core's parts (tests and benchmarks look at them).
    @property
    def runner(self):
        return self.core.executor.driver_worker.model_runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def model(self):
        return self.core.executor.driver_worker.model

    @property
    def kv_cache(self):
        return self.core.kv_cache

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for at a position (--max-logprobs; -1 there: the vocabulary)."""
        limit = self.config.model.max_logprobs
        return self.vocab_size if limit == -1 else limit

    def shutdown(self) -> None:
        self.core.shutdown()

    def _pooling_defaults(self, path: str) -> PoolingParams:
        """The model's pooling (its sentence-transformers config, else vLLM's defaults), under --pooler-config."""
        model_defaults = model_pooling_defaults(path, self.config.model.encoder_only)
        return (self.config.model.pooler or PoolingParams()).resolved(model_defaults)

    # ---- requests ----

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, session_id: str | None = None,
                    data_parallel_rank: int | None = None, group: str | None = None,
                    lora_request: LoRARequest | None = None, mm_features: list[MediaItem] | None = None) -> None:
        """`session_id` (optional) groups requests of one conversation or user; it comes back on every
        RequestOutput of this request. It does not change scheduling. `data_parallel_rank`: the engine core
        that serves it (with data_parallel_size > 1; None: the least busy, or the one holding its prefix).
        `group`: the client's request this one is a prompt of (a list of prompts): the scheduler shares its
        slots fairly between such groups, as between the n samples of requests (None: a group of its own).
        `lora_request`: the adapter it runs with (needs enable_lora; None: the base model). `mm_features`: the
        prompt's media as `process_media` made them, its token ids already expanded (the server processes
        images on its own threads; without it, a prompt's multi_modal_data is processed here)."""
        self._check_data_parallel_rank(data_parallel_rank)
        self._check_lora(lora_request)
        if self.pooling_defaults is not None:
            raise ValueError("This model is served for pooling only (runner pooling): it answers embeddings, "
                             "/pooling, /score and /rerank, not generation. Start it with --runner generate "
                             "(a decoder) to generate.")
        params = params or SamplingParams()
        check_kv_transfer_params(kv_transfer_params(params), self.config.kv_transfer, self.config.cache.block_size,
                                 self.kv_fingerprint)
        salt = _cache_salt(prompt)
        text, token_ids, media = self._prompt_tokens(prompt, params, mm_features)
        params = self._core_params(request_id, token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        stops = StopStrings(params.stop_strings)  # one automaton for the n samples
        children = [_Child(i, self._detokenizer(token_ids, params, stops), f"{next(self._ids)}",
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
                    for i in range(params.n)]
        parent = _Parent(request_id, text, token_ids, params, children, RequestMetrics(arrival),
                         prompt_logprobs=[] if params.prompt_logprobs is not None else None,
                         session_id=session_id)
        self.parents[request_id] = parent
        try:
            lead = None
            for child in children:
                # Sample i's seed is seed + i, wrapped to 64 bits (what the core's messages carry; the sampler
                # keys its noise by the seed modulo 2^63, so the wrap draws the same tokens).
                child_params = params if params.n == 1 else params.clone(
                    n=1, seed=None if params.seed is None else (params.seed + child.index) % (1 << 64))
                self.child_to_parent[child.request_id] = (parent, child)
                self.core.add_request(CoreRequest(child.request_id, token_ids, child_params, arrival, priority, lead,
                                                  data_parallel_rank=data_parallel_rank, group=group,
                                                  lora=lora_request, cache_salt=salt, mm_features=media))
                lead = lead or child.request_id
        except BaseException:
            self.abort_request(request_id)  # the siblings already handed to the core go too
            raise

    def _prompt_tokens(self, prompt: PromptType, params: SamplingParams, mm_features: list[MediaItem] | None
                       ) -> tuple[str | None, list[int], list[MediaItem] | None]:
        """(text, token ids, media) of a prompt: tokenized, its images' placeholders expanded (or `mm_features`
        checked against them), truncated as `truncate_prompt_tokens` asks."""
        text, token_ids = self.tokenize_prompt(prompt)
        if self.encoder_inputs() is not None:  # Whisper: its clip goes to the encoder, the prompt to the decoder
            return text, token_ids, self.encoder_inputs().prompt_media(prompt, token_ids, mm_features)
        if mm_features is None:
            token_ids, media = self.process_media(prompt, token_ids)
        else:
            media = self._checked_media(prompt, token_ids, mm_features)
        check_runs_fit(media, self.config.scheduler.max_num_batched_tokens)  # an image a step can never hold whole
        kept = truncated_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(kept) < len(token_ids):
            if media:
                raise ValueError("truncate_prompt_tokens would cut a prompt with images; shorten its text instead.")
            text, token_ids = None, kept  # the text no longer says what the model reads
        return text, token_ids, media

    def _core_params(self, request_id: str, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The params as the core takes them: checked, with think markers and bad words resolved, max_tokens
        bounded by the context, a JSON schema as its text."""
        params = self._with_bad_words(self._with_think_markers(params))
        self._validate(request_id, token_ids, params)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(token_ids))
        if params.structured_outputs is not None and isinstance(params.structured_outputs.json, dict):
            # to the core as its text: msgpack cannot carry every JSON number (integers past 64 bits)
            schema = json.dumps(params.structured_outputs.json)
            params = params.clone(structured_outputs=replace(params.structured_outputs, json=schema))
        return params

    def _check_lora(self, lora: LoRARequest | None) -> None:
        """A request for an adapter on an engine without LoRA, or an adapter whose files are not there: a
        ValueError now (the adapter's tensors are checked against the model when the worker first reads it)."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest; got {type(lora).__name__}.")
        if self.config.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but the engine was started without LoRA; "
                             "start it with enable_lora=True (--enable-lora).")
        check_adapter_files(lora.lora_name, lora.lora_path, self.config.lora.max_lora_rank)

    def _check_data_parallel_rank(self, rank: int | None) -> None:
        size = self.config.parallel.data_parallel_size
        if rank is not None and (type(rank) is not int or not 0 <= rank < size):
            raise ValueError(f"data_parallel_rank must be an engine core's index, 0 to {size - 1}; got {rank!r}.")

    def add_pooling_request(self, request_id: str, prompt: PromptType, pooling: PoolingParams | None = None,
                            priority: int = 0, arrival_time: float | None = None) -> None:
        """A prefill-only request that finishes with its prompt's pooled vector (a PoolingRequestOutput)."""
        if self.pooling_defaults is None:
            raise ValueError("This model does not pool: it was started to generate. Start it with --runner pooling "
                             "(or --task embed) for embeddings, /pooling, /score and /rerank.")
        resolved = (pooling or PoolingParams()).resolved(self.pooling_defaults)
        if media_items(prompt):
            raise ValueError("multi_modal_data is not supported for pooling requests.")
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_pooling(request_id, token_ids, resolved)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        child = _Child(0, None, f"{next(self._ids)}")
        parent = _Parent(request_id, text, token_ids, params, [child], RequestMetrics(arrival), pooling=resolved)
        self.parents[request_id] = parent
        self.child_to_parent[child.request_id] = (parent, child)
        try:
            self.core.add_request(CoreRequest(child.request_id, token_ids, params, arrival, priority, pooling=resolved))
        except BaseException:
            self.abort_request(request_id)
            raise

    def _validate_pooling(self, request_id: str, token_ids: list[int], pooling: PoolingParams) -> None:
        if request_id in self.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if not token_ids:
            raise ValueError("The input is empty; give at least one token.")
        limit = self.max_model_len
        if self.config.model.encoder_only:  # computed whole, in one step
            limit = min(limit, self.config.scheduler.max_num_batched_tokens)
        if len(token_ids) > limit:
            raise ValueError(f"The input is {len(token_ids)} tokens long; this model pools at most {limit} "
                             "(max_model_len, and for an encoder max_num_batched_tokens); shorten it.")
        if any(type(t) is not int or not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"Input token ids must lie in [0, {self.vocab_size}) and be integers.")
        width = self.hf_config.hidden_size
        if pooling.dimensions is not None and pooling.dimensions > width:
            raise ValueError(f"dimensions={pooling.dimensions} exceeds this model's embedding size of {width}.")

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

    def process_media(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], list[MediaItem] | None]:
        """A prompt's multi_modal_data: its placeholders expanded in `token_ids` and its items (None: no media).
        The image processor runs here, on the caller's thread (the server calls this off its event loop)."""
        media = media_items(prompt)
        if not media:
            return token_ids, None
        token_ids, items = self.media_processor().process(token_ids, media)
        return token_ids, items or None

    def _checked_media(self, prompt: PromptType, token_ids: list[int], items: list[MediaItem]
                       ) -> list[MediaItem] | None:
        """Media processed beforehand: each item's placeholder run must lie in the prompt, on image tokens."""
        if media_items(prompt):
            raise ValueError("Give multi_modal_data or mm_features (already processed), not both.")
        if not items:
            return None
        processor = self.media_processor()
        for item in items:
            if not isinstance(item, MediaItem) or item.modality not in processor.layouts or item.offset < 0 \
                    or item.end > len(token_ids) \
                    or any(t != processor.token_id(item.modality) for t in token_ids[item.offset:item.end]):
                raise ValueError("mm_features do not match the prompt's placeholder runs.")
        return list(items)

    def media_processor(self) -> MediaProcessor:
        """The model's media processors (a ValueError naming multi_modal_data for a text-only model)."""
        if self._media_processor is None:
            self._media_processor = MediaProcessor(resolve_model_path(self.config.model.model), self.hf_config,
                                                   limits=self.config.model.limit_mm_per_prompt,
                                                   tokenizer=self.tokenizer)
        return self._media_processor

    def image_processor(self) -> ImageProcessor:
        """The model's image processor (a ValueError for a model that takes no images)."""
        return self.media_processor().processor("image")

    def encoder_inputs(self):
        """An encoder-decoder model's (Whisper's) inputs: its clips into media items, its decoder prompts; None for a
        decoder-only model."""
        if not getattr(self.hf_config, "is_encoder_decoder", False):
            return None
        if getattr(self, "_encoder_inputs", None) is None:
            from pressroom.model.models.whisper import WhisperInputs
            self._encoder_inputs = WhisperInputs(resolve_model_path(self.config.model.model), self.tokenizer)
        return self._encoder_inputs

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

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """bad_words tokenized, as vLLM does (sampling_params.bad_words_token_ids), for the sampler."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this engine was started with skip_tokenizer_init.")
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        return params.clone(bad_words_token_ids=bad_words_token_ids(params.bad_words, encode))

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
        limit = self.max_logprobs
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is not None and value > limit:  # vLLM's words (its --max-logprobs)
                raise ValueError(f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limit} "
                                 "(--max-logprobs).")
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {self.vocab_size}).")
        if any(not 0 <= t < self.vocab_size for t in params.allowed_token_ids or []):
            raise ValueError(f"allowed_token_ids must lie in [0, {self.vocab_size}).")
        if any(not 0 <= t < self.vocab_size for word in params.bad_words_token_ids or [] for t in word):
            raise ValueError(f"bad_words must tokenize to ids in [0, {self.vocab_size}).")
        for name in ("think_start_token_ids", "think_end_token_ids"):
            if any(not 0 <= t < self.vocab_size for t in getattr(params, name) or []):
                raise ValueError(f"{name} must lie in [0, {self.vocab_size}).")
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params.structured_outputs)

    def _validate_structured_outputs(self, structured: StructuredOutputsParams) -> None:
        """Parses the schema, regex or grammar here (no tokenizer needed), so a bad one is a ValueError before
        anything is queued; the core compiles it against the tokenizer."""
        if self.tokenizer is None:
            raise ValueError("Structured outputs need a tokenizer; this engine was started with skip_tokenizer_init.")
        check_structured_outputs(structured)

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams,
                     stops: StopStrings) -> IncrementalDetokenizer | None:
        if not params.detokenize or self.decode is None:
            return None
        return IncrementalDetokenizer(self.decode, prompt_ids, params.skip_special_tokens, stops,
                                      params.include_stop_str_in_output, params.min_tokens)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            child_ids = [c.request_id for c in parent.children]
            self.core.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for cid in child_ids:
                self.child_to_parent.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or an in-process core's KV offload copies not done (a core in its own
        process steps until they are, on its own loop)."""
        return bool(self.parents) or isinstance(self.core, EngineCore) and self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Runs one step of the in-process core and reports every request that moved."""
        return self.process_outputs(self.core.step())

    def process_outputs(self, step: CoreOutputs) -> list[RequestOutput]:
        """RequestOutputs of the requests that moved in `step`. A request whose handling raises (here: its
        detokenization, stop strings, logprobs or output assembly) is reported finished with finish_reason
        "error" and dropped from the core; the others are unaffected."""
        now = time.monotonic()
        for req_id in step.scheduled:  # the core's clock when it scheduled them (not this step's return)
            entry = self.child_to_parent.get(req_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = step.scheduled_time
                entry[0].metrics.engine_index = step.engine_index
        moved: dict[str, _Parent] = {}
        outputs = []
        for out in step.outputs:
            entry = self.child_to_parent.get(out.req_id)  # None once its request finished, was aborted or failed
            if entry is None:
                continue
            try:
                self._absorb(entry[0], entry[1], out, now)
            except _NOT_CAUGHT:
                raise
            except BaseException as e:  # noqa: BLE001 — one request's fault, whatever its type, is its own
                moved.pop(entry[0].request_id, None)
                outputs.append(self._fail(entry[0], e, now))
                continue
            moved[entry[0].request_id] = entry[0]
        for parent in moved.values():
            try:
                finished = parent.finished()
                if finished or parent.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    outputs.append(self._finish_or_report(parent, finished, now))
            except _NOT_CAUGHT:
                raise
            except BaseException as e:  # noqa: BLE001
                outputs.append(self._fail(parent, e, now))
        return outputs

    def _fail(self, parent: _Parent, error: BaseException, now: float) -> RequestOutput:
        """Ends a request whose output handling raised: every sample finishes with "error", the core drops
        the unfinished ones, and its final RequestOutput carries what could still be assembled."""
        logger.error("request %s failed while its output was processed; it is ended with finish_reason "
                     "\"error\" (other requests go on)", parent.request_id, exc_info=error)
        unfinished = [c.request_id for c in parent.children if c.finish_reason is None]
        for child in parent.children:
            child.finish_reason, child.stop_reason = ERROR, None
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_to_parent.pop(child.request_id, None)
        parent.metrics.finished_time = now
        if unfinished:
            self.core.finish_requests(unfinished, RequestStatus.FINISHED_ABORTED)
        try:
            return self._request_output(parent, True)
        except _NOT_CAUGHT:
            raise
        except BaseException:  # noqa: BLE001 — the fault was in the assembly itself: report no text
            outputs = [CompletionOutput(c.index, "", list(c.token_ids), finish_reason=ERROR) for c in parent.children]
            return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, True,
                                 None, parent.num_cached_tokens, parent.metrics, parent.session_id)

    def _absorb(self, parent: _Parent, child: _Child, out: EngineCoreOutput, now: float) -> None:
        if out.pooled is not None:
            parent.pooled = out.pooled
        if out.prompt_logprobs is not None and len(parent.prompt_logprobs) < len(parent.prompt_token_ids):
            parent.prompt_logprobs.extend(self._position_logprobs(lp) for lp in out.prompt_logprobs)
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            parent.kv_transfer_params = out.kv_transfer_params
        parent.num_external_tokens = max(parent.num_external_tokens, out.num_external_tokens)
        if out.num_preemptions > child.num_preemptions:
            child.num_preemptions = out.num_preemptions
            parent.metrics.num_preemptions = sum(c.num_preemptions for c in parent.children)
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
        self.core.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED)

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

    def _request_output(self, parent: _Parent, finished: bool) -> RequestOutput | PoolingRequestOutput:
        if parent.pooling is not None:
            reason = parent.children[0].finish_reason
            return PoolingRequestOutput(parent.request_id, parent.prompt_token_ids, PoolingOutput(parent.pooled or []),
                                        finished, parent.metrics, reason)
        outputs = [CompletionOutput(c.index, c.detok.visible_text(c.finish_reason is not None) if c.detok else "",
                                    list(c.token_ids), c.cumulative_logprob,
                                    list(c.logprobs) if c.logprobs is not None else None,
                                    c.finish_reason, c.stop_reason)
                   for c in parent.children]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.prompt_logprobs, parent.num_cached_tokens, parent.metrics, parent.session_id,
                             parent.kv_transfer_params, parent.num_external_tokens)


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's TextPrompt / TokensPrompt key): a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError("cache_salt must be a non-empty string if provided.")
    return salt


def _eos_token_id(tokenizer, hf_config) -> int | None:
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos
