"""`pressroom serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLMEngine.

Every bad input becomes an OpenAI-shaped JSON error with a 4xx status; only a fault of the server
itself is a 500. A client that disconnects aborts its requests, which frees their KV blocks.

On SIGTERM the server stops accepting connections and gives the requests in flight --shutdown-timeout
seconds to finish; then it ends those still running itself (`AsyncLLMEngine.abort_all`): a stream gets a
finish_reason "abort" chunk, an SSE error event and `data: [DONE]`, a non-streamed request a JSON 503, a
little before uvicorn's own deadline would cut them. /health is 503 (with the reason) once the engine core
died, or has not been heard from for --engine-stall-timeout seconds.

Browsers get guards of their own (vLLM's CORS flags, a Host check, JSON only): a page on another site, or on a name
that resolves to this machine (DNS rebinding), cannot drive a server that has no API key.

This module is the app: middleware (the browser guards, auth and backpressure, the body's deadline, the access
log), routes with
their OpenAPI schemas, the offline /docs and /redoc, the chat page at / (static/), exception handlers, lifespan.
The handlers live in serving.py (shared base, small endpoints), serving_completion.py and serving_chat.py; chat
templates and tokenizer calls in chat_template.py.
"""
from __future__ import annotations

import asyncio
import copy
import errno
import gc
import hmac
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

import pressroom
from pressroom.core.structured_outputs import GrammarSandbox
from pressroom.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pressroom.engine.sampling_defaults import SamplingDefaults, load_sampling_defaults
from pressroom.entrypoints.openai import serving_vllm_routes as vllm_routes
from pressroom.entrypoints.openai.chat_template import Preprocessor
from pressroom.entrypoints.openai.errors import APIError, error_response
from pressroom.entrypoints.openai.lora import Adapters
from pressroom.entrypoints.openai.metrics import EngineShape, ServerMetrics
from pressroom.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pressroom.entrypoints.openai.protocol_messages import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from pressroom.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from pressroom.entrypoints.openai.reasoning import make_parser
from pressroom.entrypoints.openai.serving import (
    ACCESS_RECORD_KEY,
    AccessRecord,
    OpenAIServing,
    OpenAIServingUtility,
    ServerLoad,
    json_object_body,
)
from pressroom.entrypoints.openai.serving_audio import OpenAIServingAudio
from pressroom.entrypoints.openai.serving_chat import MediaLoader, OpenAIServingChat
from pressroom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pressroom.entrypoints.openai.serving_messages import MESSAGES_PATH, OpenAIServingMessages, messages_error
from pressroom.entrypoints.openai.serving_pooling import POOLING_ROUTES, OpenAIServingPooling
from pressroom.entrypoints.openai.serving_responses import OpenAIServingResponses
from pressroom.entrypoints.openai.settings import ANY, ServerSettings, host_name
from pressroom.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStream
from pressroom.logger import DATE_FORMAT, printable
from pressroom.lora.adapter import check_adapter_files

logger = logging.getLogger("pressroom")
access_logger = logging.getLogger("pressroom.access")

# After --shutdown-timeout the server ends the requests still in flight itself; uvicorn cancels the handlers of
# any still not done this much later (only a client that stopped reading its stream can hold one that long).
SHUTDOWN_BACKSTOP_S = 2.0
# The chat page at / (index.html) and its assets at /static/.
STATIC_DIR = Path(__file__).with_name("static")
# The page shows model output (as text only) and may hold an API key: nothing but this server, no framing.
PAGE_CSP = "default-src 'self'; frame-ancestors 'none'"


# ---- the app ----

class _Guard:
    """ASGI middleware: Bearer auth on every route but /health, the chat page (and /metrics, if opened) when an
    API key is set (the key in `x-api-key`, as Anthropic's clients send it, is taken too, as vLLM takes it), and a cap
    on generation requests in flight (a 429 with Retry-After beyond it, rather than a queue without bound)."""
    GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", MESSAGES_PATH, vllm_routes.BATCH_PATH,
                  vllm_routes.SCORING_PATH)

    def __init__(self, app, api_keys: tuple[str, ...], max_concurrent: int | None, open_paths: tuple[str, ...]
                 ) -> None:
        self.app, self.max_concurrent, self.open_paths = app, max_concurrent, open_paths
        self.expected = [f"Bearer {key}".encode() for key in api_keys]  # any one of them (vLLM's several keys)
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (path := route_path(scope)) in self.open_paths:
            return await self.app(scope, receive, send)
        if self.expected:
            headers = dict(scope["headers"])
            given = (headers.get(b"authorization", b""), b"Bearer " + headers.get(b"x-api-key", b""))
            # every key compared: no timing
            if not any([hmac.compare_digest(offered, key) for offered in given for key in self.expected]):
                message = "Invalid or missing API key; send `Authorization: Bearer <key>` (or `x-api-key: <key>`)."
                response = messages_error(401, message) if path.startswith(MESSAGES_PATH) else \
                    error_response(401, message, "authentication_error", code="invalid_api_key")
                return await response(scope, receive, send)
        counted = scope["method"] == "POST" and path in self.GENERATION
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


class _LoadCount:
    """ASGI middleware: counts the POSTs in flight on the model's routes into a ServerLoad (vLLM's
    --enable-server-load-tracking). Inside the guards: a request refused by them never ran."""

    def __init__(self, app, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send) -> None:
        counted = scope["type"] == "http" and scope["method"] == "POST" and route_path(scope) in self.load.paths
        self.load.in_flight += counted
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= counted


# the routes whose requests run the model: what vLLM's server load counts
MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", MESSAGES_PATH, *POOLING_ROUTES,
                "/v1/audio/transcriptions", "/v1/audio/translations", vllm_routes.BATCH_PATH, vllm_routes.SCORING_PATH)


class _HostCheck:
    """ASGI middleware: the Host header must name this server (ServerSettings.host_names, any port), or a 400. A page
    on a name an attacker points at this machine (DNS rebinding) is of the same origin as its requests, so CORS lets
    them through; their Host header gives them away. /health answers any Host (probes send an address)."""
    OPEN = "/health"

    def __init__(self, app, names: frozenset[str]) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or route_path(scope) == self.OPEN:
            return await self.app(scope, receive, send)
        if host_name(_header(scope, b"host")) in self.names:
            return await self.app(scope, receive, send)
        response = error_response(400, "The Host header names no host this server answers to (see --allowed-hosts).",
                                  code="invalid_host")
        await response(scope, receive, send)


class _OriginCheck:
    """ASGI middleware: a state-changing request from a page of another origin than the server's own gets a 403 before
    its body is read, unless --allowed-origins names that origin. CORS alone only hides the answer from the page: the
    request itself (a form post, or a fetch that needs no preflight) would already have run."""
    STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})

    def __init__(self, app, allowed: tuple[str, ...]) -> None:
        self.app, self.any, self.allowed = app, ANY in allowed, frozenset(allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.STATE_CHANGING or self._allows(scope):
            return await self.app(scope, receive, send)
        response = error_response(403, "Requests from this origin are not allowed (see --allowed-origins).",
                                  "permission_error", code="origin_not_allowed")
        await response(scope, receive, send)

    def _allows(self, scope) -> bool:
        origin = _header(scope, b"origin", None)
        if origin is None or self.any or origin in self.allowed:  # no Origin: not a browser's page
            return True
        # the server's own: the origin's host[:port] is the Host header (its scheme is not compared: behind a proxy
        # that ends TLS, an https page calls a server that sees http)
        return origin.partition("://")[2].lower() == _header(scope, b"host").lower()


class _JsonOnly:
    """ASGI middleware: a POST to a route whose body is JSON must say so (Content-Type application/json, with any
    parameters), or gets a 415. A browser sends text/plain, form and multipart bodies to other sites without asking
    (no CORS preflight); a JSON one it does not."""

    def __init__(self, app, paths: frozenset[str]) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in self.paths:
            return await self.app(scope, receive, send)
        if _header(scope, b"content-type").partition(";")[0].strip().lower() == "application/json":
            return await self.app(scope, receive, send)
        response = error_response(415, "The request body must be JSON, sent with `Content-Type: application/json`.",
                                  param="Content-Type", code="unsupported_media_type")
        await response(scope, receive, send)


def route_path(scope) -> str:
    """The request's path within the app: without --root-path's prefix when it has it (a proxy that passes the
    prefix on), as Starlette's router matches it; the guards judge routes by this."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


def _header(scope, name: bytes, missing: str | None = "") -> str | None:
    """A request header's value (the last, if repeated), or `missing`."""
    value = dict(scope["headers"]).get(name)
    return missing if value is None else value.decode("latin-1")


class _BodyDeadline:
    """ASGI middleware: a request's whole body must arrive within `timeout_s` of its start. A client that stops
    mid-body gets a 408 instead of holding a connection and a handler for as long as it likes."""

    def __init__(self, app, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.timeout_s:
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def receive_in_time():
            nonlocal body_done
            if body_done:  # after the body, receive() waits for a disconnect: no deadline for that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise APIError(408, f"The request body did not arrive within {self.timeout_s:g} s.",
                               code="request_timeout") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)


class _AccessLog:
    """ASGI middleware: one INFO line per HTTP request when its response has ended (a stream's after its last
    chunk), with what the handler put in the request's AccessRecord (serving.access_record)."""
    QUIET = ("/health", "/metrics")  # probes and scrapes, every few seconds: they would drown the rest

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.QUIET:
            return await self.app(scope, receive, send)
        record = scope[ACCESS_RECORD_KEY] = AccessRecord()
        status = 500  # stays so if the app raises: the outermost ServerErrorMiddleware then sends a 500
        started = time.monotonic()

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            headers = dict(scope["headers"])
            request_id = record.request_id or headers.get(b"x-request-id", b"-").decode("latin-1")
            session_id = record.session_id or headers.get(b"x-session-id", b"-").decode("latin-1")
            # the path (percent-decoded), the ids and the session are the client's: escaped, or they forge lines
            access_logger.info('"%s %s" %d request_id=%s session_id=%s prompt_tokens=%s completion_tokens=%s '
                               "time=%.1fms", scope["method"], printable(scope["path"]), status,
                               printable(request_id), printable(session_id),
                               _or_dash(record.prompt_tokens), _or_dash(record.completion_tokens),
                               1000 * (time.monotonic() - started))


def _or_dash(count: int | None) -> str:
    return "-" if count is None else str(count)


# ---- OpenAPI: the handlers read their bodies themselves (to hold them to --max-request-bytes), so FastAPI
# sees no body model; the routes declare theirs, and the app's schema carries the models. ----

_SCHEMA_REF = "#/components/schemas/{model}"
_ERRORS = {"4XX": {"model": ErrorResponse, "description": "An OpenAI-shaped error"}}


def _request_body(model: type[BaseModel]) -> dict:
    """The `openapi_extra` of a route whose handler parses a JSON body of `model`."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _responses(model: type[BaseModel], chunk: type[BaseModel] | None = None) -> dict:
    """200 with `model` as JSON (or, streamed, `chunk`s as server-sent events), and the 4xx errors."""
    ok: dict = {"model": model, "description": "The response; with `stream`, server-sent events instead"}
    if chunk is not None:
        ok["content"] = {"text/event-stream": {"schema": {"$ref": _SCHEMA_REF.format(model=chunk.__name__)}}}
    return {200: ok, **_ERRORS}


def _add_schemas(app: FastAPI, models: list[tuple[type[BaseModel], JsonSchemaMode]]) -> None:
    """Makes the app's OpenAPI document also carry `models` (and the models they use) as components."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = generate()  # caches itself in app.openapi_schema, which this completes
            _, defs = models_json_schema(models, ref_template=_SCHEMA_REF)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs["$defs"].items():
                components.setdefault(name, schema)
        return app.openapi_schema

    app.openapi = openapi


def _auto_tool_parser(settings: ServerSettings) -> type[ToolCallStream] | None:
    name = settings.tool_call_parser
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}.")
    if not settings.enable_auto_tool_choice:
        return None
    logger.info("automatic tool choice: the %s tool call parser", name)
    return TOOL_PARSERS[name]


DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for its development routes (/server_info, /sleep, ...)


def served_names(settings: ServerSettings, engine: AsyncLLMEngine) -> list[str]:
    """The names clients use, the first reported: the settings' or else the model's."""
    return list(settings.served_model_name) or [Path(str(engine.model_path)).stem]


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    names = served_names(settings, engine)
    reasoning = make_parser(settings.reasoning_parser, engine.tokenizer, settings.reasoning_start,
                            settings.reasoning_end)
    stats = ServerMetrics(names[0], settings.log_requests,  # one for all handlers
                          EngineShape.of(engine.engine.config, engine.max_model_len))
    # a rendered chat prompt may be twice the largest body: room for any template's markup, not for a bomb's
    limits = settings.admission_limits
    grammars = GrammarSandbox(engine.tokenizer, timeout_s=limits.max_grammar_compile_seconds,
                              max_bytes=limits.max_grammar_compile_mib << 20)
    preprocessor = Preprocessor(engine.tokenizer, 2 * settings.max_request_bytes, settings.trust_request_chat_template,
                                grammars=grammars, max_grammar_chars=limits.max_grammar_chars,
                                chat_template=settings.chat_template,
                                default_template_kwargs=settings.default_chat_template_kwargs)
    # every handler's first arguments
    shared = (engine, names, stats, settings.max_request_bytes, preprocessor, limits)
    utility = OpenAIServingUtility(*shared, stall_timeout=settings.engine_stall_timeout)
    completion = OpenAIServingCompletion(*shared)
    chat = OpenAIServingChat(*shared, reasoning, _auto_tool_parser(settings))
    pooling = OpenAIServingPooling(*shared)
    responses = OpenAIServingResponses(*shared, chat.reasoning, chat.auto_tool_parser)
    adapters = served_adapters(settings, engine, names[0])
    messages = OpenAIServingMessages(*shared, chat.reasoning, chat.auto_tool_parser)
    audio = OpenAIServingAudio(*shared)
    _share_settings((utility, completion, chat, pooling, responses, messages, audio), settings, adapters,
                    server_sampling_defaults(settings, engine))
    media = MediaLoader(settings.media_policy)  # chat's media parts, on threads of their own
    for handler in (chat, responses, messages, audio):
        handler.media = media
    lifespan = _lifespan(engine, settings, stats, preprocessor)
    # /docs and /redoc from the package's own copies of Swagger UI and ReDoc: they work with no network.
    app = FastAPIOffline(title="pressroom", version=pressroom.__version__, lifespan=lifespan,
                         swagger_ui_parameters={"validatorUrl": None})  # no call to swagger.io's validator
    app.root_path = settings.root_path  # as vLLM sets it: routes match with the prefix and without
    _add_routes(app, utility, completion, chat, pooling, responses)
    _add_messages_routes(app, messages)
    _add_audio_routes(app, audio)
    _add_vllm_routes(app, chat, engine)
    if settings.tokenizer_info:
        app.get("/tokenizer_info")(utility.tokenizer_info)
    app.get("/load")(utility.load)
    if settings.server_load_tracking:
        utility.server_load = ServerLoad(frozenset(MODEL_ROUTES))
        app.add_middleware(_LoadCount, load=utility.server_load)
    _add_middleware(app, settings)
    stats.instrument(app)  # outermost: the guards' 401s and 429s are counted too
    _add_exception_handlers(app)
    return app


def _share_settings(handlers: tuple[OpenAIServing, ...], settings: ServerSettings, adapters,
                    defaults: SamplingDefaults) -> None:
    """What every handler reads alike: the served adapters, the sampling defaults, the usage and logprob flags."""
    for handler in handlers:
        handler.adapters = adapters
        handler.sampling_defaults = defaults
        handler.prompt_tokens_details = settings.prompt_tokens_details
        handler.force_include_usage = settings.force_include_usage
        handler.tokens_as_ids = settings.return_tokens_as_token_ids
        if isinstance(handler, OpenAIServingChat):  # vLLM refuses a required or named tool_choice without a parser
            handler.tool_parser_named = settings.tool_call_parser is not None


def _lifespan(engine: AsyncLLMEngine, settings: ServerSettings, stats: ServerMetrics, preprocessor: Preprocessor):
    """The app's lifespan: the preprocessor's workers, and the periodic stats line while the app runs."""

    @asynccontextmanager
    async def lifespan(_):
        await preprocessor.start()
        logging_task = None
        if settings.log_stats_interval > 0:
            logging_task = asyncio.create_task(stats.log_periodically(engine.stats, settings.log_stats_interval))
        yield
        if logging_task is not None:
            logging_task.cancel()
        await preprocessor.close()

    return lifespan


def server_sampling_defaults(settings: ServerSettings, engine: AsyncLLMEngine) -> SamplingDefaults:
    """The requests' default sampling parameters (--generation-config), logged as vLLM logs them."""
    defaults = load_sampling_defaults(settings.generation_config, settings.override_generation_config,
                                      str(engine.model_path))
    if engine.engine.config.model.runner != "pooling" and defaults.values:
        logger.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                       "config recommended from the model creator. If this is not intended, relaunch with "
                       "`--generation-config vllm`.")
        for api in ("chat", "completion"):
            defaults.log(api)
    return defaults


def served_adapters(settings: ServerSettings, engine: AsyncLLMEngine, base_name: str) -> Adapters | None:
    """The --lora-modules adapters (each checked now: a bad one stops the start, naming it); None without
    --enable-lora."""
    config = engine.engine.config.lora
    if config is None:
        if settings.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora.")
        return None
    adapters = Adapters(base_name)
    for module in settings.lora_modules:
        check_adapter_files(module.name, module.path, config.max_lora_rank)
        adapters.add(module.name, module.path, module.base_model_name)
    return adapters


def _add_middleware(app: FastAPI, settings: ServerSettings) -> None:
    app.add_middleware(_BodyDeadline, timeout_s=settings.body_read_timeout)
    open_paths = ("/health",) if settings.metrics_auth else ("/health", "/metrics")
    # the chat page needs no key to load: it asks for one and sends it with its API calls
    open_paths += ("/", *(f"/static/{path.name}" for path in STATIC_DIR.iterdir()))
    app.add_middleware(_Guard, api_keys=settings.api_keys, max_concurrent=settings.max_concurrent_requests,
                       open_paths=open_paths)
    _add_browser_guards(app, settings)
    if settings.access_log:
        app.add_middleware(_AccessLog)  # added last, so outermost: it also logs the guard's 401s and 429s


def _add_browser_guards(app: FastAPI, settings: ServerSettings) -> None:
    """Outside the auth: a browser's preflight carries no API key, and the CORS headers must reach the 401s too."""
    app.add_middleware(_JsonOnly, paths=_json_body_paths(app))
    app.add_middleware(_OriginCheck, allowed=settings.allowed_origins)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                           allow_credentials=settings.allow_credentials)
    host_names = settings.host_names()
    if host_names is not None:
        app.add_middleware(_HostCheck, names=host_names)


def _json_body_paths(app: FastAPI) -> frozenset[str]:
    """The routes that declare a JSON body (`_request_body`); a route taking another type (multipart) is not one."""
    return frozenset(route.path for route in app.routes if isinstance(route, APIRoute)
                     and "application/json" in (route.openapi_extra or {}).get("requestBody", {}).get("content", {}))


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError):  # the core died, or the shutdown ended the request
        return error_response(503, str(e), "service_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"Internal server error: {type(e).__name__}", "internal_server_error")


def _add_routes(app: FastAPI, utility: OpenAIServingUtility, completion: OpenAIServingCompletion,
                chat: OpenAIServingChat, pooling: OpenAIServingPooling, responses: OpenAIServingResponses) -> None:
    app.get("/", include_in_schema=False)(_chat_page)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.get("/health")(utility.health)
    app.get("/ping")(utility.health)  # SageMaker's health check, GET or POST as vLLM serves it (it reads no body)
    app.post("/ping", include_in_schema=False)(utility.health)
    app.post("/invocations", openapi_extra=_ANY_JSON_BODY, responses=_ERRORS)(
        _invocations(utility, completion, chat, pooling))
    if os.environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true"):
        app.get("/server_info")(utility.server_info)
        app.get("/is_sleeping")(utility.is_sleeping)
        app.post("/sleep")(utility.sleep)
        app.post("/wake_up")(utility.wake_up)
        app.post("/reset_prefix_cache")(utility.reset_prefix_cache)
    app.get("/version")(utility.version)
    app.get("/metrics")(utility.metrics)
    app.get("/v1/models")(utility.models)
    app.post("/v1/load_lora_adapter", openapi_extra=_request_body(LoadLoRAAdapterRequest),
             responses=_ERRORS)(utility.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", openapi_extra=_request_body(UnloadLoRAAdapterRequest),
             responses=_ERRORS)(utility.unload_lora_adapter)
    app.post("/tokenize", openapi_extra=_request_body(TokenizeRequest), responses=_ERRORS)(utility.tokenize)
    app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest), responses=_ERRORS)(utility.detokenize)
    app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest),
             responses=_responses(CompletionResponse, CompletionResponse))(completion.completions)
    app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest),
             responses=_responses(ChatCompletionResponse, ChatCompletionChunk))(chat.chat_completions)
    app.post("/v1/responses", openapi_extra=_request_body(ResponsesRequest),
             responses=_responses(ResponseObject))(responses.create_response)
    app.get("/v1/responses/{response_id}", responses=_responses(ResponseObject))(responses.retrieve_response)
    for path, (method, body, response) in POOLING_ROUTES.items():
        app.post(path, openapi_extra=_request_body(body), responses=_responses(response))(getattr(pooling, method))
    _add_schemas(app, [(body, "validation") for _, body, _ in POOLING_ROUTES.values()])
    _add_schemas(app, [(TokenizeRequest, "validation"), (DetokenizeRequest, "validation"),
                       (CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
                       (ResponsesRequest, "validation"),
                       (ChatCompletionChunk, "serialization")])


def _add_messages_routes(app: FastAPI, messages: OpenAIServingMessages) -> None:
    """Anthropic's Messages API: its bodies declared, its errors in Anthropic's shape."""
    errors = {"4XX": {"model": AnthropicErrorResponse, "description": "An Anthropic-shaped error"}}
    app.post(MESSAGES_PATH, openapi_extra=_request_body(MessagesRequest),
             responses={200: {"model": MessagesResponse, "description": "The message; with `stream`, Anthropic's "
                                                                       "server-sent events instead"}, **errors}
             )(messages.messages)
    app.post(f"{MESSAGES_PATH}/count_tokens", openapi_extra=_request_body(CountTokensRequest),
             responses={200: {"model": CountTokensResponse, "description": "The prompt's tokens"}, **errors}
             )(messages.count_tokens)
    _add_schemas(app, [(MessagesRequest, "validation"), (CountTokensRequest, "validation")])


def _add_audio_routes(app: FastAPI, audio: OpenAIServingAudio) -> None:
    """OpenAI's audio API (serving_audio.py): multipart forms, so not behind _JsonOnly."""
    body = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {"type": "object"}}}}}
    app.post("/v1/audio/transcriptions", openapi_extra=body, responses=_ERRORS)(audio.transcriptions)
    app.post("/v1/audio/translations", openapi_extra=body, responses=_ERRORS)(audio.translations)


def _add_vllm_routes(app: FastAPI, chat: OpenAIServingChat, engine: AsyncLLMEngine) -> None:
    """vLLM 0.32's other routes (serving_vllm_routes.py); those of generation only where the model generates, as
    vLLM registers them."""
    app.get("/kv_event_sources")(vllm_routes.kv_event_sources)
    if engine.engine.config.model.runner == "pooling":
        return
    app.post(vllm_routes.BATCH_PATH, openapi_extra=_ANY_JSON_BODY,
             responses=_responses(ChatCompletionResponse))(vllm_routes.chat_batch(chat))
    scoring = vllm_routes.GenerativeScoring(chat)
    app.post(vllm_routes.SCORING_PATH, openapi_extra=_request_body(vllm_routes.GenerativeScoringRequest),
             responses=_responses(vllm_routes.GenerativeScoringResponse))(scoring.score)
    _add_schemas(app, [(vllm_routes.GenerativeScoringRequest, "validation")])
    # bodiless, so out of the schema (as POST /ping): the JSON-only guard and the fuzzer skip it
    app.post("/is_scaling_elastic_ep", include_in_schema=False)(vllm_routes.is_scaling_elastic_ep)
    app.post("/scale_elastic_ep", openapi_extra=_ANY_JSON_BODY, responses=_ERRORS)(
        vllm_routes.scale_elastic_ep(engine.engine.config.parallel.data_parallel_size))
    for path in vllm_routes.SCALE_OUT_ROUTES:
        app.post(path, include_in_schema=False)(vllm_routes.scale_out_disabled)


# /invocations takes whichever request its fields say (a JSON object): declared so, _JsonOnly guards it too
_ANY_JSON_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}}


def _invocations(utility: OpenAIServingUtility, completion: OpenAIServingCompletion, chat: OpenAIServingChat,
                 pooling: OpenAIServingPooling):
    """SageMaker's /invocations, as vLLM serves it: a chat request (`messages`), a completion (`prompt`) or
    embeddings (`input`), told apart by the body's fields."""
    async def invocations(request: Request) -> Response:
        body = json_object_body(await utility.read_body_once(request))
        if "messages" in body:
            return await chat.chat_completions(request)
        if "prompt" in body:
            return await completion.completions(request)
        if "input" in body:
            return await pooling.embeddings(request)
        raise APIError(400, "Cannot tell the request's type: /invocations takes a chat request (messages), a "
                       "completion (prompt) or embeddings (input).")
    return invocations


async def _chat_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Content-Security-Policy": PAGE_CSP})


# ---- running it ----

def _header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with a deadline on a connection's first request headers. uvicorn arms its
    keep-alive timer only after a response (and any byte received cancels it), so a client that opened
    connections and sent their headers a byte at a time held them for ever; this closes such a connection
    `timeout_s` after it opened unless its first request's headers are all in by then."""

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_deadline = self.loop.call_later(timeout_s, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_deadline is not None and self.conn.their_state is not h11.IDLE:
                self._header_deadline.cancel()  # the first request's headers are in
                self._header_deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown (SIGTERM) ends the engine's requests still in flight after
    `grace_s` seconds, so that each gets an error (a 503, or its finish reason and an SSE error event) before
    uvicorn's deadline, `grace_s` + SHUTDOWN_BACKSTOP_S, would cancel its handler and cut its response."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None) -> None:
        ender = asyncio.create_task(self._end_requests_after_grace())
        try:
            await super().shutdown(sockets)  # stops accepting, then waits for the requests in flight
        finally:
            ender.cancel()

    async def _end_requests_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        ended = self.engine.abort_all(f"The server is shutting down: the request did not finish within its "
                                      f"{self.grace_s:g} s shutdown timeout.")
        if ended:
            logger.warning("shutdown timeout (%g s) is over: ended %d request(s) still in flight", self.grace_s,
                           ended)


class PortUnavailableError(Exception):
    """The server's address cannot be bound: its port in use, or not this process's to take."""


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not yet listening (uvicorn listens once the app is up, so until then a client
    is refused rather than left waiting). Bound before the model loads, as vLLM does, so that a port in use is
    reported at once, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say so, and with it on a stream's
    # small chunks wait for each other's acknowledgements (measured: half the inter-token gaps 0, in bursts)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds beside its old connections' TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortUnavailableError(f"port {port} on {host} is in use by another process: stop it, or choose "
                                       "another port with --port") from None
        raise PortUnavailableError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(settings: ServerSettings, engine_kwargs: dict, started: float | None = None) -> int:
    """`started`: a time.monotonic() reading from when the process began, for the time-to-ready line."""
    started = time.monotonic() if started is None else started
    try:
        if settings.tls is not None:
            settings.tls.check()  # a bad certificate stops the start before the model loads, as a taken port does
        sock = bind_listener(settings.host, settings.port)
    except (PortUnavailableError, ValueError) as e:
        logger.error("%s", e)
        return 3  # uvicorn's exit code for a server that could not start
    with sock:
        return _serve_on(sock, settings, engine_kwargs, started)


def _uvicorn_log_config() -> dict:
    """uvicorn's logging, its lines timestamped as pressroom's are."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
        formatter["datefmt"] = DATE_FORMAT
    return config


def _serve_on(sock: socket.socket, settings: ServerSettings, engine_kwargs: dict, started: float) -> int:
    from pressroom.config import EngineArgs
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_kwargs(**engine_kwargs))
    app = build_app(engine, settings)
    # The start-up heap (torch, the tokenizer, the app: millions of objects, alive until the process ends) is left out
    # of the collector's passes: a full pass over it held the event loop 100-200 ms, every second or so under load.
    gc.collect()
    gc.freeze()
    app_lifespan = app.router.lifespan_context
    tls = settings.tls
    server: _GracefulServer  # made below; running, its config holds the TLS context that --enable-ssl-refresh reloads

    @asynccontextmanager
    async def lifespan(a):
        async with app_lifespan(a):
            refresher = asyncio.create_task(tls.refresh_forever(server.config.ssl)) \
                if tls is not None and tls.refresh else None
            logger.info("ready in %.1fs from start (engine %.1fs: load%s)", time.monotonic() - started,
                        engine.startup_seconds,
                        ", profile, CUDA graphs" if engine.cuda_graphs else "")
            try:
                yield
            finally:
                if refresher is not None:
                    refresher.cancel()
        engine.shutdown()  # after uvicorn's graceful shutdown: in-flight requests finished or were ended

    app.router.lifespan_context = lifespan
    logger.info("serving %s on %s://%s:%d%s", served_names(settings, engine)[0], "http" if tls is None else "https",
                settings.host, sock.getsockname()[1], settings.root_path)
    grace = max(0.0, settings.shutdown_timeout)
    header_timeout = settings.body_read_timeout
    # uvicorn wraps the socket bound before the load (run_server) in TLS as it starts listening
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                            access_log=settings.uvicorn_access_log, log_config=_uvicorn_log_config(),
                            timeout_graceful_shutdown=grace + SHUTDOWN_BACKSTOP_S,
                            http=_header_deadline_protocol(header_timeout) if header_timeout > 0 else "h11",
                            **({} if tls is None else tls.uvicorn_kwargs()))
    server = _GracefulServer(config, engine, grace)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0 if server.started else 3  # 3: uvicorn's exit code for a server that could not start
