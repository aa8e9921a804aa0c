"""Pooling routes: OpenAI's /v1/embeddings, Cohere's /v2/embed, and vLLM's /pooling, /classify, /score and
/rerank (also at /v1/rerank and /v2/rerank).

Every input becomes one prefill-only engine request (engine/llm_engine.py, `add_pooling_request`) that shares
the scheduler's token budget with generation and finishes with its pooled vector. A classifier (an
`*ForSequenceClassification` checkpoint) pools its first token's class logits, which /classify turns into
probabilities as vLLM does (engine/classify.py). /score and /rerank on a cross-encoder (a one-label classifier)
read each text pair as one prompt; on an embedding model they embed both sides and answer their cosine
similarity (a bi-encoder). A model started to generate answers 400 on every pooling route.
"""
from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from pressroom.engine.async_engine import EngineDeadError
from pressroom.engine.classify import (
    CLASSIFIER_POOLING,
    ClassifierHead,
    check_pair_segments,
    cosine,
    pair_token_ids,
    pair_up,
)
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.limits import RequestCost
from pressroom.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingResponse,
    PoolingData,
    PoolingInput,
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
from pressroom.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    CohereBilledUnits,
    CohereEmbeddings,
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereMeta,
    VllmEmbeddingRequest,
    VllmPoolingRequest,
)
from pressroom.entrypoints.openai.serving import OpenAIServing, access_record, json_response, request_priority
from pressroom.entrypoints.openai.streams import merge_streams, with_disconnect
from pressroom.outputs import PoolingRequestOutput
from pressroom.pooling_params import PoolingParams

# path -> (handler method, request body, response body): vLLM's paths, with and without /v1.
POOLING_ROUTES = {
    "/v1/embeddings": ("embeddings", VllmEmbeddingRequest, EmbeddingResponse),
    "/pooling": ("pooling", VllmPoolingRequest, PoolingResponse),
    "/score": ("score", ScoreRequest, ScoreResponse),
    "/v1/score": ("score", ScoreRequest, ScoreResponse),
    "/rerank": ("rerank", RerankRequest, RerankResponse),
    "/v1/rerank": ("rerank", RerankRequest, RerankResponse),
    "/v2/rerank": ("rerank", RerankRequest, RerankResponse),
    "/classify": ("classify", ClassificationRequest, ClassificationResponse),
    "/v2/embed": ("cohere_embed", CohereEmbedRequest, CohereEmbedResponse),
}


class OpenAIServingPooling(OpenAIServing):
    async def embeddings(self, request: Request) -> Response:
        req = await self._parse(request, VllmEmbeddingRequest)
        self._check_embedder(req.model)
        vectors, tokens = await self._pool_inputs(request, req, "embd")

        def response() -> EmbeddingResponse:
            data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
            return EmbeddingResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens))
        return await json_response(response, "data", sum(map(len, vectors)))

    async def pooling(self, request: Request) -> Response:
        req = await self._parse(request, VllmPoolingRequest)
        vectors, tokens = await self._pool_inputs(request, req, "pool")

        def response() -> PoolingResponse:
            data = [PoolingData(index=i, data=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
            return PoolingResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens))
        return await json_response(response, "data", sum(map(len, vectors)))

    async def classify(self, request: Request) -> dict:
        req = await self._parse(request, ClassificationRequest)
        head = self._check_classifier(req.model)
        prompts = await self._prompts(req.input, req.cost())
        pooling = replace(CLASSIFIER_POOLING, use_activation=req.use_activation)
        logits, tokens = await with_disconnect(request, self._pool_all(request, prompts, pooling, "classify",
                                                                       request_priority(request, req.priority)))
        probs = [head.probs(v, req.use_activation) for v in logits]
        data = [ClassificationData(index=i, label=head.label(p), probs=p, num_classes=len(p))
                for i, p in enumerate(probs)]
        return ClassificationResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens)).model_dump()

    async def score(self, request: Request) -> dict:
        req = await self._parse(request, ScoreRequest)
        self._check_pooling(req.model)
        left, right = _as_texts(req.text_1, "text_1"), _as_texts(req.text_2, "text_2")
        try:
            pairs = pair_up(left, right, "text_1", "text_2")
        except ValueError as e:
            raise APIError(400, f"{e} Give one text_1 to score against every text_2, or lists of equal length to "
                                "score pairwise.", param="text_1") from None
        scores, tokens = await self._score_pairs(request, pairs, request_priority(request, req.priority), req.cost())
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
        return ScoreResponse(model=self._model_name(req.model), data=data, usage=_usage(tokens)).model_dump()

    async def rerank(self, request: Request) -> dict:
        req = await self._parse(request, RerankRequest)
        self._check_pooling(req.model)
        if not req.documents:
            raise APIError(400, "documents is empty; give at least one document.", param="documents")
        if req.top_n is not None and req.top_n < 0:
            raise APIError(400, f"top_n must be non-negative, got {req.top_n}.", param="top_n")
        pairs = [(req.query, doc) for doc in req.documents]
        scores, tokens = await self._score_pairs(request, pairs, request_priority(request, req.priority), req.cost())
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return RerankResponse(model=self._model_name(req.model), usage=RerankUsage(total_tokens=tokens),
                              results=results).model_dump(exclude_none=True)

    async def cohere_embed(self, request: Request) -> dict:
        """Cohere's /v2/embed as vLLM serves it: texts (or inputs' text parts) embedded, truncated as `truncate`
        says, the vectors given in each of `embedding_types`."""
        req = await self._parse(request, CohereEmbedRequest)
        self._check_embedder(req.model)
        if req.input_type is not None:  # vLLM's answer for a model that defines no task instructions
            raise APIError(400, f"Unsupported input_type {req.input_type!r}. This model does not define any "
                                "input_type task instructions.", param="input_type")
        try:
            texts = req.input_texts()
            pooling = PoolingParams(dimensions=req.output_dimension)
        except ValueError as e:
            raise APIError(400, str(e), param="inputs" if req.inputs is not None else "output_dimension") from None
        if any(not t for t in texts):
            raise APIError(400, "texts hold an empty string; every input needs at least one token.", param="texts")
        prompts = await self._run(lambda: [self._cohere_ids(t, req) for t in texts], sum(map(len, texts)))
        self._admit(replace(req.cost(), prompt_tokens=sum(map(len, prompts))))
        vectors, tokens = await with_disconnect(request, self._pool_all(request, prompts, pooling, "embd",
                                                                        request_priority(request, req.priority)))
        try:
            embeddings = _typed_embeddings(vectors, req.embedding_types or ["float"])
        except ValueError as e:
            raise APIError(400, str(e), param="embedding_types") from None
        meta = CohereMeta(billed_units=CohereBilledUnits(input_tokens=tokens, image_tokens=0))
        return CohereEmbedResponse(embeddings=embeddings, texts=texts, meta=meta).model_dump()

    def _cohere_ids(self, text: str, req: CohereEmbedRequest) -> list[int]:
        """A text's token ids under Cohere's truncation: NONE keeps them all (more than max_tokens is a 400),
        END and START cut the text's end or start to max_tokens (else max_model_len), special tokens kept."""
        ids = self.engine.tokenize_prompt(text)[1]
        limit = self.engine.max_model_len if req.max_tokens is None else req.max_tokens
        if req.truncate == "NONE":
            if req.max_tokens is not None and len(ids) > req.max_tokens:
                raise APIError(400, f"Input of {len(ids)} tokens exceeds max_tokens={req.max_tokens} with "
                                    "truncate=NONE. Set truncate to END or START to truncate the input.",
                               param="max_tokens")
            return ids
        return _truncated(ids, self._special_frame(), limit, req.truncate == "START")

    def _special_frame(self) -> tuple[int, int]:
        """How many special tokens the tokenizer puts before and after a text's own (BERT's: [CLS] and [SEP])."""
        bare = self.engine.tokenizer.encode("x", add_special_tokens=False)
        full = self.engine.tokenize_prompt("x")[1]
        for before in range(len(full) - len(bare) + 1):
            if full[before:before + len(bare)] == bare:
                return before, len(full) - len(bare) - before
        return 0, 0

    async def _score_pairs(self, request: Request, pairs: list[tuple[str, str]], priority: int,
                           cost: RequestCost) -> tuple[list[float], int]:
        """Each pair's score: a cross-encoder's activated logit of the pair read as one prompt, or the cosine of
        an embedding model's vectors of its two texts (each distinct text embedded once)."""
        head = self._classifier()
        if head is None:
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            vectors, tokens = await self._embed_texts(request, texts, priority, cost)
            by_text = dict(zip(texts, vectors))
            return [cosine(by_text[a], by_text[b]) for a, b in pairs], tokens
        if not head.is_cross_encoder:
            raise APIError(400, f"Scores need a cross-encoder (num_labels == 1) or an embedding model; this "
                                f"classifier has {head.num_labels} labels: use /classify.", code="model_not_scoring")
        try:
            check_pair_segments(self.engine.engine.hf_config)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        tokenizer = self.engine.tokenizer
        prompts = await self._run(lambda: [pair_token_ids(tokenizer, a, b) for a, b in pairs],
                                  sum(len(a) + len(b) for a, b in pairs))
        self._admit(replace(cost, prompt_tokens=sum(map(len, prompts))))
        logits, tokens = await with_disconnect(request, self._pool_all(request, prompts, CLASSIFIER_POOLING, "score",
                                                                       priority))
        return [head.probs(v)[0] for v in logits], tokens

    # ---- shared ----

    def _check_pooling(self, model: str | None) -> None:
        self._check_model(model)
        if self.engine.runner != "pooling":
            raise APIError(400, "This model does not support pooling: it was started to generate. Start the server "
                                "with --runner pooling (or --task embed) for embeddings, /pooling, /score and "
                                "/rerank.", code="model_not_pooling")

    def _classifier(self) -> ClassifierHead | None:
        """The served model's classification head (None: an embedding model), read once from its config."""
        if not hasattr(self, "_head"):
            self._head = ClassifierHead.of(self.engine.engine.hf_config) if self.engine.runner == "pooling" else None
        return self._head

    def _check_classifier(self, model: str | None) -> ClassifierHead:
        self._check_pooling(model)
        head = self._classifier()
        if head is None:
            raise APIError(400, "This model does not support classification: /classify needs a classification model "
                                "(an *ForSequenceClassification checkpoint).", code="model_not_classifier")
        return head

    def _check_embedder(self, model: str | None) -> None:
        self._check_pooling(model)
        if self._classifier() is not None:
            raise APIError(400, "This model is a classifier: it gives class logits, not embeddings. Use /classify "
                                "(or /score and /rerank for a cross-encoder).", code="model_not_embedding")

    def _model_name(self, model: str | None) -> str:
        return model or self.names[0]

    async def _pool_inputs(self, request: Request, req: VllmEmbeddingRequest,
                           prefix: str) -> tuple[list[list[float]], int]:
        self._check_pooling(req.model)
        try:
            pooling = PoolingParams(normalize=req.normalize, dimensions=req.dimensions,
                                    use_activation=req.use_activation)
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


def _usage(prompt_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)


def _truncated(ids: list[int], frame: tuple[int, int], limit: int, from_start: bool) -> list[int]:
    """`ids` cut to `limit` tokens at their end (or start), keeping the special tokens around the text's own."""
    if len(ids) <= limit:
        return ids
    before, after = frame
    room = max(limit - before - after, 0)
    body = ids[before:len(ids) - after]
    kept = body[len(body) - room:] if from_start else body[:room]
    return ids[:before] + kept + ids[len(ids) - after:]


def _typed_embeddings(vectors: list[list[float]], types: list[str]) -> CohereEmbeddings:
    """Cohere's embedding types: float; binary and ubinary (the signs bit-packed, 1 for >= 0, eight a byte, most
    significant first; binary as signed bytes); base64 (the little-endian float32 bytes)."""
    array = np.asarray(vectors, dtype=np.float64)
    out = {}
    for kind in dict.fromkeys(types):
        if kind == "float":
            out[kind] = vectors
        elif kind == "base64":
            out[kind] = [_encode(v, "base64") for v in vectors]
        else:
            if array.shape[1] % 8:
                raise ValueError(f"Embedding dimension must be a multiple of 8 for binary embedding types, but got "
                                 f"{array.shape[1]}.")
            packed = np.packbits(array >= 0, axis=-1).astype(np.int16)
            out[kind] = (packed - 128 if kind == "binary" else packed).tolist()
    return CohereEmbeddings(**out)
