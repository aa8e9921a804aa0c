"""`pressroom serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLMEngine.

Every bad input becomes an OpenAI-shaped JSON error with a 4xx status; only a fault of the server
itself is a 500. A client that disconnects aborts its requests, which frees their KV blocks.

This module is the app: middleware, routes, exception handlers, lifespan. The handlers live in
serving.py (shared base, small endpoints), serving_completion.py and serving_chat.py.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pressroom
from pressroom.engine.async_engine import AsyncLLMEngine
from pressroom.entrypoints.openai.errors import APIError, error_response
from pressroom.entrypoints.openai.metrics import ServerMetrics
from pressroom.entrypoints.openai.reasoning import make_parser
from pressroom.entrypoints.openai.serving import OpenAIServingUtility
from pressroom.entrypoints.openai.serving_chat import OpenAIServingChat
from pressroom.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("pressroom")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20


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
    reasoning = make_parser(reasoning_parser, engine.tokenizer, reasoning_start, reasoning_end)
    stats = ServerMetrics(metrics_prefix, names[0])  # one for all handlers
    utility = OpenAIServingUtility(engine, names, stats, max_request_bytes, model_root)
    completion = OpenAIServingCompletion(engine, names, stats, max_request_bytes)
    chat = OpenAIServingChat(engine, names, stats, max_request_bytes, reasoning)

    @asynccontextmanager
    async def lifespan(_):
        logging_task = None
        if log_stats_interval > 0:
            logging_task = asyncio.create_task(stats.log_periodically(engine.stats, log_stats_interval))
        yield
        if logging_task is not None:
            logging_task.cancel()

    app = FastAPI(title="pressroom", version=pressroom.__version__, lifespan=lifespan)
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

    app.get("/health")(utility.health)
    app.get("/version")(utility.version)
    app.get("/metrics")(utility.metrics)
    app.get("/v1/models")(utility.models)
    app.post("/tokenize")(utility.tokenize)
    app.post("/detokenize")(utility.detokenize)
    app.post("/v1/completions")(completion.completions)
    app.post("/v1/chat/completions")(chat.chat_completions)
    return app


# ---- running it ----

def run_server(args, engine_kwargs: dict, started: float | None = None) -> int:
    """`started`: a time.monotonic() reading from when the process began, for the time-to-ready line."""
    started = time.monotonic() if started is None else started
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
            logger.warning("ready in %.1fs from start (engine %.1fs: load%s)", time.monotonic() - started,
                           engine.engine.startup_seconds,
                           ", profile, CUDA graphs" if engine.engine.runner.graphs is not None else "")
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
