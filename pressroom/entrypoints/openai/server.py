"""`pressroom serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLMEngine.

Every bad input becomes an OpenAI-shaped JSON error with a 4xx status; only a fault of the server
itself is a 500. A client that disconnects aborts its requests, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pressroom
from pressroom.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pressroom.outputs import PositionLogprobs, RequestOutput
from pressroom.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from pressroom.entrypoints.openai.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatMessage, ChatResponseMessage, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, CompletionTokensDetails, DeltaMessage, DetokenizeRequest, ErrorInfo, ErrorResponse,
    ModelCard, ModelList, TokenizeRequest, TokenLogprob, TopLogprob, UsageInfo, random_id,
)
from pressroom.entrypoints.openai.reasoning import ReasoningParser, make_parser

logger = logging.getLogger("pressroom")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MAX_SEQUENCES = 1024  # prompts x n in one request
MAX_SESSION_ID_CHARS = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class _EventStream(StreamingResponse):
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


# ---- the app ----

class _Guard:
    """ASGI middleware for /v1/: Bearer auth when an API key is set, and a cap on generation requests in
    flight (a 429 with Retry-After beyond it, rather than a queue without bound)."""
    GENERATION = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, api_key: str | None, max_concurrent: int | None) -> None:
        self.app, self.max_concurrent = app, max_concurrent
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "Invalid or missing API key; send `Authorization: Bearer <key>`.",
                                          "authentication_error", code="invalid_api_key")
                return await response(scope, receive, send)
        counted = scope["method"] == "POST" and scope["path"] in self.GENERATION
        if counted and self.max_concurrent and self.in_flight >= self.max_concurrent:
            response = error_response(429, f"The server is at its limit of {self.max_concurrent} concurrent "
                                           "requests; retry shortly.", "rate_limit_error",
                                      code="too_many_requests", headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        self.in_flight += counted
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= counted


def build_app(engine: AsyncLLMEngine, served_model_name: str | list[str], model_root: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, metrics_prefix: str = "pressroom:",
              api_key: str | None = None, max_concurrent_requests: int | None = None,
              log_stats_interval: float = 10.0, reasoning_parser: str | None = None,
              reasoning_start: str = "<think>", reasoning_end: str = "</think>") -> FastAPI:
    """`reasoning_parser`: "think", "none", or None / "auto" (think for a model with `<think>` markers)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    api = _API(engine, names, model_root, max_request_bytes, metrics_prefix,
               make_parser(reasoning_parser, engine.tokenizer, reasoning_start, reasoning_end))

    @asynccontextmanager
    async def lifespan(_):
        logging_task = None
        if log_stats_interval > 0:
            logging_task = asyncio.create_task(api.stats.log_periodically(engine.stats, log_stats_interval))
        yield
        if logging_task is not None:
            logging_task.cancel()

    app = FastAPI(title="pressroom", version=pressroom.__version__, lifespan=lifespan)
    app.state.api = api
    app.add_middleware(_Guard, api_key=api_key, max_concurrent=max_concurrent_requests)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"Internal server error: {type(e).__name__}", "internal_server_error")

    app.get("/health")(api.health)
    app.get("/version")(api.version)
    app.get("/metrics")(api.metrics)
    app.get("/v1/models")(api.models)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


class _API:
    def __init__(self, engine: AsyncLLMEngine, names: list[str], model_root: str | None,
                 max_request_bytes: int, metrics_prefix: str, reasoning: ReasoningParser | None = None) -> None:
        self.engine, self.names, self.model_root = engine, names, model_root
        self.max_request_bytes = max_request_bytes
        self.stats = ServerMetrics(metrics_prefix, names[0])
        self.reasoning = reasoning
        if reasoning is not None:
            logger.info("reasoning parser: %s ... %s", reasoning.start, reasoning.end)

    # ---- small endpoints ----

    async def health(self) -> Response:
        return Response(status_code=200 if self.engine.is_running else 503)

    async def version(self) -> dict:
        return {"version": pressroom.__version__}

    async def metrics(self) -> Response:
        try:
            stats = await self.engine.stats()
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return Response(self.stats.render(stats), media_type=METRICS_CONTENT_TYPE)

    async def models(self) -> dict:
        cards = [ModelCard(id=name, root=self.model_root, max_model_len=self.engine.max_model_len)
                 for name in self.names]
        return ModelList(data=cards).model_dump()

    async def tokenize(self, request: Request) -> dict:
        req = await self._parse(request, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of `prompt` and `messages`.", param="prompt")
        if req.messages is not None:
            ids = await self._run(lambda: self._chat_ids(req.messages, req.add_generation_prompt, False, None))
        else:
            tok = self.engine.tokenizer
            ids = await self._run(lambda: list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        req = await self._parse(request, DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.engine.engine.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Token ids must lie in [0, {vocab}).", param="tokens")
        tok = self.engine.tokenizer
        return {"prompt": await self._run(lambda: tok.decode(req.tokens))}

    # ---- completions ----

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported; use n.", param="best_of")
        priority = _priority(request, req.priority)
        session_id = _session_id(request, req.session_id)
        try:
            given = _prompt_list(req.prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        if len(given) * req.n > MAX_SEQUENCES:
            raise APIError(400, f"{len(given)} prompts x n={req.n} exceeds the limit of {MAX_SEQUENCES} sequences "
                                "per request; split the batch.", param="prompt")
        prompts = await self._run(lambda: [self._tokenize(p) for p in given])
        params = [self._sampling_params(req, req.max_tokens, ids) for _, ids in prompts]
        rid = random_id("cmpl")
        streams = await self._add_all(rid, [({"prompt": text, "prompt_token_ids": ids}, sp)
                                            for (text, ids), sp in zip(prompts, params)], priority, session_id)
        model = req.model or self.names[0]
        if req.stream:
            return self._sse(self._completion_chunks(rid, model, req, streams))
        finals = await _with_disconnect(request, _collect(streams))
        choices = [choice for i, out in enumerate(finals)
                   for choice in self._completion_choices(out, req, i * req.n)]
        return JSONResponse(CompletionResponse(id=rid, model=model, choices=choices,
                                               usage=_usage(finals)).model_dump())

    def _completion_choices(self, out: RequestOutput, req: CompletionRequest, base: int) -> list[CompletionChoice]:
        prefix = (out.prompt or self.engine.tokenizer.decode(out.prompt_token_ids)) if req.echo else ""
        choices = []
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None:
                positions = list(c.logprobs or [])
                tokens = list(c.token_ids)
                if req.echo:
                    positions = list(out.prompt_logprobs or []) + positions
                    tokens = list(out.prompt_token_ids) + tokens
                logprobs = self._completion_logprobs(tokens, positions, req.logprobs)
            choices.append(CompletionChoice(index=base + c.index, text=prefix + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return choices

    def _completion_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None], top: int,
                             offset: int = 0) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for token, position in zip(token_ids, positions):
            text = self._token_text(token, position)
            lp.tokens.append(text)
            lp.text_offset.append(offset)
            offset += len(text)
            if position is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(_finite(position[token].logprob) if token in position else None)
            lp.top_logprobs.append({self._token_text(t, position): _finite(p.logprob)
                                    for t, p in _top(position, top)})
        return lp

    async def _completion_chunks(self, rid: str, model: str, req: CompletionRequest,
                                 streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        created = int(time.time())
        total = len(streams) * req.n
        sent_text, sent_lp, done = [0] * total, [0] * total, [False] * total
        echoed = [not req.echo] * total
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(streams):
            for c in out.outputs:
                k = i * req.n + c.index
                if done[k]:
                    continue
                delta = c.text[sent_text[k]:]
                if not echoed[k]:
                    delta = (out.prompt or self.engine.tokenizer.decode(out.prompt_token_ids)) + delta
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    logprobs = self._completion_logprobs(c.token_ids[sent_lp[k]:], c.logprobs[sent_lp[k]:],
                                                         req.logprobs)
                    sent_lp[k] = len(c.token_ids)
                if not delta and c.finish_reason is None and not (logprobs and logprobs.tokens):
                    continue
                sent_text[k], done[k], echoed[k] = len(c.text), c.finish_reason is not None, True
                choice = CompletionChoice(index=k, text=delta, logprobs=logprobs, finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason)
                yield _data(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
            if out.finished:
                finals[i] = out
        if req.stream_options and req.stream_options.include_usage and len(finals) == len(streams):
            usage = _usage([finals[i] for i in sorted(finals)])
            yield _data(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))

    # ---- chat ----

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        priority = _priority(request, req.priority)
        session_id = _session_id(request, req.session_id)
        ids = await self._run(lambda: self._chat_ids(req.messages, req.add_generation_prompt,
                                                     req.continue_final_message, req.chat_template_kwargs))
        params = self._sampling_params(req, req.requested_max_tokens, ids)
        parser = self.reasoning
        opens = parser is not None and parser.prompt_opens(ids)
        if parser is not None:
            if parser.markers_are_special:
                params = params.clone(skip_special_tokens=False)  # else the markers vanish from the text
            if params.thinking_token_budget is not None and params.think_end_token_ids is None:
                params = params.clone(think_start_token_ids=parser.start_ids, think_end_token_ids=parser.end_ids)
        rid = random_id("chatcmpl")
        streams = await self._add_all(rid, [({"prompt_token_ids": ids}, params)], priority, session_id)
        model = req.model or self.names[0]
        if req.stream:
            return self._sse(self._chat_chunks(rid, model, req, streams[0], opens))
        out = (await _with_disconnect(request, _collect(streams)))[0]
        choices = []
        for c in out.outputs:
            reasoning, content = parser.split(c.text, opens) if parser is not None else (None, c.text)
            choices.append(ChatChoice(
                index=c.index, message=ChatResponseMessage(content=content, reasoning_content=reasoning),
                logprobs=self._chat_logprobs(c.token_ids, c.logprobs, req) if req.logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return JSONResponse(ChatCompletionResponse(id=rid, model=model, choices=choices,
                                                   usage=self._chat_usage(out, opens)).model_dump())

    def _chat_usage(self, out: RequestOutput, opens: bool) -> UsageInfo:
        usage = _usage([out])
        if self.reasoning is not None:
            reasoning = sum(self.reasoning.count_reasoning_tokens(c.token_ids, opens) for c in out.outputs)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning)
        return usage

    def _chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None,
                       req: ChatCompletionRequest) -> ChatLogprobs:
        content = []
        for token, position in zip(token_ids, positions or []):
            text = self._token_text(token, position)
            top = [TopLogprob(token=self._token_text(t, position), logprob=_finite(p.logprob),
                              bytes=list(self._token_text(t, position).encode()))
                   for t, p in _top(position, req.top_logprobs or 0)]
            content.append(TokenLogprob(token=text, logprob=_finite(position[token].logprob),
                                        bytes=list(text.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)

    async def _chat_chunks(self, rid: str, model: str, req: ChatCompletionRequest,
                           stream: AsyncIterator[RequestOutput], opens: bool = False) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return _data(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        sent_text, sent_lp, done = [0] * req.n, [0] * req.n, [False] * req.n
        splitters = [self.reasoning.stream(opens) for _ in range(req.n)] if self.reasoning is not None else None
        final = None
        async for _, out in _merge([stream]):
            for c in out.outputs:
                if done[c.index]:
                    continue
                delta = c.text[sent_text[c.index]:]
                logprobs = None
                if req.logprobs and c.logprobs is not None:
                    new_ids = c.token_ids[sent_lp[c.index]:]
                    logprobs = self._chat_logprobs(new_ids, c.logprobs[sent_lp[c.index]:], req)
                    sent_lp[c.index] = len(c.token_ids)
                if not delta and c.finish_reason is None and not (logprobs and logprobs.content):
                    continue
                sent_text[c.index] = len(c.text)
                done[c.index] = c.finish_reason is not None
                if splitters is None:
                    deltas = [DeltaMessage(content=delta)]
                else:  # reasoning first, then content; a marker split across chunks is held back until whole
                    reasoning, content = splitters[c.index].feed(delta)
                    if done[c.index]:
                        r_rest, c_rest = splitters[c.index].finish()
                        reasoning, content = reasoning + r_rest, content + c_rest
                    if not (reasoning or content or done[c.index] or (logprobs and logprobs.content)):
                        continue  # all held back (a possible marker): nothing to send yet
                    deltas = [DeltaMessage(reasoning_content=reasoning)] if reasoning else []
                    if content or not deltas:
                        deltas.append(DeltaMessage(content=content))
                for k, d in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield chunk([ChatChunkChoice(index=c.index, delta=d, logprobs=logprobs if k == 0 else None,
                                                 finish_reason=c.finish_reason if last else None,
                                                 stop_reason=c.stop_reason if last else None)])
            if out.finished:
                final = out
        if req.stream_options and req.stream_options.include_usage and final is not None:
            yield chunk([], self._chat_usage(final, opens))

    # ---- shared ----

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise APIError(413, f"The request body exceeds {self.max_request_bytes} bytes.", code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_request_bytes:
                raise APIError(413, f"The request body exceeds {self.max_request_bytes} bytes.",
                               code="request_too_large")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"The body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "The body must be a JSON object.")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"Invalid request: {param}: {first['msg']}" if param else str(e),
                           param=param) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def _run(self, fn: Callable[[], Any]) -> Any:
        """Runs tokenizer work on the engine thread; a ValueError (or template error) is the client's."""
        try:
            return await self.engine.call(fn)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, str(e)) from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):
                raise APIError(400, f"The chat template failed: {e}") from None
            raise

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.engine.engine.tokenize_prompt(prompt)

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final: bool,
                  kwargs: dict | None) -> list[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; use /v1/completions.")
        conversation = [_message_dict(m) for m in messages]
        ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt and not continue_final,
                                      continue_final_message=continue_final, tokenize=True, **(kwargs or {}))
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _sampling_params(self, req, max_tokens: int | None, prompt_ids: list[int]):
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, and the prompt has "
                                f"{len(prompt_ids)}; shorten the prompt.", param="messages"
                           if isinstance(req, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > 0 and len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                                f"{max_tokens} for the completion); reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        try:
            return req.to_sampling_params(max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _add_all(self, rid: str, requests: list[tuple[dict, Any]],
                       priority: int, session_id: str | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Adds every prompt of a request, or none: a rejected one aborts those added before it."""
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, (prompt, params) in enumerate(requests):
                req_id = rid if len(requests) == 1 else f"{rid}-{i}"
                added = await self.engine.add_request(req_id, prompt, params, priority, session_id)
                streams.append(self.stats.observe(added))
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
        async def body() -> AsyncIterator[str]:
            try:
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
            except EngineDeadError as e:
                yield _data(ErrorResponse(error=ErrorInfo(message=str(e), type="service_unavailable")))
            yield "data: [DONE]\n\n"
        return _EventStream(body(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _token_text(self, token: int, position: PositionLogprobs | None) -> str:
        entry = position.get(token) if position else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.engine.tokenizer.decode([token])


# ---- helpers ----

def _data(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _finite(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


def _top(position: PositionLogprobs, n: int) -> list:
    ranked = sorted((item for item in position.items() if item[1].rank is not None), key=lambda it: it[1].rank)
    return [item for item in ranked if item[1].rank <= n][:n] if n else []


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("The prompt is empty.")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _message_dict(message: ChatMessage) -> dict:
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"Only text content parts are supported; got type {part.get('type')!r}.")
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    elif content is None:
        data["content"] = ""
    return data


def _priority(request: Request, field: int | None) -> int:
    if field is not None:
        return field
    header = request.headers.get("x-priority")
    if header is None:
        return 0
    try:
        return int(header)
    except ValueError:
        raise APIError(400, f"X-Priority must be an integer, got {header!r}.", param="X-Priority") from None


def _session_id(request: Request, field: str | None) -> str | None:
    """The `session_id` field, else the X-Session-Id header (None without either)."""
    if field is not None:
        return field
    header = request.headers.get("x-session-id")
    if header is not None and len(header) > MAX_SESSION_ID_CHARS:
        raise APIError(400, f"X-Session-Id is longer than {MAX_SESSION_ID_CHARS} characters.", param="X-Session-Id")
    return header or None


def _usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come; leaving early closes (aborts) them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except BaseException as e:
            queue.put_nowait((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in _merge(streams):
        if out.finished:
            finals[i] = out
    if len(finals) != len(streams):
        raise APIError(503, "The request was aborted.", "service_unavailable")
    return [finals[i] for i in range(len(streams))]


async def _with_disconnect(request: Request, work) -> Any:
    """Awaits `work`, cancelling it (and so aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # lets its streams abort their requests
    if task.cancelled():
        raise APIError(499, "The client closed the request.")
    return task.result()


# ---- running it ----

def run_server(args, engine_kwargs: dict) -> int:
    import uvicorn
    from pressroom.config import EngineArgs
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_kwargs(**engine_kwargs))
    source = str(engine.engine.model_path)
    names = args.served_model_name or [engine_kwargs.get("model") or Path(source).stem]
    app = build_app(engine, names, model_root=source, max_request_bytes=args.max_request_bytes,
                    metrics_prefix=args.metrics_prefix, api_key=args.api_key,
                    max_concurrent_requests=args.max_concurrent_requests,
                    log_stats_interval=args.log_stats_interval,
                    reasoning_parser=getattr(args, "reasoning_parser", None),
                    reasoning_start=getattr(args, "reasoning_start_str", None) or "<think>",
                    reasoning_end=getattr(args, "reasoning_end_str", None) or "</think>")
    app_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with app_lifespan(a):
            yield
        engine.shutdown()  # after uvicorn's graceful shutdown: in-flight requests finished or were cancelled

    app.router.lifespan_context = lifespan
    logger.warning("serving %s on http://%s:%d", names[0], args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    finally:
        engine.shutdown()
    return 0
