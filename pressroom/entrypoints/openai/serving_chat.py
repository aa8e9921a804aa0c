"""/v1/chat/completions: the chat template, n choices whole or streamed, logprobs, usage, (with a reasoning
parser) the split of the output into `reasoning` (vLLM 0.32's name) and `content`, tool calls read out of the
content (tools.py decides how, per request), and vLLM's extras: echo, prompt_logprobs, continuous usage."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from pressroom.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pressroom.entrypoints.openai.chat_template import Preprocessor
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.limits import AdmissionLimits
from pressroom.entrypoints.openai.metrics import ServerMetrics
from pressroom.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionTokensDetails,
    DeltaMessage,
    DeltaToolCall,
    MediaPart,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    media_parts,
    random_id,
)
from pressroom.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from pressroom.entrypoints.openai.serving import (
    ABORT,
    OpenAIServing,
    finite_logprob,
    json_response,
    output_values,
    prompt_logprobs_of,
    request_routing,
    running_usage,
    sse_data,
    stream_usage,
    top_logprobs,
)
from pressroom.entrypoints.openai.streams import collect_finals, merge_streams, raise_if_failed, with_disconnect
from pressroom.entrypoints.openai.tool_parsers import ToolCallStream, extract
from pressroom.entrypoints.openai.tool_parsers.base import markers_are_special
from pressroom.entrypoints.openai.tools import ToolPlan, plan_tools
from pressroom.multimodal import media as media_io
from pressroom.multimodal.chat import takes_phrase
from pressroom.multimodal.processor import supported_modalities
from pressroom.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pressroom.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pressroom")

MEDIA_THREADS = 8  # vLLM's VLLM_MEDIA_LOADING_THREAD_COUNT
PARTS_AT_ONCE = 4  # of one request: two requests at once fill the threads
_MODALITY_NOUNS = {"image": "images", "audio": "audio", "video": "video"}


@dataclass(frozen=True, slots=True)
class LoadedMedia:
    """A media part loaded and past the guards: a PIL image, (float32 samples, rate) or a video's ((frames, h, w, 3)
    uint8, metadata)."""
    part: MediaPart
    value: Any


def _load_part(part: MediaPart, policy: media_io.MediaPolicy) -> Any:
    if part.kind == "image_url":
        return media_io.load_image(part.url, policy)
    if part.kind == "input_audio":
        return media_io.load_audio_base64(part.data, part.audio_format, policy)
    if part.kind == "audio_url":
        return media_io.load_audio(part.url, policy)
    return media_io.load_video(part.url, policy, with_metadata=True)  # (frames, fps and the frames kept)


class MediaLoader:
    """A chat request's media parts fetched and decoded under the server's MediaPolicy, on threads of their own:
    never the event loop, nor the tokenizer's threads (a slow fetch holds one of these up to the fetch timeout).
    One request loads PARTS_AT_ONCE parts at a time, so that a prompt of many slow URLs queues behind itself
    rather than taking every thread from the requests after it; its first failure cancels the parts not started."""

    def __init__(self, policy: media_io.MediaPolicy | None = None, threads: int = MEDIA_THREADS) -> None:
        self.policy = policy or media_io.MediaPolicy()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pressroom-media")

    async def load(self, parts: list[MediaPart]) -> list[LoadedMedia]:
        """Every part loaded, in order; the first refusal a 400 naming the part and the limit. Too many parts of
        one modality (--limit-mm-per-prompt) are refused before any is loaded."""
        if not parts:
            return []
        counts: dict[str, int] = {}
        for part in parts:
            counts[part.modality] = counts.get(part.modality, 0) + 1
        try:
            media_io.check_counts(counts, self.policy)
        except media_io.MediaError as e:
            raise APIError(400, str(e), param="messages") from None
        gate = asyncio.Semaphore(PARTS_AT_ONCE)
        tasks = [asyncio.ensure_future(self._load_one(part, gate)) for part in parts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # after a failure (or the client's leaving): the parts not started never start
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _load_one(self, part: MediaPart, gate: asyncio.Semaphore) -> LoadedMedia:
        async with gate:
            load = functools.partial(_load_part, part, self.policy)
            try:
                return LoadedMedia(part, await asyncio.get_running_loop().run_in_executor(self.pool, load))
            except Exception as e:  # noqa: BLE001 — whatever a decoder raised on this part, it is this part's
                raise _media_error(part, e) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _media_error(part: MediaPart, error: Exception) -> APIError:
    """A part's failure as the client's 400 (a decoder's own exception on hostile bytes included)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, media_io.MediaError):
        return APIError(400, f"{part.where}: {error}", param=part.param)
    logger.warning("a %s part could not be decoded: %s: %s", part.kind, type(error).__name__, str(error)[:200])
    return APIError(400, f"{part.where}: the {part.modality} could not be decoded.", param=part.param)


class OpenAIServingChat(OpenAIServing):
    # vLLM refuses a required or named tool_choice on a server without --tool-call-parser on chat (and Messages),
    # not on its Responses API
    forced_tools_need_parser = True

    def __init__(self, engine: AsyncLLMEngine, names: list[str], stats: ServerMetrics, max_request_bytes: int,
                 preprocessor: Preprocessor, limits: AdmissionLimits, reasoning: ReasoningParser | None = None,
                 auto_tool_parser: type[ToolCallStream] | None = None) -> None:
        """`auto_tool_parser`: the --tool-call-parser of tool_choice "auto" (None: "auto" is a 400)."""
        super().__init__(engine, names, stats, max_request_bytes, preprocessor, limits)
        self.reasoning = reasoning
        self.auto_tool_parser = auto_tool_parser
        # --tool-call-parser given (set by build_app): a required or named tool_choice is refused without one, as vLLM
        # refuses it, though pressroom reads such calls as JSON
        self.tool_parser_named = auto_tool_parser is not None
        # e.g. DeepSeek's tool-call tags where a tokenizer marks them special: kept in the text the parser reads
        self._tool_markers_special = auto_tool_parser is not None and engine.tokenizer is not None \
            and markers_are_special(engine.tokenizer, auto_tool_parser.markers())
        if reasoning is not None:
            logger.info("reasoning parser: %s ... %s", reasoning.start, reasoning.end)
        self.media = MediaLoader()  # the server sets its own, under --allowed-media-domains and the like

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        rid = random_id("chatcmpl")
        run = await self.start(request, req, rid)
        model = req.model or self.names[0]
        if req.stream:
            return self._sse(self._chat_chunks(rid, model, req, run.stream, run.opens, run.tools, run.prompt_ids))
        out = (await with_disconnect(request, collect_finals([run.stream])))[0]

        def response() -> ChatCompletionResponse:
            choices = [self._choice(c, req, run.opens, run.tools) for c in out.outputs]
            if req.echoed:  # echo: the last message begins each answer (vLLM's)
                for choice in choices:
                    choice.message.content = req.echoed + (choice.message.content or "")
            return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=self._chat_usage(out, run.opens),
                                          system_fingerprint=self.system_fingerprint,
                                          prompt_logprobs=prompt_logprobs_of(out),
                                          prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
                                          kv_transfer_params=out.kv_transfer_params)
        return await json_response(response, "choices", output_values([out], req.top_logprobs))

    async def start(self, request: Request, req: ChatCompletionRequest, rid: str) -> ChatRun:
        """Adds the request to the engine as `rid`: its prompt rendered, its tools planned, its sampling params made.
        Also the way in of the Responses API (serving_responses.py), which reads the outputs its own way."""
        lora = self._check_model(req.model)
        self._check_combination(req)
        routing = request_routing(request, req)
        tools = plan_tools(req, self.auto_tool_parser, self.tool_parser_named or not self.forced_tools_need_parser)
        multi_modal_data = self.multi_modal_data(await self.media.load(media_parts(req.messages)))
        truncating = req.truncate_prompt_tokens is not None  # then only the kept tail counts against the context
        ids = await self._chat_ids(req.messages, req.add_generation_prompt, req.continue_final_message,
                                   req.template_kwargs, req.chat_template, tools.template_tools,
                                   max_tokens=None if truncating else self.engine.max_model_len)
        mm_features = None
        if multi_modal_data:  # the image processor on the media threads: placeholders expanded, pixels ready
            process = functools.partial(self.engine.engine.process_media, {"multi_modal_data": multi_modal_data},
                                        ids)
            try:
                ids, mm_features = await asyncio.get_running_loop().run_in_executor(self.media.pool, process)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        try:
            ids = req.truncated(ids, self.engine.max_model_len)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from None
        params = self._with_tool_schema(self._sampling_params(req, req.requested_max_tokens, ids, "messages"), tools)
        self._admit(req.tokens_cost([len(ids)], self.engine.max_model_len))
        if tools.auto and self._tool_markers_special:
            params = params.clone(skip_special_tokens=False)  # else the calls' tags vanish from the text
        parser = self.reasoning
        opens = parser is not None and parser.prompt_opens(ids)
        if parser is not None:
            if parser.markers_are_special:
                params = params.clone(skip_special_tokens=False)  # else the markers vanish from the text
            if params.thinking_token_budget is not None and params.think_end_token_ids is None:
                params = params.clone(think_start_token_ids=parser.start_ids, think_end_token_ids=parser.end_ids)
        prompt = req.prompt_dict(ids)
        streams = await self._add_all(request, rid, [(prompt, params)], routing, lora, mm_features)
        return ChatRun(streams[0], ids, opens, tools)

    def multi_modal_data(self, media: list[LoadedMedia]) -> dict[str, list[Any]]:
        """The hand-off to the engine: the request's media, loaded and past the guards, as the engine prompt's
        `multi_modal_data` (vLLM's form: modality -> its items in prompt order; an image a PIL RGB image, audio
        (float32 mono samples, sample rate), a video ((frames, height, width, 3) uint8, its metadata)). Media of a
        modality the model does not take is a 400 here, naming the first such item and the model (its chat
        template renders each taken part's placeholder)."""
        data: dict[str, list[Any]] = {}
        for item in media:
            data.setdefault(item.part.modality, []).append(item.value)
        takes = supported_modalities(self.engine.engine.hf_config)
        refused = next((item.part for item in media if item.part.modality not in takes), None)
        if refused is not None:
            raise APIError(400, f"{refused.where}: this model takes no {_MODALITY_NOUNS[refused.modality]}; "
                                f"{self.names[0]!r} takes {takes_phrase(takes)}.", param=refused.param)
        return data

    @staticmethod
    def _with_tool_schema(params: SamplingParams, tools: ToolPlan) -> SamplingParams:
        """A forced tool choice constrains the output to its calls' JSON schema."""
        if tools.schema is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(400, "A required or named `tool_choice` constrains the output to the tool calls' JSON; "
                                "it cannot be combined with response_format or structured_outputs.",
                           param="tool_choice")
        return params.clone(structured_outputs=StructuredOutputsParams(json=tools.schema))

    def _choice(self, c: CompletionOutput, req: ChatCompletionRequest, opens: bool, tools: ToolPlan) -> ChatChoice:
        reasoning, content = self.reasoning.split(c.text, opens) if self.reasoning is not None else (None, c.text)
        calls = None
        if tools.make_stream is not None:
            found = extract(tools.make_stream(), content)
            content, calls = found.content, found.calls or None
        message = ChatResponseMessage(role=req.answer_role, content=content, reasoning=reasoning, tool_calls=calls)
        return ChatChoice(
            index=c.index, message=message,
            logprobs=self._chat_logprobs(c.token_ids, c.logprobs, req) if req.logprobs else None,
            finish_reason=_finish_reason(c.finish_reason, bool(calls)), stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if req.return_token_ids else None)

    def _chat_usage(self, out: RequestOutput, opens: bool) -> UsageInfo:
        usage = self._usage([out])
        if self.reasoning is not None:
            reasoning = sum(self.reasoning.count_reasoning_tokens(c.token_ids, opens) for c in out.outputs)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning)
        return usage

    def _chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None,
                       req: ChatCompletionRequest) -> ChatLogprobs:
        content, as_id = [], self._as_ids(req)
        for token, position in zip(token_ids, positions or []):
            text = self._token_text(token, position)  # its bytes are the token's own, whatever it is written as
            top = [TopLogprob(token=self._token_text(t, position, as_id), logprob=finite_logprob(p.logprob),
                              bytes=list(self._token_text(t, position, as_id).encode()))
                   for t, p in top_logprobs(position, req.top_logprobs or 0)]
            content.append(TokenLogprob(token=self._token_text(token, position, as_id),
                                        logprob=finite_logprob(position[token].logprob),
                                        bytes=list(text.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)

    async def _chat_chunks(self, rid: str, model: str, req: ChatCompletionRequest,
                           stream: AsyncIterator[RequestOutput], opens: bool = False,
                           tools: ToolPlan | None = None, prompt_ids: list[int] | None = None) -> AsyncIterator[str]:
        """`prompt_ids`: the prompt's token ids, which return_token_ids sends in the first chunk (vLLM's)."""
        created = int(time.time())
        usage_at_end, usage_each = stream_usage(req, self.force_include_usage)
        prompt_tokens = len(prompt_ids or [])
        progress = [_ChoiceProgress() for _ in range(req.n)]

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            """A chunk; with continuous_usage_stats, each choice's chunk carries the usage so far of that choice;
            a choice's last chunk carries the fingerprint unless a usage chunk follows (vLLM's)."""
            if usage is None and usage_each and choices:
                usage = running_usage(prompt_tokens, progress[choices[0].index].token_ids)
            last = not usage_at_end and any(c.finish_reason is not None for c in choices)
            return sse_data(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage,
                                                system_fingerprint=self.system_fingerprint if last else None,
                                                prompt_token_ids=prompt_token_ids))

        role = req.answer_role
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role=role, content=""))
                     for i in range(req.n)], prompt_token_ids=list(prompt_ids or []) if req.return_token_ids else None)
        if req.echoed:  # echo: the last message first, one chunk a choice (vLLM's)
            for i in range(req.n):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=req.echoed))])
        splitters = [self.reasoning.stream(opens) for _ in range(req.n)] if self.reasoning is not None else None
        callers = [tools.make_stream() for _ in range(req.n)] if tools and tools.make_stream else None
        final = None
        try:
            async for _, out in merge_streams([stream]):
                for c in out.outputs:
                    for choice in self._choice_chunk_choices(c, req, progress[c.index], splitters, callers):
                        yield chunk([choice])
                if out.finished:
                    final = out
        except EngineDeadError:  # the engine ended the request (shutdown's grace period over, or the core died)
            for i in range(req.n):  # each open choice gets its finish reason; the error event follows (_sse)
                if not progress[i].done:  # what a marker or a call held back goes first
                    deltas = _delta_messages(*split_delta("", True, splitters, callers, i))
                    for k, d in enumerate(deltas):
                        yield chunk([ChatChunkChoice(index=i, delta=d,
                                                     finish_reason=ABORT if k == len(deltas) - 1 else None)])
            raise
        if final is not None:
            raise_if_failed([final])  # a choice ended with "error": the error event follows (_sse)
        if usage_at_end and final is not None:
            yield sse_data(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                               usage=self._chat_usage(final, opens),
                                               system_fingerprint=self.system_fingerprint))


    def _choice_chunk_choices(self, c: CompletionOutput, req: ChatCompletionRequest, sent: _ChoiceProgress,
                              splitters: list[ReasoningStream] | None, callers: list[ToolCallStream] | None
                              ) -> list[ChatChunkChoice]:
        """What one choice's new output sends (one chunk each; none while all of it is held back), `sent`
        advanced past it."""
        if sent.done:
            return []
        delta = c.text[sent.text:]
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            logprobs = self._chat_logprobs(c.token_ids[sent.logprobs:], c.logprobs[sent.logprobs:], req)
            sent.logprobs = len(c.token_ids)
        if not delta and c.finish_reason is None and not (logprobs and logprobs.content):
            return []
        sent.text, sent.done = len(c.text), c.finish_reason is not None
        # reasoning first, then content, then calls; a marker or a call split across chunks is held back until whole
        reasoning, content, calls = split_delta(delta, sent.done, splitters, callers, c.index)
        if not (reasoning or content or calls or sent.done or (logprobs and logprobs.content)):
            return []  # all held back: nothing to send yet
        deltas = _delta_messages(reasoning, content, calls)
        finish = _finish_reason(c.finish_reason, callers is not None and callers[c.index].calls_begun > 0)
        # the ids new since the last chunk sent (held-back text keeps its ids for the chunk that sends it)
        new_ids = list(c.token_ids[sent.token_ids:]) if req.return_token_ids else None
        sent.token_ids = len(c.token_ids)
        last = len(deltas) - 1
        return [ChatChunkChoice(index=c.index, delta=d, logprobs=logprobs if k == 0 else None,
                                finish_reason=finish if k == last else None,
                                stop_reason=c.stop_reason if k == last else None,
                                token_ids=new_ids if k == 0 else None) for k, d in enumerate(deltas)]


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request in the engine: its output stream, its prompt's token ids, whether the prompt opened a
    reasoning span, and its tool plan (how its outputs are read)."""
    stream: AsyncIterator[RequestOutput]
    prompt_ids: list[int]
    opens: bool
    tools: ToolPlan


@dataclass(slots=True)
class _ChoiceProgress:
    """How much of one streamed choice has gone out: text characters, logprob positions, token ids."""
    text: int = 0
    logprobs: int = 0
    token_ids: int = 0
    done: bool = False

def split_delta(delta: str, done: bool, splitters: list[ReasoningStream] | None,
                callers: list[ToolCallStream] | None, i: int) -> tuple[str, str, list[DeltaToolCall]]:
    """(reasoning, content, tool-call deltas) of choice i's new text; `done`: its output ended (flush)."""
    reasoning, content = "", delta
    if splitters is not None:
        reasoning, content = splitters[i].feed(delta)
        if done:
            r_rest, c_rest = splitters[i].finish()
            reasoning, content = reasoning + r_rest, content + c_rest
    calls: list[DeltaToolCall] = []
    if callers is not None:
        parts = [callers[i].feed(content)] + ([callers[i].finish()] if done else [])
        content, calls = "".join(p.content for p in parts), [c for p in parts for c in p.calls]
    return reasoning, content, calls


def _delta_messages(reasoning: str, content: str, calls: list[DeltaToolCall]) -> list[DeltaMessage]:
    """One delta per chunk: the reasoning, the content (always one, if nothing else), then each tool-call delta."""
    deltas = [DeltaMessage(reasoning=reasoning)] if reasoning else []
    if content or not (deltas or calls):
        deltas.append(DeltaMessage(content=content))
    return deltas + [DeltaMessage(tool_calls=[call]) for call in calls]


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that stopped after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_request_from(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request (Responses, Messages) becomes; a 400 naming the field where the chat's
    rules refuse it."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"Invalid request (as the chat request it becomes): {param}: {first['msg']}",
                       param=param) from None
