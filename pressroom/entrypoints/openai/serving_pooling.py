"""Pooling routes: OpenAI's /v1/embeddings and vLLM's /pooling, /score and /rerank.

Every input becomes one prefill-only engine request (engine/llm_engine.py, `add_pooling_request`) that shares
the scheduler's token budget with generation and finishes with its pooled vector. /score and /rerank embed
both sides and answer their cosine similarity (a bi-encoder's score; a cross-encoder's classifier head is not
implemented). A model started to generate answers 400 on all four routes.
"""
from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.limits import RequestCost
from pressroom.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingInput,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    UsageInfo,
    random_id,
)
from pressroom.entrypoints.openai.serving import OpenAIServing, access_record, json_response, request_priority
from pressroom.entrypoints.openai.streams import merge_streams, with_disconnect
from pressroom.outputs import PoolingRequestOutput
from pressroom.pooling_params import PoolingParams

# path -> (handler method, request body, response body): vLLM's paths, with and without /v1.
POOLING_ROUTES = {
    "/v1/embeddings": ("embeddings", EmbeddingRequest, EmbeddingResponse),
    "/pooling": ("pooling", PoolingRequest, PoolingResponse),
    "/score": ("score", ScoreRequest, ScoreResponse),
    "/v1/score": ("score", ScoreRequest, ScoreResponse),
    "/rerank": ("rerank", RerankRequest, RerankResponse),
    "/v1/rerank": ("rerank", RerankRequest, RerankResponse),
}


class OpenAIServingPooling(OpenAIServing):
    async def embeddings(self, request: Request) -> Response:
        req = await self._parse(request, EmbeddingRequest)
        vectors, tokens = await self._pool_inputs(request, req, "embd")

        def response() -> EmbeddingResponse:
            data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
            return EmbeddingResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens))
        return await json_response(response, "data", sum(map(len, vectors)))

    async def pooling(self, request: Request) -> Response:
        req = await self._parse(request, PoolingRequest)
        vectors, tokens = await self._pool_inputs(request, req, "pool")

        def response() -> PoolingResponse:
            data = [PoolingData(index=i, data=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
            return PoolingResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens))
        return await json_response(response, "data", sum(map(len, vectors)))

    async def score(self, request: Request) -> dict:
        req = await self._parse(request, ScoreRequest)
        self._check_pooling(req.model)
        left, right = _as_texts(req.text_1, "text_1"), _as_texts(req.text_2, "text_2")
        if len(left) != 1 and len(left) != len(right):
            raise APIError(400, f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 to score "
                                "against every text_2, or lists of equal length to score pairwise.", param="text_1")
        vectors, tokens = await self._embed_texts(request, left + right, request_priority(request, req.priority),
                                                  req.cost())
        firsts, seconds = vectors[:len(left)], vectors[len(left):]
        pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds)
        data = [ScoreData(index=i, score=_cosine(a, b)) for i, (a, b) in enumerate(pairs)]
        return ScoreResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens)).model_dump()

    async def rerank(self, request: Request) -> dict:
        req = await self._parse(request, RerankRequest)
        self._check_pooling(req.model)
        if not req.documents:
            raise APIError(400, "documents is empty; give at least one document.", param="documents")
        if req.top_n is not None and req.top_n < 0:
            raise APIError(400, f"top_n must be non-negative, got {req.top_n}.", param="top_n")
        texts = [req.query, *req.documents]
        vectors, tokens = await self._embed_texts(request, texts, request_priority(request, req.priority), req.cost())
        scores = [_cosine(vectors[0], v) for v in vectors[1:]]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return RerankResponse(model=self._model_name(req.model), usage=RerankUsage(total_tokens=tokens),
                              results=results).model_dump(exclude_none=True)

    # ---- shared ----

    def _check_pooling(self, model: str | None) -> None:
        self._check_model(model)
        if self.engine.runner != "pooling":
            raise APIError(400, "This model does not support pooling: it was started to generate. Start the server "
                                "with --runner pooling (or --task embed) for embeddings, /pooling, /score and "
                                "/rerank.", code="model_not_pooling")

    def _model_name(self, model: str | None) -> str:
        return model or self.names[0]

    async def _pool_inputs(self, request: Request, req: EmbeddingRequest, prefix: str) -> tuple[list[list[float]], int]:
        self._check_pooling(req.model)
        try:
            pooling = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from None
        prompts = await self._prompts(req.input, req.cost())
        return await with_disconnect(request, self._pool_all(request, prompts, pooling, prefix,
                                                             request_priority(request, req.priority)))

    async def _embed_texts(self, request: Request, texts: list[str], priority: int,
                           cost: RequestCost) -> tuple[list[list[float]], int]:
        prompts = await self._prompts(texts, cost)
        return await with_disconnect(request, self._pool_all(request, prompts, PoolingParams(), "score", priority))

    async def _prompts(self, value: PoolingInput, cost: RequestCost) -> list[list[int]]:
        """Each input as token ids: texts tokenized off the event loop, token ids as given; their tokens judged
        with the rest of the request's `cost` (its count of inputs judged with its body)."""
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise APIError(400, "input is empty; give a string, a list of strings or token ids.", param="input")
        texts = [v for v in value if isinstance(v, str)]
        if texts and self.engine.tokenizer is None:
            raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init): give token ids.",
                           param="input")
        if any(v == "" for v in texts):
            raise APIError(400, "input holds an empty string; every input needs at least one token.", param="input")
        prompts = [ids for _, ids in await self._prompt_ids(value, "input")]
        self._admit(replace(cost, prompt_tokens=sum(map(len, prompts))))
        return prompts

    async def _pool_all(self, request: Request, prompts: list[list[int]], pooling: PoolingParams, prefix: str,
                        priority: int) -> tuple[list[list[float]], int]:
        """Adds every prompt (all or none: a rejected one aborts the rest) and waits for their vectors."""
        rid = random_id(prefix)
        record = access_record(request)
        record.request_id, record.prompt_tokens, record.completion_tokens = rid, sum(map(len, prompts)), 0
        streams: list[AsyncIterator[PoolingRequestOutput]] = []
        try:
            group = rid if len(prompts) > 1 else None  # a list of inputs is admitted fairly against others
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.encode(f"{rid}-{i}", {"prompt_token_ids": ids}, pooling, priority,
                                                        group))
        except BaseException as e:
            for s in streams:
                await s.aclose()
            if isinstance(e, ValueError):
                raise APIError(400, f"input[{len(streams)}]: {e}" if len(prompts) > 1 else str(e),
                               param="input") from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "service_unavailable") from None
            raise
        finals = await _finals(streams)
        return [out.outputs.data for out in finals], record.prompt_tokens


async def _finals(streams: list[AsyncIterator[PoolingRequestOutput]]) -> list[PoolingRequestOutput]:
    finals: dict[int, PoolingRequestOutput] = {}
    try:
        async for i, out in merge_streams(streams):
            if out.finished:
                finals[i] = out
    except EngineDeadError as e:
        raise APIError(503, str(e), "service_unavailable") from None
    if len(finals) != len(streams):
        raise APIError(503, "The request was aborted.", "service_unavailable")
    if any(out.finish_reason == "error" or not out.outputs.data for out in finals.values()):
        raise APIError(500, "The engine failed while pooling this request (other requests are not affected).",
                       "internal_server_error")
    return [finals[i] for i in range(len(streams))]


def _as_texts(value: str | list[str], name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts or any(not t for t in texts):
        raise APIError(400, f"{name} must hold at least one non-empty text.", param=name)
    return texts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64 is OpenAI's: the little-endian float32 bytes (what the openai client decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norm = math.sqrt(float(x @ x) * float(y @ y))
    return float(x @ y) / norm if norm else 0.0


def _usage(prompt_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
