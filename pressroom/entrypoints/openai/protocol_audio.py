"""The bodies of OpenAI's audio API as vLLM serves it (/v1/audio/transcriptions, /v1/audio/translations): the
request's form fields (the clip itself, `file`, is read apart from them) and the responses, whole and streamed."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pressroom.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, DeltaMessage, OpenAIModel, UsageInfo
from pressroom.sampling_params import RequestOutputKind, SamplingParams

AudioResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
SERVED_FORMATS = ("json", "text", "verbose_json")  # vLLM's: srt and vtt are refused by name


class AudioRequest(OpenAIModel):
    """A transcription's or translation's form fields (OpenAI's, then vLLM's extra sampling fields)."""
    model: str | None = None
    language: str | None = None  # ISO-639-1 of the clip's speech (None: detected from the clip)
    prompt: str = ""  # text the clip continues (Whisper's <|startofprev|> context)
    response_format: AudioResponseFormat = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    timestamp_granularities: list[Literal["word", "segment"]] = Field(default=[], alias="timestamp_granularities[]")
    stream: bool = False
    stream_include_usage: bool = False  # vLLM's flattened stream_options (form data has no objects)
    stream_continuous_usage_stats: bool = False
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    vllm_xargs: dict[str, Any] | None = None

    model_config = {**OpenAIModel.model_config, "populate_by_name": True}

    @field_validator("vllm_xargs", mode="before")
    @classmethod
    def _xargs_json(cls, value: Any) -> Any:
        """A form field is text: vllm_xargs comes as a JSON object."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"vllm_xargs must be a JSON object: {e}") from None
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> AudioRequest:
        for name in ("stream_include_usage", "stream_continuous_usage_stats"):
            if getattr(self, name) and not self.stream:
                raise ValueError(f"{name} is a stream option: it needs stream=true.")
        return self

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Greedy at temperature 0, as vLLM's audio requests are by default (its fallback to higher temperatures
        when a window's output looks wrong is not done)."""
        return SamplingParams(
            temperature=self.temperature, max_tokens=max_tokens, seed=self.seed,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            output_kind=RequestOutputKind.CUMULATIVE if self.stream else RequestOutputKind.FINAL_ONLY,
            extra_args=self.vllm_xargs)


class TranscriptionRequest(AudioRequest):
    pass


class TranslationRequest(AudioRequest):
    """Speech in any language into English text (Whisper's translate task)."""
    to_language: str | None = None  # vLLM's field; Whisper translates into English only


class TranscriptionUsageAudio(OpenAIModel):
    type: Literal["duration"] = "duration"
    seconds: int


class TranscriptionResponse(OpenAIModel):
    text: str
    usage: TranscriptionUsageAudio


class TranslationResponse(OpenAIModel):
    text: str


class AudioSegment(OpenAIModel):
    """A span of the output between two timestamp tokens (verbose_json)."""
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None = None  # not computed (vLLM's too)


class VerboseAudioResponse(OpenAIModel):
    duration: str
    language: str
    text: str
    segments: list[AudioSegment] | None = None
    words: list[dict] | None = None


class AudioStreamChoice(OpenAIModel):
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class AudioStreamResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"trsc-{uuid.uuid4().hex}")
    object: Literal["transcription.chunk", "translation.chunk"] = "transcription.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[AudioStreamChoice]
    usage: UsageInfo | None = None
