"""The routes vLLM 0.32's `vllm serve` has beside the OpenAI and Anthropic APIs, answered as vLLM answers them:

- POST /v1/chat/completions/batch: several conversations in one request (`messages` a list of conversations), one
  choice each, indexed in order, their usage summed; not streamed, no tools, no beam search, n of 1 (vLLM's limits).
- POST /generative_scoring: the probability that each of `items`, after (or before, `item_first`) `query`, is
  followed by the first of `label_token_ids`; normalized over the labels (`apply_softmax`, the default) or the
  model's own probability over the whole vocabulary. Read from prompt logprobs: each label is appended to the
  prompt and its logprob at the last position read back (one engine request per item and label, sharing their
  prefix through the prefix cache), which is the next-token distribution vLLM reads from one sampled step.
- GET /kv_event_sources: each data-parallel rank's KV-event publisher; pressroom publishes none (it refuses
  --kv-events-config), so `{}`, what vLLM answers without that flag.
- POST /is_scaling_elastic_ep: false, always; POST /scale_elastic_ep: vLLM's checks of the body, then the same
  data-parallel size is a no-op (as in vLLM) and any other a 400: elastic expert parallelism is out of scope
  (the data-parallel size is fixed at start).
- The scale-out routes (render, derender, /inference/v1/generate): 403, as vLLM answers them without
  --enable-scale-out; pressroom refuses that flag (and --tokens-only) by name.
"""
from __future__ import annotations

import math
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from pressroom.entrypoints.openai.errors import APIError, error_response
from pressroom.entrypoints.openai.limits import RequestCost
from pressroom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    OpenAIModel,
    Priority,
    UsageInfo,
    random_id,
)
from pressroom.entrypoints.openai.serving import OpenAIServing, Routing, json_object_body, request_priority
from pressroom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pressroom.entrypoints.openai.streams import collect_finals, with_disconnect
from pressroom.sampling_params import SamplingParams

SCALE_OUT_ROUTES = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                    "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                    "/inference/v1/generate")
SCALE_OUT_DISABLED = ("Scale-out endpoints are disabled: pressroom does not serve them (vLLM serves them with "
                      "--enable-scale-out or --tokens-only, which pressroom refuses).")
BATCH_PATH = "/v1/chat/completions/batch"
SCORING_PATH = "/generative_scoring"


# ---- /v1/chat/completions/batch ----

def _batch_limits(body: dict[str, Any]) -> None:
    """vLLM's refusals of what a batch cannot do, each a 400 naming its field."""
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations or not all(
            isinstance(c, list) and c for c in conversations):
        raise APIError(400, "`messages` must be a non-empty list of conversations, each a non-empty list of "
                            "messages.", param="messages")
    if body.get("stream"):
        raise APIError(400, "Batch chat completions are not streamed; set `stream` to false.", param="stream")
    if body.get("tools"):
        raise APIError(400, "Batch chat completions do not support tools; send each conversation to "
                            "/v1/chat/completions.", param="tools")
    if body.get("tool_choice") not in (None, "none"):
        raise APIError(400, "Batch chat completions take no `tool_choice` but \"none\".", param="tool_choice")
    if body.get("use_beam_search"):
        raise APIError(400, "Batch chat completions do not support beam search. Please set `use_beam_search` to "
                            "False.", param="use_beam_search")
    if body.get("n", 1) not in (None, 1):
        raise APIError(400, "Batch chat completions do not support `n > 1`. Please set `n` to 1.", param="n")


def _conversation_request(body: dict[str, Any], i: int, conversation: list) -> ChatCompletionRequest:
    data = dict(body, messages=conversation)
    unsupported = ChatCompletionRequest.unsupported_field(data)
    if unsupported is not None:
        raise APIError(400, f"`{unsupported[0]}` is not supported by this server: {unsupported[1]}.",
                       param=unsupported[0])
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"]]
        param = ".".join([f"messages[{i}]", *loc[1:]] if loc[:1] == ["messages"] else loc) or None
        raise APIError(400, f"Invalid request: {param}: {first['msg']}", param=param) from None


def chat_batch(chat: OpenAIServingChat):
    """POST /v1/chat/completions/batch on `chat`: each conversation run as its own chat request (all at once),
    answered as one chat.completion whose choice i is conversation i's answer."""
    async def batch(request: Request) -> Response:
        return await _chat_batch(chat, request)
    return batch


async def _chat_batch(chat: OpenAIServingChat, request: Request) -> Response:
    body = json_object_body(await chat._read_body(request))
    _batch_limits(body)
    chat._admit(RequestCost(prompts=len(body["messages"]), prompts_param="messages"))
    requests = [_conversation_request(body, i, c) for i, c in enumerate(body["messages"])]
    rid = random_id("chatcmpl")
    runs: list[ChatRun] = []
    try:
        for i, req in enumerate(requests):
            runs.append(await chat.start(request, req, f"{rid}_{i}"))
    except BaseException:
        for run in runs:  # a later conversation refused: the ones already running are aborted
            await run.stream.aclose()
        raise
    finals = await with_disconnect(request, collect_finals([run.stream for run in runs]))
    choices, usages = [], []
    for i, (req, run, out) in enumerate(zip(requests, runs, finals)):
        choice = chat._choice(out.outputs[0], req, run.opens, run.tools)
        choice.index = i
        if req.echoed:
            choice.message.content = req.echoed + (choice.message.content or "")
        choices.append(choice)
        usages.append(chat._chat_usage(out, run.opens))
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    response = ChatCompletionResponse(id=rid, model=requests[0].model or chat.names[0], choices=choices,
                                      usage=UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                                                      total_tokens=prompt + completion),
                                      system_fingerprint=chat.system_fingerprint)
    return JSONResponse(response.model_dump())


# ---- /generative_scoring ----

class GenerativeScoringRequest(OpenAIModel):
    model: str | None = None
    query: str | list[int]
    items: list[str] | list[list[int]] = Field(min_length=1)
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    cache_salt: str | None = None
    priority: Priority = 0

    def cost(self) -> RequestCost:
        return RequestCost(prompts=len(self.items) * len(self.label_token_ids), prompts_param="items")


class GenerativeScore(OpenAIModel):
    index: int
    object: str = "score"
    score: float


class GenerativeScoringResponse(OpenAIModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[GenerativeScore]
    usage: UsageInfo


class GenerativeScoring:
    """POST /generative_scoring on a generating model's handler (its engine, tokenizer, admission and names)."""

    def __init__(self, handler: OpenAIServing) -> None:
        self.handler = handler

    async def score(self, request: Request) -> Response:
        h = self.handler
        req = await h._parse(request, GenerativeScoringRequest)
        lora = h._check_model(req.model)
        vocab = h.engine.vocab_size
        bad = next((t for t in req.label_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"label_token_id {bad} is out of vocabulary range [0, {vocab}).",
                           param="label_token_ids")
        prompts = await self._prompts(req)
        routing = Routing(priority=request_priority(request, req.priority), session_id=None, data_parallel_rank=None)
        # the prompt's logprob at its last position (the appended label), one token generated as vLLM's read does
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        engine_prompts = []
        for ids in prompts:
            for label in req.label_token_ids:
                prompt: dict[str, Any] = {"prompt_token_ids": [*ids, label]}
                if req.cache_salt is not None:
                    prompt["cache_salt"] = req.cache_salt
                engine_prompts.append((prompt, params))
        rid = random_id("generative-scoring")
        streams = await h._add_all(request, rid, engine_prompts, routing, lora)
        finals = await with_disconnect(request, collect_finals(streams))
        labels = len(req.label_token_ids)
        data = []
        for i in range(len(prompts)):
            logprobs = [_last_logprob(out) for out in finals[i * labels:(i + 1) * labels]]
            data.append(GenerativeScore(index=i, score=_first_label_probability(logprobs, req.apply_softmax)))
        prompt_tokens = sum(map(len, prompts))
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=len(prompts),
                          total_tokens=prompt_tokens + len(prompts))  # vLLM's count: one step after each prompt
        return JSONResponse(GenerativeScoringResponse(id=rid, model=req.model or h.names[0], data=data,
                                                      usage=usage).model_dump())

    async def _prompts(self, req: GenerativeScoringRequest) -> list[list[int]]:
        """Each item's prompt: the query's ids then the item's (the item's first with item_first), cut to leave room
        for the label; the query's text tokenized with add_special_tokens, an item's without (no second BOS)."""
        tokenizer, h = self.handler.engine.tokenizer, self.handler
        if tokenizer is None and (isinstance(req.query, str) or isinstance(req.items[0], str)):
            raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init): give token ids.",
                           param="query")

        def tokenized() -> tuple[list[int], list[list[int]]]:
            query = tokenizer.encode(req.query, add_special_tokens=req.add_special_tokens) \
                if isinstance(req.query, str) else list(req.query)
            items = [tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else list(item)
                     for item in req.items]
            return query, items
        chars = len(req.query) if isinstance(req.query, str) else 0
        query, items = await h._run(tokenized, chars + sum(len(i) for i in req.items if isinstance(i, str)))
        room = h.engine.max_model_len - 1  # the label takes one position
        prompts = [((item + query) if req.item_first else (query + item))[:room] for item in items]
        if not all(prompts):  # the label's logprob needs a position before it
            raise APIError(400, "A query and item of no tokens at all leave nothing to score after.", param="items")
        h._admit(RequestCost(prompts=len(prompts) * len(req.label_token_ids), prompts_param="items",
                             prompt_tokens=sum(map(len, prompts)) * len(req.label_token_ids), output_tokens=0))
        return prompts


def _last_logprob(out) -> float:
    """The logprob of a prompt's last token (the label appended to it), as the model predicted it."""
    position = out.prompt_logprobs[-1]
    return position[out.prompt_token_ids[-1]].logprob


def _first_label_probability(logprobs: list[float], over_labels: bool) -> float:
    """The first label's probability: normalized over the labels alone, or the model's own over the vocabulary."""
    if not over_labels:
        return math.exp(logprobs[0])
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    return weights[0] / sum(weights)


# ---- the small ones ----

async def kv_event_sources() -> dict:
    """No KV-cache events are published (--kv-events-config is refused): no rank has a publisher."""
    return {}


async def is_scaling_elastic_ep() -> dict:
    return {"is_scaling_elastic_ep": False}


def scale_elastic_ep(data_parallel_size: int):
    """POST /scale_elastic_ep: the body checked as vLLM checks it; scaling to the size the server runs is a no-op,
    as in vLLM; any other a 400 (the data-parallel size is fixed when the server starts)."""
    async def scale(request: Request) -> Response:
        body = json_object_body(await request.body())
        size, drain = body.get("new_data_parallel_size"), body.get("drain_timeout", 120)
        if size is None:
            raise APIError(400, "new_data_parallel_size is required", param="new_data_parallel_size")
        if type(size) is not int or size <= 0:
            raise APIError(400, "new_data_parallel_size must be a positive integer", param="new_data_parallel_size")
        if type(drain) is not int or drain <= 0:
            raise APIError(400, "drain_timeout must be a positive integer", param="drain_timeout")
        if size != data_parallel_size:
            raise APIError(400, f"Elastic expert parallelism is not supported: this server's data-parallel size is "
                                f"fixed at {data_parallel_size} (--data-parallel-size); restart it with the new "
                                "size.", param="new_data_parallel_size")
        return JSONResponse({"message": f"Scaled to {size} data parallel engines"})
    return scale


async def scale_out_disabled() -> Response:
    return error_response(403, SCALE_OUT_DISABLED, "permission_error", code="scale_out_disabled")
