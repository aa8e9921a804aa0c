"""OpenAI's audio API as vLLM serves it: POST /v1/audio/transcriptions and /v1/audio/translations, a multipart form
with the clip (`file`) and its fields (protocol_audio.py), for an encoder-decoder speech model (Whisper).

The clip is decoded on the media threads under the server's MediaPolicy (multimodal/media.py: its duration limit
counted from the decoded samples), resampled to 16 kHz and cut into windows of at most 30 s at quiet points
(vLLM's chunking); each window is one engine request whose decoder prompt is Whisper's special tokens and whose
media item is the window's log-mel features (model/models/whisper.py's WhisperInputs). The windows run together and
their texts are joined in order. Without `language`, the first window's language is detected first (a one-token
request restricted to the language tokens), as vLLM does."""
from __future__ import annotations

import asyncio
import math
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.protocol import DeltaMessage, UsageInfo
from pressroom.entrypoints.openai.protocol_audio import (
    SERVED_FORMATS,
    AudioRequest,
    AudioSegment,
    AudioStreamChoice,
    AudioStreamResponse,
    TranscriptionRequest,
    TranscriptionResponse,
    TranscriptionUsageAudio,
    TranslationRequest,
    TranslationResponse,
    VerboseAudioResponse,
)
from pressroom.entrypoints.openai.serving import OpenAIServing, access_record, sse_data
from pressroom.multimodal import media as media_io
from pressroom.multimodal.inputs import MediaItem
from pressroom.outputs import RequestOutput
from pressroom.sampling_params import RequestOutputKind, SamplingParams

AUDIO_UPLOAD_BYTES = 25 << 20  # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB: an upload this large passes --max-request-bytes
TIME_PRECISION = 0.02  # seconds per Whisper timestamp token
FORM_FIELDS = 64  # form fields a request may send (OpenAI's take a dozen)


@dataclass(frozen=True, slots=True)
class Clip:
    """A decoded upload: its windows' media items and its duration."""
    items: list[MediaItem]
    seconds: float


class OpenAIServingAudio(OpenAIServing):
    """Transcriptions and translations. `media` (set by build_app): the server's MediaLoader, whose policy and
    threads decode the uploads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_request_bytes = max(self.max_request_bytes, AUDIO_UPLOAD_BYTES)
        self.media = None
        self._languages: dict[str, int] | None = None
        self.engine.engine.encoder_inputs()  # a speech model's feature extractor read at start, not on the event loop

    async def transcriptions(self, request: Request) -> Response:
        return await self._speech_to_text(request, TranscriptionRequest, "transcribe")

    async def translations(self, request: Request) -> Response:
        return await self._speech_to_text(request, TranslationRequest, "translate")

    # ---- one request ----

    async def _speech_to_text(self, request: Request, model: type[AudioRequest], task: str) -> Response:
        req, upload = await self._parse_form(request, model)
        if self._check_model(req.model) is not None:
            raise APIError(400, "LoRA adapters are not served for the audio API.", param="model")
        inputs = self._inputs()
        if req.response_format not in SERVED_FORMATS:
            raise APIError(400, f"response_format {req.response_format!r} is not supported; use one of "
                           f"{', '.join(SERVED_FORMATS)}.", param="response_format")
        if req.response_format == "verbose_json" and req.stream:
            raise APIError(400, "verbose_json is not streamed; drop stream or use json or text.",
                           param="response_format")
        language = self._language(req.language)
        clip = await self._decode(upload, inputs)
        rid = f"{'trsc' if task == 'transcribe' else 'trsl'}-{uuid.uuid4().hex}"
        if language is None:
            language = await self._detect_language(rid, clip.items[0])
        verbose = req.response_format == "verbose_json"
        prompt = await self._run(lambda: self._prompt(inputs, language, task, req.prompt, verbose), len(req.prompt))
        prompts = [prompt] * len(clip.items)
        params = self._params(req, len(prompts[0]), verbose)
        streams = await self._add(request, rid, prompts, clip.items, params)
        if req.stream:
            return self._sse(self._chunks(req, rid, task, streams, len(prompts[0])))
        outputs = [await _final(s) for s in streams]
        return self._response(req, task, language, clip.seconds, outputs, inputs)

    async def _parse_form(self, request: Request, model: type[AudioRequest]) -> tuple[AudioRequest, UploadFile]:
        """The form's fields as `model` and its `file` (a 400 for a body that is no such form)."""
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "The audio API takes a multipart/form-data body with the clip as `file`.")
        request._body = await self._read_body(request)  # held to the upload limit first; form() reads it from here
        try:
            form = await request.form(max_files=1, max_fields=FORM_FIELDS)
        except Exception as e:  # noqa: BLE001 — python-multipart's refusals of a client's malformed form
            raise APIError(400, f"The multipart form could not be read: {e}") from None
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "The form has no audio file: send the clip as the `file` field.", param="file")
        fields: dict = {k: v for k, v in form.multi_items() if isinstance(v, str) and not k.endswith("[]")}
        fields["timestamp_granularities[]"] = form.getlist("timestamp_granularities[]")
        try:
            return model.model_validate(fields), upload
        except ValidationError as e:
            raise APIError(400, _validation_message(e)) from None

    def _inputs(self):
        inputs = self.engine.engine.encoder_inputs()
        if inputs is None:
            raise APIError(400, f"The model `{self.names[0]}` does not serve the audio API: transcriptions and "
                           "translations take a speech model such as Whisper.", param="model")
        return inputs

    def _language(self, language: str | None) -> str | None:
        """The request's language code, checked against the tokenizer's language tokens (None: detect it)."""
        if not language:
            return None
        code = language.strip().lower()
        if code not in self._language_ids():
            raise APIError(400, f"Unsupported language {language!r}: give an ISO-639-1 code this model knows, such "
                           "as 'en', or leave language out to detect it.", param="language")
        return code

    def _language_ids(self) -> dict[str, int]:
        """Language code -> its token, for the languages the tokenizer has (read once)."""
        if self._languages is None:
            from transformers.models.whisper.tokenization_whisper import LANGUAGES
            tok = self.engine.tokenizer
            ids = {code: tok.convert_tokens_to_ids(f"<|{code}|>") for code in LANGUAGES}
            self._languages = {code: i for code, i in ids.items() if i is not None and i != tok.unk_token_id}
        return self._languages

    async def _decode(self, upload: UploadFile, inputs) -> Clip:
        """The upload decoded, resampled and cut into windows on the media threads (a 400 naming the limit or the
        fault for audio the policy refuses)."""
        data = await upload.read()

        def decode() -> Clip:
            samples, rate = media_io.decode_audio(data, self.media.policy)
            return Clip([inputs.item(w) for w in inputs.windows(samples, rate)], len(samples) / rate)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.media.pool, decode)
        except media_io.MediaError as e:
            raise APIError(400, str(e), param="file") from None

    async def _detect_language(self, rid: str, item: MediaItem) -> str:
        """The first window's language: Whisper's next token after <|startoftranscript|>, among the languages."""
        ids = self._language_ids()
        sot = self.engine.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=list(ids.values()),
                                output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        stream = await self._engine_add(f"{rid}-language", [sot], item, params)
        token = (await _final(stream)).outputs[0].token_ids[0]
        return next(code for code, i in ids.items() if i == token)

    def _prompt(self, inputs, language: str, task: str, prompt: str, verbose: bool) -> list[int]:
        try:
            ids = inputs.prompt_ids(language, task, prompt)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        if verbose:  # timestamps predicted: the prompt starts the first segment at 0.00 (vLLM's)
            ids[-1] = self._timestamp_base()
        return ids

    def _timestamp_base(self) -> int:
        token = self.engine.tokenizer.convert_tokens_to_ids("<|0.00|>")
        if token is None or token == self.engine.tokenizer.unk_token_id:
            raise APIError(400, "This model's tokenizer has no timestamp tokens: verbose_json is not served.",
                           param="response_format")
        return token

    def _params(self, req: AudioRequest, prompt_len: int, verbose: bool) -> SamplingParams:
        limit = self.engine.max_model_len
        room = limit - prompt_len
        if room < 1 or (req.max_completion_tokens or 0) > room:
            raise APIError(400, f"This model's decoder holds {limit} tokens: the prompt takes {prompt_len}, leaving "
                           f"{max(room, 0)} for the text; shorten the prompt or max_completion_tokens.",
                           param="max_completion_tokens", code="context_length_exceeded")
        try:
            params = req.to_sampling_params(req.max_completion_tokens or room)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return params.clone(logprobs=0) if verbose else params

    async def _engine_add(self, rid: str, prompt_ids: list[int], item: MediaItem, params: SamplingParams
                          ) -> AsyncIterator[RequestOutput]:
        try:
            added = await self.engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params, mm_features=[item])
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return self.stats.observe(added, params)

    async def _add(self, request: Request, rid: str, prompts: list[list[int]], items: list[MediaItem],
                   params: SamplingParams) -> list[AsyncIterator[RequestOutput]]:
        """Every window's request, or none (a refusal closes those added before it)."""
        record = access_record(request)
        record.request_id, record.prompt_tokens = rid, sum(len(p) for p in prompts)
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, (prompt, item) in enumerate(zip(prompts, items)):
                streams.append(await self._engine_add(f"{rid}-{i}", prompt, item, params))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    # ---- responses ----

    def _response(self, req: AudioRequest, task: str, language: str, seconds: float,
                  outputs: list[RequestOutput], inputs) -> Response:
        if req.response_format == "verbose_json":
            segments = [s for i, out in enumerate(outputs)
                        for s in self._segments(out, i * inputs.window_s, req.temperature)]
            segments = [s.model_copy(update={"id": i}) for i, s in enumerate(segments)]
            return VerboseAudioResponse(duration=str(seconds), language=language,
                                        text="".join(s.text for s in segments), segments=segments).model_dump()
        text = "".join(out.outputs[0].text for out in outputs)
        if req.response_format == "text":
            return PlainTextResponse(text)
        if task == "translate":
            return TranslationResponse(text=text).model_dump()
        usage = TranscriptionUsageAudio(seconds=math.ceil(seconds))  # OpenAI's: whole seconds, rounded up
        return TranscriptionResponse(text=text, usage=usage).model_dump()

    def _segments(self, out: RequestOutput, start_s: float, temperature: float) -> list[AudioSegment]:
        """The spans between pairs of timestamp tokens (Whisper closes a segment with one and opens the next with
        another), each with its text and mean token logprob; the window starts at <|0.00|>."""
        base, tok = self._timestamp_base(), self.engine.tokenizer
        completion = out.outputs[0]
        tokens, logprobs = list(completion.token_ids), completion.logprobs or []
        segments, opened, text_ids, lps = [], 0.0, [], []
        for i, token in enumerate(tokens):
            if token == tok.eos_token_id:
                break
            if token < base:
                text_ids.append(token)
                position = logprobs[i] if i < len(logprobs) else None
                lps.append(position[token].logprob if position and token in position else 0.0)
                continue
            if text_ids:
                text = tok.decode(text_ids, skip_special_tokens=True)
                raw = text.encode()
                segments.append(AudioSegment(
                    id=0, seek=int(start_s), start=start_s + opened, end=start_s + (token - base) * TIME_PRECISION,
                    text=text, tokens=text_ids, temperature=temperature, avg_logprob=sum(lps) / len(lps),
                    compression_ratio=len(raw) / len(zlib.compress(raw)) if raw else 0.0))
                text_ids, lps = [], []
            opened = (token - base) * TIME_PRECISION
        return segments

    async def _chunks(self, req: AudioRequest, rid: str, task: str, streams: list[AsyncIterator[RequestOutput]],
                      prompt_len: int) -> AsyncIterator[str]:
        """The windows' text deltas in order; the finish reason with the last window's last delta; usage as the
        flattened stream options ask."""
        kind = "transcription.chunk" if task == "transcribe" else "translation.chunk"
        created, name = int(time.time()), req.model or self.names[0]
        completion = 0
        prompt = prompt_len * len(streams)
        for i, stream in enumerate(streams):
            sent, tokens = 0, 0  # of this window's cumulative text and tokens
            async with aclosing(stream):
                async for out in stream:
                    piece = out.outputs[0]
                    completion += len(piece.token_ids) - tokens
                    tokens, delta, sent = len(piece.token_ids), piece.text[sent:], len(piece.text)
                    last = piece.finish_reason is not None and i == len(streams) - 1
                    if not delta and not last:
                        continue
                    choice = AudioStreamChoice(delta=DeltaMessage(content=delta),
                                               finish_reason=piece.finish_reason if last else None,
                                               stop_reason=piece.stop_reason if last else None)
                    chunk = AudioStreamResponse(id=rid, object=kind, created=created, model=name, choices=[choice])
                    if req.stream_continuous_usage_stats:
                        chunk.usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                                                total_tokens=prompt + completion)
                    yield sse_data(chunk)
        if req.stream_include_usage:
            usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            yield sse_data(AudioStreamResponse(id=rid, object=kind, created=created, model=name, choices=[],
                                               usage=usage))


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async with aclosing(stream):
        async for out in stream:
            last = out
    if last is None or not last.finished:
        raise APIError(503, "The engine ended the request before it finished.", "service_unavailable")
    return last


def _validation_message(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
