"""What the OpenAI handlers share: the `OpenAIServing` base (body parsing under a size limit, the model
check, prompt work on the Preprocessor, sampling params, adding requests, SSE), a request's routing
(priority, session, data-parallel rank), the pieces of responses, the access-log record a handler fills in,
and `OpenAIServingUtility` with the small endpoints (health, version, metrics, models, tokenize, detokenize).
Completions and chat live in serving_completion.py and serving_chat.py; the plumbing of output streams in
streams.py.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import json
import logging
import re
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

import pressroom
from pressroom.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pressroom.engine.sampling_defaults import SamplingDefaults
from pressroom.entrypoints.openai.chat_template import BIG_JOB_CHARS, MESSAGES_ON_LOOP, Preprocessor, encode_within
from pressroom.entrypoints.openai.errors import APIError, error_response
from pressroom.entrypoints.openai.limits import AdmissionLimits, OverLimit, RequestCost, judge
from pressroom.entrypoints.openai.lora import RUNTIME_UPDATING_ENV, Adapters, runtime_updating_allowed
from pressroom.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pressroom.entrypoints.openai.metrics import ServerMetrics
from pressroom.entrypoints.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    MEDIA_PART_MODALITIES,
    PRIORITY_MAX,
    PRIORITY_MIN,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    OpenAIModel,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UsageInfo,
)
from pressroom.entrypoints.openai.streams import FAILED_MESSAGE
from pressroom.lora.adapter import check_adapter_files
from pressroom.lora.request import LoRARequest
from pressroom.multimodal.chat import TEMPLATE_PARTS, template_part
from pressroom.multimodal.processor import supported_modalities
from pressroom.outputs import PositionLogprobs, RequestOutput
from pressroom.sampling_params import SamplingParams

logger = logging.getLogger("pressroom")

MAX_SESSION_ID_CHARS = 256
PRIORITY_HEADERS = ("X-Vllm-Priority", "X-Priority")  # vLLM's name first; X-Priority is pressroom's older alias
ACCESS_RECORD_KEY = "pressroom.access"  # where the access-log middleware puts the record in the ASGI scope
SSE_CHUNKS_PER_TURN = 16  # a stream's chunks sent between two turns of the event loop (/health, other streams)
RESPONSE_VALUES_ON_LOOP = 1 << 16  # a whole response holding more values than this is built on a thread

Body = TypeVar("Body", bound=OpenAIModel)
T = TypeVar("T")


@dataclass(slots=True)
class ServerLoad:
    """vLLM's server load (--enable-server-load-tracking): the requests in flight on `paths`, the routes that run the
    model, counted until their response (a stream's last event) is sent; GET /load reports it."""
    paths: frozenset[str]
    in_flight: int = 0


@dataclass
class AccessRecord:
    """What a handler learns about its request for the access-log line (None: not applicable, logged `-`)."""
    request_id: str | None = None
    session_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def access_record(request: Request) -> AccessRecord:
    """The request's record for the access log; a throwaway one when request logging is off."""
    return request.scope.get(ACCESS_RECORD_KEY) or AccessRecord()


class EventStream(StreamingResponse):
    """An SSE response that stops (cancelling its body, hence aborting the request) on disconnect,
    whichever ASGI version the server speaks."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                group.cancel_scope.cancel()
            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


class OpenAIServing:
    """The base of the handlers: the engine, the served model names, the server's metrics (one
    ServerMetrics shared by every handler, so that all requests count in it) and the Preprocessor (chat
    templates and tokenizer calls, off the engine and off the event loop), and the admission limits that every
    request's cost is judged by."""

    def __init__(self, engine: AsyncLLMEngine, names: list[str], stats: ServerMetrics,
                 max_request_bytes: int, preprocessor: Preprocessor, limits: AdmissionLimits) -> None:
        self.engine, self.names, self.stats = engine, names, stats
        self.max_request_bytes, self.preprocessor, self.limits = max_request_bytes, preprocessor, limits
        self.adapters: Adapters | None = None  # --enable-lora: the LoRA adapters served by name (set by build_app)
        # a request's unset sampling fields: the checkpoint's generation_config.json (set by build_app)
        self.sampling_defaults = SamplingDefaults()
        self.prompt_tokens_details = False  # usage's cached_tokens (--enable-prompt-tokens-details; set by build_app)
        self.force_include_usage = False  # every stream ends with usage (--enable-force-include-usage; build_app)
        self.tokens_as_ids = False  # logprobs' tokens as "token_id:<id>" (--return-tokens-as-token-ids; build_app)

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        raw = await self._read_body(request)
        if len(raw) > BIG_JOB_CHARS:  # JSON and pydantic take 10 to 25 ms a MB: a big body's, off the event loop
            measure = functools.partial(_measured, raw, model, self._admit)
            body, cost = await self._run(functools.partial(_collector_paused, measure), len(raw))
        else:
            body, cost = _measured(raw, model, self._admit)
        self._admit(cost)  # what the body asks for, before any prompt work
        return body

    def _admit(self, cost: RequestCost | None) -> None:
        """A 400 naming the field, the limit and its flag when `cost` is over an admission limit."""
        try:
            if cost is not None:
                judge(cost, self.limits)
        except OverLimit as e:
            raise APIError(400, str(e), param=e.param, code="admission_limit_exceeded") from None

    async def _read_body(self, request: Request) -> bytes:
        """The body, held to --max-request-bytes; a client gone mid-upload is a 499, not a server error."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise APIError(413, f"The request body exceeds {self.max_request_bytes} bytes.", code="request_too_large")
        body = bytearray()
        try:
            async for part in request.stream():
                body += part
                if len(body) > self.max_request_bytes:
                    raise APIError(413, f"The request body exceeds {self.max_request_bytes} bytes.",
                                   code="request_too_large")
        except ClientDisconnect:
            raise APIError(499, "The client closed the connection before sending the whole body.") from None
        return bytes(body)

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for a name the server does not serve."""
        if model is None or model in self.names:
            return None
        adapter = self.adapters.get(model) if self.adapters is not None else None
        if adapter is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return adapter

    async def _run(self, fn: Callable[[], T], chars: int = 0) -> T:
        """Runs tokenizer work on the Preprocessor's threads (`chars`: its input's size, which picks the lane); a
        ValueError (or TypeError, ...) is the client's."""
        return await self.preprocessor.run(fn, chars)

    async def _prompt_ids(self, prompts: list[str | list[int]], param: str) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt as the engine reads it (a text tokenized on the Preprocessor's
        threads, BOS per the model); a text far past max_model_len is a 400 for length found from a prefix of it."""
        engine, limit = self.engine, self.engine.max_model_len

        def encode(text: str) -> list[int]:
            return engine.tokenize_prompt(text)[1]

        def tokenized() -> list[tuple[str | None, list[int]]]:
            return [(p, encode_within(encode, p, limit, param)) if isinstance(p, str) else engine.tokenize_prompt(p)
                    for p in prompts]
        return await self._run(tokenized, sum(len(p) for p in prompts if isinstance(p, str)))

    async def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final: bool,
                        kwargs: dict | None, request_template: str | None,
                        tools: list[dict] | None = None, max_tokens: int | None = None) -> list[int]:
        """`max_tokens`: a conversation far past it is a 400 for length (None: none is, as /tokenize counts any)."""
        if self.engine.tokenizer is None:
            raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init); chat needs one.")
        if len(messages) <= MESSAGES_ON_LOOP:
            conversation = _message_dicts(messages)
        else:
            conversation = await self._run(functools.partial(_message_dicts, messages), BIG_JOB_CHARS + 1)
        return await self.preprocessor.chat_ids(conversation, add_generation_prompt, continue_final, kwargs,
                                                request_template, tools, max_tokens)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        return fingerprint_of(self.engine.engine.config)

    @staticmethod
    def _check_combination(req: CompletionRequest | ChatCompletionRequest) -> None:
        """A 400 naming the field where the request's fields together ask for what vLLM refuses."""
        refused = req.refused_combination()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])

    def _check_logprobs(self, params: SamplingParams) -> None:
        """A 400 naming --max-logprobs's limit (vLLM's words) for more logprobs a position than it allows."""
        limit = self.engine.engine.max_logprobs
        for value, kind, param in ((params.logprobs, "sample", "logprobs"),
                                   (params.prompt_logprobs, "prompt", "prompt_logprobs")):
            if value is not None and value > limit:
                raise APIError(400, f"Requested {kind} logprobs of {value}, which is greater than max allowed: "
                                    f"{limit} (the server's --max-logprobs).", param=param)

    def _usage(self, outputs: list[RequestOutput]) -> UsageInfo:
        """The outputs' usage; with --enable-prompt-tokens-details, the prompts' tokens read from the prefix cache."""
        usage = usage_of(outputs)
        if self.prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs))
        return usage

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                         prompt_ids: list[int], prompt_param: str) -> SamplingParams:
        """`prompt_param`: the request field that an over-long prompt came from, for the error."""
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, and the prompt has "
                                f"{len(prompt_ids)}; shorten the prompt.", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > 0 and len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                                f"{max_tokens} for the completion); reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        defaults = self.sampling_defaults
        try:
            params = defaults.fill(req).to_sampling_params(defaults.max_tokens(max_tokens, limit - len(prompt_ids)))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self._check_logprobs(params)
        return params

    async def _constrained(self, params: SamplingParams) -> SamplingParams:
        """`params` with their structured output's parse (Preprocessor.structured_outputs: a 400 over a limit)."""
        so = params.structured_outputs
        if so is None:
            return params
        return params.clone(structured_outputs=await self.preprocessor.structured_outputs(so, self.engine.vocab_size))

    async def _add_all(self, request: Request, rid: str, requests: list[tuple[dict, SamplingParams]],
                       routing: Routing, lora: LoRARequest | None = None, mm_features: list | None = None
                       ) -> list[AsyncIterator[RequestOutput]]:
        """Adds every prompt of a request, or none: a rejected one aborts those added before it. The
        request's access record gets its id, session and token counts (completion tokens as they come).
        `mm_features`: the (one) prompt's processed media."""
        record = access_record(request)
        record.request_id, record.session_id = rid, routing.session_id
        record.prompt_tokens = sum(len(prompt["prompt_token_ids"]) for prompt, _ in requests)
        record.completion_tokens = 0
        # parsed (and its compile tried) in the grammar sandbox; the engine takes the parse along, the core compiles it
        requests = [(prompt, await self._constrained(params)) for prompt, params in requests]
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, (prompt, params) in enumerate(requests):
                req_id = rid if len(requests) == 1 else f"{rid}-{i}"
                added = await self.engine.add_request(req_id, prompt, params, routing.priority, routing.session_id,
                                                      data_parallel_rank=routing.data_parallel_rank,
                                                      group=rid if len(requests) > 1 else None, lora_request=lora,
                                                      mm_features=mm_features)
                streams.append(_count_completion_tokens(self.stats.observe(added, params), record))
        except BaseException as e:
            for s in streams:
                await s.aclose()
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "service_unavailable") from None
            raise
        return streams

    def _sse(self, chunks: AsyncIterator[str]) -> StreamingResponse:
        """Server-sent events of `chunks`, then `data: [DONE]`. A stream that fails midway (the engine ended
        its request, or handling it raised) ends with an OpenAI-style error event before [DONE], never with a
        cut connection; the chunk generators first close each open choice with its finish reason. Sending a
        chunk does not wait, so one step's outputs of n=128 samples would go out in one run of the event loop:
        it is let through every SSE_CHUNKS_PER_TURN chunks."""
        async def body() -> AsyncIterator[str]:
            try:
                async with aclosing(chunks):
                    sent = 0
                    async for chunk in chunks:
                        yield chunk
                        sent += 1
                        if sent % SSE_CHUNKS_PER_TURN == 0:
                            await asyncio.sleep(0)
            except EngineDeadError as e:
                yield sse_error(str(e), "service_unavailable", 503)
            except APIError as e:
                yield sse_error(e.message, e.type, e.status)
            except Exception:  # noqa: BLE001 — a fault of this one stream: it ends with an error, the rest go on
                logger.exception("a stream's handler failed")
                yield sse_error(FAILED_MESSAGE, "internal_server_error", 500)
            yield "data: [DONE]\n\n"
        return EventStream(body(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _as_ids(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        """Whether the request's logprobs write tokens as "token_id:<id>" (its field, else the server's flag)."""
        return self.tokens_as_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids

    def _token_text(self, token: int, position: PositionLogprobs | None, as_id: bool = False) -> str:
        """A token as logprobs write it: its text, or (vLLM's return_tokens_as_token_ids) "token_id:<id>", which
        says what a token that is part of a character, or has no text of its own, was."""
        if as_id:
            return f"token_id:{token}"
        entry = position.get(token) if position else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.engine.tokenizer.decode([token])


class OpenAIServingUtility(OpenAIServing):
    """The small endpoints: health, version, metrics, the model list, tokenize and detokenize."""

    def __init__(self, *args, stall_timeout: float | None = None, **kwargs) -> None:
        """`stall_timeout`: /health turns 503 when the engine core has not been heard from (step outputs, or
        its idle heartbeat every second) for longer than this many seconds (None or 0: never)."""
        super().__init__(*args, **kwargs)
        self.stall_timeout = stall_timeout
        self.server_load: ServerLoad | None = None  # --enable-server-load-tracking's count (set by build_app)

    async def health(self) -> Response:
        """200 with an empty body while the engine serves; else a 503 whose error says why (its core died or
        was shut down, or its loop has stalled past --engine-stall-timeout)."""
        reason = self.engine.unhealthy_reason(self.stall_timeout)
        if reason is None:
            return Response(status_code=200)
        return error_response(503, reason, "service_unavailable")

    async def version(self) -> dict:
        return {"version": pressroom.__version__}

    async def load(self) -> dict:
        """vLLM's GET /load: the requests in flight on the model's routes; 0 without --enable-server-load-tracking
        (vLLM's default, whose count then stays 0 too)."""
        return {"server_load": self.server_load.in_flight if self.server_load is not None else 0}

    async def server_info(self) -> dict:
        """vLLM's dev-mode /server_info: the version and the engine's resolved configuration."""
        return {"version": pressroom.__version__, "vllm_config": repr(self.engine.engine.config)}

    async def is_sleeping(self) -> dict:
        """vLLM's dev-mode GET /is_sleeping: whether the engine is asleep (at any level)."""
        return {"is_sleeping": await self.engine.is_sleeping()}

    async def sleep(self, request: Request) -> Response:
        """vLLM's dev-mode POST /sleep?level=N&mode=M (level 1 and mode abort by default; --enable-sleep-mode):
        answered once the engine sleeps. Requests in flight end (abort) or are waited for (wait)."""
        level = request.query_params.get("level", "1")
        mode = request.query_params.get("mode", "abort")
        if not level.strip().lstrip("-").isdigit():
            raise APIError(400, f"level must be an integer (0, 1 or 2); got {level!r}.")
        logger.info("sleeping at level %s (mode %s)", level, mode)
        await self._sleep_call(self.engine.sleep(int(level), mode))
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        """vLLM's dev-mode POST /wake_up[?tags=weights&tags=kv_cache] (no tags: all); answered once awake."""
        tags = request.query_params.getlist("tags") or None
        logger.info("waking up the engine with tags: %s", tags)
        await self._sleep_call(self.engine.wake_up(tags))
        return Response(status_code=200)

    async def _sleep_call(self, call) -> None:
        try:
            await call
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None

    async def reset_prefix_cache(self) -> Response:
        """vLLM's dev-mode POST /reset_prefix_cache: every engine core forgets its cached prefixes (its query
        parameters, which ask for running requests' or an external cache's reset, are not read)."""
        logger.info("resetting the prefix cache")
        try:
            await self.engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return Response(status_code=200)

    async def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration as its
        tokenizer_config.json has it (special tokens, model_max_length), its class, and the chat template the
        server renders with."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init).")
        return tokenizer_config(tokenizer, self.preprocessor.chat_template, self.engine.max_model_len)

    async def read_body_once(self, request: Request) -> bytes:
        """The body, held to --max-request-bytes, kept on the request so that a handler it is passed to reads it
        again (SageMaker's /invocations dispatches on its fields)."""
        raw = await self._read_body(request)
        request._body = raw  # Starlette's cache: request.stream() yields it from here on
        return raw

    async def metrics(self) -> Response:
        try:
            stats = await self.engine.engine_stats()
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return Response(self.stats.render(stats), media_type=METRICS_CONTENT_TYPE)

    async def models(self) -> dict:
        # root: the served name, as vLLM shows it for a model without a separate base; never a filesystem path
        modalities = ["text", *sorted(supported_modalities(self.engine.engine.hf_config))]
        cards = [ModelCard(id=name, root=name, max_model_len=self.engine.max_model_len, input_modalities=modalities)
                 for name in self.names]
        for adapter in (self.adapters.by_name.values() if self.adapters is not None else ()):
            cards.append(ModelCard(id=adapter.lora_name, root=adapter.lora_path, parent=adapter.base_model_name,
                                   max_model_len=self.engine.max_model_len, input_modalities=modalities))
        return ModelList(data=cards).model_dump()

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's run-time adapter loading: a 404 unless VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, a 400 for a
        server without --enable-lora, a name in use, or files that are no adapter it can serve."""
        self._check_runtime_lora_updating()
        req = await self._parse(request, LoadLoRAAdapterRequest)
        if req.lora_name in self.names:
            raise APIError(400, f"`{req.lora_name}` is the base model's name.", param="lora_name")
        config = self.engine.engine.config.lora
        try:
            check_adapter_files(req.lora_name, req.lora_path, config.max_lora_rank)
            self.adapters.add(req.lora_name, req.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        self._check_runtime_lora_updating()
        req = await self._parse(request, UnloadLoRAAdapterRequest)
        if self.adapters.remove(req.lora_name) is None:
            raise APIError(404, f"The LoRA adapter `{req.lora_name}` is not loaded.", param="lora_name",
                           code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    def _check_runtime_lora_updating(self) -> None:
        if not runtime_updating_allowed():
            raise APIError(404, f"Run-time LoRA updating is off; start the server with {RUNTIME_UPDATING_ENV}=True "
                           "to load and unload adapters.", code="not_found")
        if self.adapters is None:
            raise APIError(400, "This server was started without --enable-lora: it serves no adapters.")

    async def tokenize(self, request: Request) -> dict:
        req = await self._parse(request, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of `prompt` and `messages`.", param="prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
            ids = await self._chat_ids(req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.template_kwargs, req.chat_template, tools)
        else:
            tok = self.engine.tokenizer
            if tok is None:
                raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init).")
            ids = await self._run(lambda: list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)),
                                  len(req.prompt))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        req = await self._parse(request, DetokenizeRequest)
        self._check_model(req.model)
        vocab, tok = self.engine.vocab_size, self.engine.tokenizer
        if tok is None:
            raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init).")

        def decoded() -> str:  # a million ids take the range check a while too: on the tokenizer threads
            if any(not 0 <= t < vocab for t in req.tokens):
                raise APIError(400, f"Token ids must lie in [0, {vocab}).", param="tokens")
            return tok.decode(req.tokens)
        return {"prompt": await self._run(decoded, len(req.tokens))}


# ---- helpers of the handlers ----

# Paths on the server's disk that a tokenizer's configuration names: not the client's business.
_TOKENIZER_FILES = ("name_or_path", "vocab_file", "merges_file", "tokenizer_file")


def tokenizer_config(tokenizer: Any, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    """/tokenizer_info's body: the tokenizer's init arguments (its tokens as their text), its class, its
    model_max_length (the served context where its configuration names none) and the chat template in use."""
    config = {key: _plain(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _TOKENIZER_FILES}
    config["tokenizer_class"] = type(tokenizer).__name__
    config.setdefault("model_max_length", max_model_len)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _plain(value: Any) -> Any:
    """A configuration value as JSON: an added token as its text, containers item by item, other objects as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return getattr(value, "content", None) if isinstance(getattr(value, "content", None), str) else str(value)

_TOO_DEEP = "The body nests too deeply."
ABORT = "abort"  # the finish reason of a choice the engine ended early (shutdown, a dead engine): vLLM's


# JSON's \u escapes can write a UTF-16 surrogate; raw bytes cannot (json.loads refuses them when it decodes), so
# a UTF-8 body without such an escape holds no string that UTF-8 fails to encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _collector_paused(fn: Callable[[], T]) -> T:
    """fn() with the cyclic garbage collector paused: a big body's parse makes up to millions of objects, none in a
    cycle, and the passes their count set off tripled its time (300 ms for 7 MB of prompts), all of it holding the
    interpreter. (Only the big lane's one thread pauses it, so no other turns it back on early.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return fn()
    except Exception as e:  # the body its frames and its cause hold is freed here, not where the 400 is sent
        e.__context__ = None
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if enabled:
            gc.enable()


def _measured(raw: bytes, model: type[Body],
              admit: Callable[[RequestCost | None], None]) -> tuple[Body, RequestCost | None]:
    """The body as `model`, and its cost (which writes a schema given as an object as its JSON text, to measure it)."""
    body = _validated(raw, model, admit)
    return body, body.cost()


def _validated(raw: bytes, model: type[Body], admit: Callable[[RequestCost | None], None]) -> Body:
    """The body as `model`, or a 400 naming what is wrong with it; `admit` judges its count of prompts first."""
    data = json_object_body(raw)
    unsupported = model.unsupported_field(data)
    if unsupported is not None:
        name, why = unsupported
        raise APIError(400, f"`{name}` is not supported by this server: {why}.", param=name)
    admit(model.raw_cost(data))
    try:
        return model.model_validate(data)
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"Invalid request: {param}: {first['msg']}" if param else str(e),
                       param=param) from None


def json_object_body(body: bytes) -> dict:
    """A request body as a JSON object, or a 400 saying why not (not JSON, nested past the parser's limit, not an
    object, a string UTF-8 cannot encode)."""
    try:
        data = json.loads(body)
    except RecursionError:  # e.g. 100,000 nested lists: json's parser stops at Python's recursion limit
        raise APIError(400, _TOO_DEEP) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"The body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(body) or not json.detect_encoding(body).startswith("utf-8"):  # UTF-16 or -32
        _check_encodable(data)
    return data


def _check_encodable(data: dict) -> None:
    """A 400 naming the field (pydantic's dotted path) of a string, or a key, that UTF-8 cannot encode: a lone
    surrogate would fail every later step that encodes it (the tokenizer, the response, a log line) with a 500.
    A walk with a stack of its own: json.loads nests up to Python's recursion limit, a recursive walk would hit it."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _encodable(value):
            raise APIError(400, f"Invalid request: {path}: the string holds a lone UTF-16 surrogate, which is not "
                                "valid Unicode.", param=path)
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    where = path or "body"
                    raise APIError(400, f"Invalid request: {where}: a key holds a lone UTF-16 surrogate, which is "
                                        "not valid Unicode.", param=where)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


async def json_response(build: Callable[[], BaseModel], items: str, size: int) -> Response:
    """The JSON response of the body `build` makes; `size`, about how many values it holds. Past
    RESPONSE_VALUES_ON_LOOP it is built on a thread, its list field `items` encoded one item at a time: n choices with
    their logprobs, or the embeddings of 2,048 inputs (160 MB of JSON at 4,096 dimensions), took seconds to build
    and encode, all of it on the event loop, or on a thread in one call that holds the interpreter."""
    if size <= RESPONSE_VALUES_ON_LOOP:
        return JSONResponse(build().model_dump())
    return Response(await asyncio.to_thread(_encoded_by_item, build, items), media_type="application/json")


def output_values(outputs: list[RequestOutput], top_logprobs: int | None) -> int:
    """About how many values a whole response of `outputs` holds: each token, and its logprobs when asked for;
    prompt_logprobs' entries (three values each) once per choice, which repeats them."""
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs) * (2 + (top_logprobs or 0))
    prompt = sum(3 * len(out.outputs) * sum(map(len, filter(None, out.prompt_logprobs or ()))) for out in outputs)
    return tokens + prompt


def _encoded_by_item(build: Callable[[], BaseModel], items: str) -> bytes:
    body = build()
    shell = body.model_copy(update={items: []}).model_dump_json()
    at = shell.index(f'"{items}":[]') + len(items) + 4  # just inside the brackets
    return (shell[:at] + ",".join(item.model_dump_json() for item in getattr(body, items)) + shell[at:]).encode()


def sse_data(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(message: str, type_: str, status: int) -> str:
    """An OpenAI-style error event of a stream: `data: {"error": {...}}`."""
    return sse_data(ErrorResponse(error=ErrorInfo(message=message, type=type_, code=status)))


def finite_logprob(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


def prompt_logprobs_of(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of an output: each prompt position's entries (the first position None), -inf as
    -9999.0; None where none were asked for."""
    if out.prompt_logprobs is None:
        return None
    return [None if position is None else
            {token: PromptLogprob(logprob=finite_logprob(entry.logprob), rank=entry.rank,
                                  decoded_token=entry.decoded_token) for token, entry in position.items()}
            for position in out.prompt_logprobs]


def fingerprint_of(config: Any) -> str:
    """The server's `system_fingerprint`, made once as vLLM makes its: the version, any parallelism beyond one, and
    eight hex digits of the engine's configuration (the same model and settings give the same print)."""
    parts = [f"pressroom-{pressroom.__version__}"]
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        parts.append(f"tp{parallel.tensor_parallel_size}")
    if parallel.data_parallel_size > 1:
        parts.append(f"dp{parallel.data_parallel_size}")
    if parallel.enable_expert_parallel:
        parts.append("ep")
    parts.append(hashlib.sha256(repr(config).encode()).hexdigest()[:8])
    return "-".join(parts)


def top_logprobs(position: PositionLogprobs, n: int) -> list:
    ranked = sorted((item for item in position.items() if item[1].rank is not None), key=lambda it: it[1].rank)
    return [item for item in ranked if item[1].rank <= n][:n] if n else []


def with_own_token(position: PositionLogprobs, token: int, n: int) -> list:
    """A position's token (sampled, or the prompt's own), then the top n beside it: vLLM's completions'
    `top_logprobs`, which holds up to n + 1 entries."""
    own = [(token, position[token])] if token in position else []
    return own + [item for item in top_logprobs(position, n) if item[0] != token]


def _message_dicts(messages: list[ChatMessage]) -> list[dict]:
    try:
        return [_message_dict(m) for m in messages]
    except RecursionError:
        raise APIError(400, _TOO_DEEP, param="messages") from None


def _message_dict(message: ChatMessage) -> dict:
    """The message as a chat template reads it: its text; with image or audio parts, its parts in order, each
    medium as its placeholder part (multimodal/chat.py's, `{"type": "image"}` as HF's; a model that does not take
    a medium refuses its request before this)."""
    parts = message.content if isinstance(message.content, list) else ()
    if not any(_medium(part) for part in parts):
        return message.model_dump(exclude_none=True) | {"content": message.text}
    content = [template_part(_medium(part)) if _medium(part) else {"type": "text", "text": part["text"]}
               for part in parts if _medium(part) or part.get("type") == "text"]
    return message.model_dump(exclude_none=True) | {"content": content}


def _medium(part: dict) -> str | None:
    """The modality of a request's media part a chat template renders (None: not one)."""
    modality = MEDIA_PART_MODALITIES.get(part.get("type"))
    return modality if modality in TEMPLATE_PARTS else None


_DECIMAL = re.compile(r"[+-]?[0-9]+")  # ASCII only: int() would also take other scripts' digits and spaces


def int_header(request: Request, name: str, low: int = INT64_MIN, high: int = INT64_MAX) -> int | None:
    """Header `name` as an integer in [low, high] (by default what crosses to the engine core: int64); None if
    absent. Anything else is a 400 naming the header (the value is not echoed: a client's bytes, not text)."""
    header = request.headers.get(name)
    if header is None:
        return None
    if _DECIMAL.fullmatch(header) is None:
        raise APIError(400, f"{name} must be an integer in ASCII digits.", param=name)
    value = int(header)
    if not low <= value <= high:
        raise APIError(400, f"{name} must lie in [{low}, {high}].", param=name)
    return value


def request_priority(request: Request, field: int | None) -> int:
    """The X-Vllm-Priority header (or its alias X-Priority), which overrides the `priority` field as in
    vLLM; else the field; 0 without either. Lower runs first under `--scheduling-policy priority`."""
    for name in PRIORITY_HEADERS:
        header = int_header(request, name, PRIORITY_MIN, PRIORITY_MAX)
        if header is not None:
            return header
    return 0 if field is None else field


def request_data_parallel_rank(request: Request, field: int | None) -> int | None:
    """The `data_parallel_rank` field, else the X-data-parallel-rank header (None: the engine balances)."""
    return field if field is not None else int_header(request, "X-data-parallel-rank")


def request_session_id(request: Request, field: str | None) -> str | None:
    """The `session_id` field, else the X-Session-Id header (None without either). The header must be printable
    ASCII: HTTP gives other bytes no charset, and they would reach the engine and the logs as mojibake."""
    if field is not None:
        return field
    header = request.headers.get("x-session-id")
    if header is not None and len(header) > MAX_SESSION_ID_CHARS:
        raise APIError(400, f"X-Session-Id is longer than {MAX_SESSION_ID_CHARS} characters.", param="X-Session-Id")
    if header is not None and not (header.isascii() and header.isprintable()):
        raise APIError(400, "X-Session-Id must be printable ASCII.", param="X-Session-Id")
    return header or None


@dataclass(frozen=True, slots=True)
class Routing:
    """How the engine runs a generation request, from its body's fields and its headers."""
    priority: int
    session_id: str | None
    data_parallel_rank: int | None


def request_routing(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Routing:
    """Read before any prompt work, so that a bad header is a 400 at once."""
    return Routing(priority=request_priority(request, body.priority),
                   session_id=request_session_id(request, body.session_id),
                   data_parallel_rank=request_data_parallel_rank(request, body.data_parallel_rank))


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def stream_usage(req: CompletionRequest | ChatCompletionRequest, forced: bool = False) -> tuple[bool, bool]:
    """(usage in a last chunk, usage in every chunk) as stream_options asks, or `forced` (--enable-force-include-
    usage) gives every stream its last one (vLLM's: continuous_usage_stats counts only with include_usage)."""
    options = req.stream_options
    at_end = forced or bool(options and options.include_usage)
    return at_end, at_end and bool(options and options.continuous_usage_stats)


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """A chunk's continuous_usage_stats: the prompt's tokens and its choice's so far."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


async def _count_completion_tokens(stream: AsyncIterator[RequestOutput],
                                   record: AccessRecord) -> AsyncIterator[RequestOutput]:
    """Passes `stream` through, adding its new output tokens to `record`; closing it closes `stream`."""
    seen = 0
    async with aclosing(stream):
        async for out in stream:
            tokens = sum(len(c.token_ids) for c in out.outputs)
            record.completion_tokens += tokens - seen
            seen = tokens
            yield out
