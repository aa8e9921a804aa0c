"""`pressroom router`: an OpenAI-compatible front for disaggregated serving (vLLM's disaggregated proxy).

Each completion or chat completion goes first to a prefill engine (a `pressroom serve` whose --kv-transfer-config
is a NixlConnector producer) as the same request with max_tokens 1, not streamed, and {"do_remote_decode": true}
as its kv_transfer_params; the kv_transfer_params its response returns (where its prompt's KV is staged) go with the
original request to a decode engine (a consumer), which reads the KV instead of computing the prompt and answers,
streamed or whole, straight back to the client.

E/P/D: with --encode engines (producers too), a request with media parts (images or audio) goes first to an encode
engine, the same way with {"do_remote_encode": true}; the kv_transfer_params it returns (where its media's encoder
outputs are staged, keyed by their content hashes) go to the prefill engine as "remote_encoder", which reads them
instead of running its own encoder. An encode engine that fails is skipped: the prefill engine then encodes.

Engines are picked round robin among the healthy ones (least requests in flight first). An engine is taken out when
a request to it cannot connect or its /health (polled every --health-interval seconds) fails, and comes back when
/health answers 200 again. A request whose engine fails before anything was streamed to the client is retried on
another pair (up to --max-retries times); one whose decode engine dies mid-stream ends with an error event. With no
healthy prefill or decode engine a request gets a 503 at once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

logger = logging.getLogger("pressroom")

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class RouterError(Exception):
    """An error the client gets as an OpenAI error body with this status."""

    def __init__(self, status: int, message: str, kind: str = "server_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class EngineDown(Exception):
    """An engine could not be reached (it is taken out); the request may be retried elsewhere."""


@dataclass
class Engine:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    in_flight: int = 0

    def mark_down(self, why: str) -> None:
        if self.healthy:
            logger.warning("router: %s engine %s taken out: %s", self.role, self.url, why)
        self.healthy = False


class EnginePool:
    """The engines of one role: the healthy ones, round robin with the fewest requests in flight first."""

    def __init__(self, urls: list[str], role: str) -> None:
        if not urls:
            raise ValueError(f"the router needs at least one --{role} engine URL.")
        self.engines = [Engine(url.rstrip("/"), role) for url in urls]
        self.role = role
        self._turn = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> Engine:
        healthy = [e for e in self.engines if e.healthy and e.url not in exclude]
        if not healthy:
            raise RouterError(503, f"no healthy {self.role} engine (of {', '.join(e.url for e in self.engines)})",
                              "service_unavailable")
        start = next(self._turn) % len(healthy)
        ordered = healthy[start:] + healthy[:start]
        return min(ordered, key=lambda e: e.in_flight)

    @property
    def any_healthy(self) -> bool:
        return any(e.healthy for e in self.engines)


@dataclass(frozen=True)
class RouterSettings:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0  # one engine call's read timeout
    connect_timeout_s: float = 5.0
    max_retries: int = 2  # other pairs tried for a request that failed before anything was streamed
    encode: tuple[str, ...] = ()  # E/P/D: encoder engines for requests with media


MEDIA_PARTS = frozenset({"image_url", "image", "input_image", "input_audio", "audio_url", "video_url"})


def has_media(body: dict) -> bool:
    """A chat request with an image, audio or video part (the ones an encoder engine encodes)."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") in MEDIA_PARTS
        for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for part in m["content"])


def encode_body(body: dict) -> dict:
    """The request an encode engine gets: the prefill's, asking it to stage its media's encoder outputs."""
    out = prefill_body(body)
    out["kv_transfer_params"] = {"do_remote_encode": True}
    return out


def prefill_body(body: dict, encoder_params: dict | None = None) -> dict:
    """The request the prefill engine gets: the client's, one token, not streamed, asking to stage its KV (and,
    given an encode engine's params, to read its media's encoder outputs from there)."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["n"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    if encoder_params:
        out["kv_transfer_params"]["remote_encoder"] = encoder_params
    return out


def error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.prefill = EnginePool(list(settings.prefill), "prefill")
        self.decode = EnginePool(list(settings.decode), "decode")
        self.encode = EnginePool(list(settings.encode), "encode") if settings.encode else None
        timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        self._health_task: asyncio.Task | None = None

    @property
    def engines(self) -> list[Engine]:
        return (self.encode.engines if self.encode else []) + self.prefill.engines + self.decode.engines

    # ---- health ----

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(e) for e in self.engines))

    async def _probe(self, engine: Engine) -> None:
        try:
            response = await self.client.get(f"{engine.url}/health", timeout=2.0)
            ok = response.status_code == 200
            why = f"/health answered {response.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {type(e).__name__}"
        if ok and not engine.healthy:
            logger.info("router: %s engine %s is back", engine.role, engine.url)
        if not ok:
            engine.mark_down(why)
        engine.healthy = ok

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            with contextlib.suppress(Exception):
                await self.check_health()

    async def start(self) -> None:
        await self.check_health()
        await self.check_models()
        self._health_task = asyncio.create_task(self._health_loop())

    async def check_models(self) -> None:
        """Refuses to start when the reachable engines serve different models (their /v1/models ids)."""
        served: dict[str, list[str]] = {}
        for engine in self.engines:
            if not engine.healthy:
                continue
            with contextlib.suppress(Exception):
                response = await self.client.get(f"{engine.url}/v1/models", timeout=5.0)
                ids = tuple(sorted(m["id"] for m in response.json()["data"]))
                served.setdefault(", ".join(ids), []).append(engine.url)
        if len(served) > 1:
            raise ValueError("the router's engines serve different models: " + "; ".join(
                f"{', '.join(urls)} serve {models}" for models, urls in served.items()))

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.client.aclose()

    # ---- one request ----

    async def handle(self, path: str, body: dict) -> tuple[dict | None, AsyncIterator[bytes] | None]:
        """The whole response's body, or (streamed) an iterator of the decode engine's SSE bytes."""
        tried: set[str] = set()
        for attempt in range(self.settings.max_retries + 1):
            prefill = self.prefill.pick(tried)
            decode = self.decode.pick(tried)
            try:
                encoder_params = await self._encode(path, body)
                params = await self._prefill(prefill, path, body, encoder_params)
                decode_request = {**body, "kv_transfer_params": params} if params else dict(body)
                if body.get("stream"):
                    return None, await self._open_stream(decode, path, decode_request)
                return await self._post(decode, path, decode_request), None
            except EngineDown as e:
                tried.add(e.args[0])
                if attempt == self.settings.max_retries:
                    raise RouterError(502, f"the request failed on {len(tried)} engine(s); the last: {e.args[1]}",
                                      "bad_gateway") from None
                logger.info("router: retrying a request on another pair (%s)", e.args[1])
        raise AssertionError("unreachable")

    async def _encode(self, path: str, body: dict) -> dict | None:
        """An encode engine's params for a request with media; None (the prefill engine encodes) without media,
        without encode engines, or when the one picked fails."""
        if self.encode is None or path != "/v1/chat/completions" or not has_media(body):
            return None
        try:
            engine = self.encode.pick()
            answer = await self._post(engine, path, encode_body(body))
        except (EngineDown, RouterError) as e:
            if isinstance(e, RouterError) and 400 <= e.status < 500:
                raise
            logger.warning("router: encoding failed (%s); the prefill engine encodes", e.args[-1])
            return None
        return answer.get("kv_transfer_params")

    async def _prefill(self, engine: Engine, path: str, body: dict, encoder_params: dict | None = None
                       ) -> dict | None:
        answer = await self._post(engine, path, prefill_body(body, encoder_params))
        params = answer.get("kv_transfer_params")
        if params is None:
            logger.warning("router: prefill engine %s returned no kv_transfer_params (is it a kv_producer?); the "
                           "decode engine computes the prompt", engine.url)
        return params

    async def _post(self, engine: Engine, path: str, body: dict) -> dict:
        engine.in_flight += 1
        try:
            response = await self.client.post(f"{engine.url}{path}", json=body)
        except httpx.HTTPError as e:
            engine.mark_down(f"{type(e).__name__}: {e}")
            raise EngineDown(engine.url, f"{engine.role} engine {engine.url}: {type(e).__name__}") from e
        finally:
            engine.in_flight -= 1
        return _answer(engine, response)

    async def _open_stream(self, engine: Engine, path: str, body: dict) -> AsyncIterator[bytes]:
        """Opens the decode engine's stream (a failure to here is retried) and returns its bytes as they come."""
        engine.in_flight += 1
        request = self.client.build_request("POST", f"{engine.url}{path}", json=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            engine.in_flight -= 1
            engine.mark_down(f"{type(e).__name__}: {e}")
            raise EngineDown(engine.url, f"decode engine {engine.url}: {type(e).__name__}") from e
        if response.status_code != 200:
            try:
                await response.aread()
            finally:
                engine.in_flight -= 1
                await response.aclose()
            _answer(engine, response)
        return self._relay(engine, response)

    async def _relay(self, engine: Engine, response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            engine.mark_down(f"its stream broke: {type(e).__name__}")
            error = error_body(502, f"the decode engine {engine.url} failed mid-stream ({type(e).__name__})",
                               "bad_gateway")
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            engine.in_flight -= 1
            await response.aclose()


def _answer(engine: Engine, response: httpx.Response) -> dict:
    """An engine's JSON answer; its 4xx is the client's (passed on as is), its 5xx an engine's failure."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict):
        return body
    message = body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(
        body.get("error"), dict) else response.text[:500]
    if 400 <= response.status_code < 500:
        raise RouterError(response.status_code, message or "bad request", "invalid_request_error")
    raise RouterError(502, f"the {engine.role} engine {engine.url} answered {response.status_code}: {message}",
                      "bad_gateway")


def build_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="pressroom router", lifespan=lifespan)
    app.state.router = router

    async def forward(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body(400, "the body is not JSON", "invalid_request_error"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body(400, "the body must be a JSON object", "invalid_request_error"), 400)
        try:
            whole, stream = await router.handle(request.url.path, body)
        except RouterError as e:
            return JSONResponse(error_body(e.status, e.message, e.kind), e.status)
        if stream is not None:
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(whole)

    for path in ROUTES:
        app.post(path)(forward)

    @app.get("/health")
    async def health():
        if router.prefill.any_healthy and router.decode.any_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "prefill": [e.url for e in router.prefill.engines if e.healthy],
                             "decode": [e.url for e in router.decode.engines if e.healthy]}, 503)

    @app.get("/v1/models")
    async def models():
        try:
            engine = router.decode.pick()
            response = await router.client.get(f"{engine.url}/v1/models", timeout=5.0)
            return JSONResponse(response.json(), response.status_code)
        except RouterError as e:
            return JSONResponse(error_body(e.status, e.message, e.kind), e.status)
        except Exception as e:  # noqa: BLE001 — an unreachable engine: the next health check takes it out
            return JSONResponse(error_body(502, f"the decode engine failed: {type(e).__name__}", "bad_gateway"), 502)

    @app.get("/engines")
    async def engines():
        """Each engine's role, URL, health and requests in flight."""
        return [{"role": e.role, "url": e.url, "healthy": e.healthy, "in_flight": e.in_flight}
                for e in router.engines]

    return app


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill engine's base URL (a kv_producer); repeat for several")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode engine's base URL (a kv_consumer); repeat for several")
    parser.add_argument("--encode", action="append", default=[], metavar="URL",
                        help="E/P/D: an encode engine's base URL (a kv_producer of the same model): requests with "
                             "media have their encoder outputs computed there; repeat for several")
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health probes")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds an engine may take to answer (or between streamed bytes)")
    parser.add_argument("--max-retries", type=int, default=2,
                        help="other pairs tried for a request whose engine failed before anything was streamed")


def settings_from_args(args: Any) -> RouterSettings:
    if not args.prefill or not args.decode:
        raise ValueError("pressroom router needs at least one --prefill URL and one --decode URL.")
    for url in args.prefill + args.decode + list(getattr(args, "encode", None) or []):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL {url!r} must start with http:// or https://.")
    if args.health_interval <= 0 or args.request_timeout <= 0 or args.max_retries < 0:
        raise ValueError("--health-interval and --request-timeout must be positive, --max-retries not negative.")
    return RouterSettings(tuple(args.prefill), tuple(args.decode), args.health_interval, args.request_timeout,
                          max_retries=args.max_retries, encode=tuple(getattr(args, "encode", None) or ()))


def run_router(args: Any) -> int:
    import uvicorn
    settings = settings_from_args(args)
    logger.info("router: prefill %s; decode %s; on http://%s:%d", ", ".join(settings.prefill),
                ", ".join(settings.decode), args.host, args.port)
    uvicorn.run(build_app(settings), host=args.host, port=args.port, log_level="warning")
    return 0
