"""Request and response bodies of the OpenAI API, with vLLM's extra sampling fields.

Requests are validated three times: pydantic checks shapes, types and that every integer fits what the engine core
can receive (a 400 naming the field); a request's `cost()` (and `tokens_cost()` once its prompts are tokenized) is
judged against the server's admission limits (limits.py); and `to_sampling_params` builds a SamplingParams, whose
own checks give the range errors. Unknown fields are ignored, except those in a request's `unsupported_fields`:
OpenAI or vLLM features that pressroom does not implement, which get a 400 naming the field rather than an answer
that silently went without them.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, FailFast, Field, field_validator, model_serializer

from pressroom.core.structured_outputs import grammar_source
from pressroom.entrypoints.openai.limits import RequestCost
from pressroom.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams, truncated_prompt

MAX_TOP_LOGPROBS = 20  # beam search's bound: each step asks for 2 * n logprobs (the engine's MAX_LOGPROBS)
DEFAULT_COMPLETION_MAX_TOKENS = 16

# A request crosses to the engine core as msgpack, whose integers are int64 or uint64: an integer field outside
# these is a 400 naming it here, not an OverflowError (a 500) on the way to the core.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
EngineInt = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # SamplingParams checks what each one means
PRIORITY_MIN, PRIORITY_MAX = INT64_MIN, INT64_MAX
Priority = Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)]  # the scheduler's order: lower runs first
XargValue = str | int | float  # vLLM's vllm_xargs values (its integers checked to fit the core's messages)
# The sampler hashes any seed to 63 bits; the core receives int64 or uint64, as torch.Generator.manual_seed takes.
Seed = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]


class HashableFailFast(FailFast):
    __hash__ = object.__hash__  # (typing hashes a union's members, metadata included)


# A long list stops at its first bad element: pydantic otherwise reports every one (a million of them in an 8 MB
# body), and tries each member of a union whole: seconds of validation that hold the interpreter, event loop too.
Texts = Annotated[list[str], HashableFailFast()]
TokenIds = Annotated[list[int], HashableFailFast()]
Prompts = str | Texts | TokenIds | Annotated[list[TokenIds], HashableFailFast()]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# A field that is in use (per its test on the raw JSON value) but not implemented: (test, why it is refused).
Unsupported = dict[str, tuple[Callable[[Any], bool], str]]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # like vLLM: unknown fields are ignored, not fatal
    unsupported_fields: ClassVar[Unsupported] = {}

    def cost(self) -> RequestCost | None:
        """What the body asks of the server, judged against its admission limits (None: nothing to judge)."""
        return None

    @classmethod
    def raw_cost(cls, data: dict[str, Any]) -> RequestCost | None:
        """Its count of prompts, read from the parsed JSON and judged before the body is validated: pydantic takes
        about 1 us a prompt, seconds for the million one-token prompts 7 MB hold (None: nothing to judge)."""
        return None

    @classmethod
    def unsupported_field(cls, data: dict[str, Any]) -> tuple[str, str] | None:
        """The first field of `data` that asks for a feature pressroom lacks, with why; None if none does."""
        for name, (in_use, why) in cls.unsupported_fields.items():
            if name in data and in_use(data[name]):
                return name, why
        return None


def given_field(value: Any) -> bool:
    return value is not None


def nonempty_field(value: Any) -> bool:
    return bool(value)


def _not_none_choice(value: Any) -> bool:
    return value not in (None, "none")


def _not_text_only(value: Any) -> bool:
    return value is not None and value != ["text"]


def _input_count(value: str | list) -> int:
    """How many prompts a prompt or input field holds: one text or one list of token ids is one."""
    return 1 if isinstance(value, str) or (value and isinstance(value[0], int)) else len(value)


_GUIDED = "vLLM's older guided_* fields are not read; send `structured_outputs` (json, regex, choice, grammar)"
_SAMPLING_UNSUPPORTED: Unsupported = {
    **{name: (given_field, _GUIDED) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "prompt_embeds": (given_field, "prompt embeddings are not supported"),
}
_FUNCTIONS = "the deprecated `functions` API is not implemented; send `tools` and `tool_choice`"
_CHAT_UNSUPPORTED: Unsupported = {
    "functions": (nonempty_field, _FUNCTIONS),
    "function_call": (_not_none_choice, _FUNCTIONS),
    "audio": (given_field, "audio output is not supported"),
    "modalities": (_not_text_only, 'only ["text"] output is supported'),
    "prediction": (given_field, "predicted outputs are not supported"),
    "web_search_options": (given_field, "web search is not supported"),
    "use_beam_search": (nonempty_field, "beam search is served on /v1/completions, not on chat"),
}
# Fields that constrain the output, which beam search (vLLM's) does not apply: a 400 rather than an answer without them.
_NOT_UNDER_BEAM_SEARCH = ("stop", "stop_token_ids", "min_tokens", "logit_bias", "bad_words", "allowed_token_ids")


# ---- errors ----

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---- requests ----

class JsonSchemaFormat(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None  # the schema is always followed strictly


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` field: exactly one of json (a schema), regex, choice, grammar (EBNF) or
    json_object."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # `json` would shadow BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(OpenAIModel):
    model: str | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)  # the server's --max-n bounds it (limits.py)
    temperature: float | None = None
    top_p: float | None = None
    top_k: EngineInt | None = None
    min_p: float | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | Texts | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: EngineInt = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Priority | None = None
    session_id: str | None = Field(None, max_length=256)  # or the X-Session-Id header
    data_parallel_rank: EngineInt | None = None  # the engine core to serve it (vLLM's); or X-data-parallel-rank
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's extra fields, honoured as vLLM honours them
    spaces_between_special_tokens: bool = True
    allowed_token_ids: TokenIds | None = None
    bad_words: Texts | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1: max_model_len; SamplingParams checks
    return_token_ids: bool | None = None  # the response carries prompt_token_ids and each choice's token_ids
    # vLLM's: logprobs' tokens written "token_id:<id>" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each prompt position's logprob and its top n (whole responses only; --max-logprobs bounds n)
    prompt_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    vllm_xargs: dict[str, XargValue | list[XargValue]] | None = None  # SamplingParams.extra_args
    # vLLM's disaggregated serving: {"do_remote_decode": true} to a prefill engine, its returned params to a decode
    # engine (SamplingParams.extra_args["kv_transfer_params"], which the engine's KV connector reads)
    kv_transfer_params: dict[str, Any] | None = None

    prompt_param: ClassVar[str]  # the field that holds the prompt(s)

    @field_validator("cache_salt")
    @classmethod
    def salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return salt

    @field_validator("vllm_xargs")
    @classmethod
    def xargs_fit_int64(cls, xargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (xargs or {}).items():
            for item in value if isinstance(value, list) else [value]:
                if type(item) is int and not INT64_MIN <= item <= INT64_MAX:
                    raise ValueError(f"vllm_xargs[{key!r}]: integers must fit in 64 signed bits.")
        return xargs

    def refused_combination(self) -> tuple[str, str] | None:
        """(field, why) where the fields together ask for what vLLM refuses with a 400; None where they do not."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "Stream options can only be defined when `stream=True`."
        if self.stream and self.prompt_logprobs:  # a stream's chunks have no place for them (vLLM's rule too)
            return "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
        return None

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens keeps it (ValueError: more than max_model_len asked for)."""
        return truncated_prompt(token_ids, self.truncate_prompt_tokens, max_model_len)

    def prompt_dict(self, token_ids: list[int], text: str | None = None) -> dict[str, Any]:
        """The engine's prompt: its token ids, its text where it still says what they hold, and the cache salt."""
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if text is not None:
            prompt["prompt"] = text
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt

    def cost(self) -> RequestCost:
        """What the body asks for before its prompts are tokenized: samples, prompts, stop strings, logit_bias,
        the grammar and, when max_tokens is given, the output budget."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        prompts = self._prompt_count()
        max_tokens = self._max_tokens()
        return RequestCost(n=self.n, prompts=prompts, prompts_param=self.prompt_param, stop_strings=len(stop),
                           stop_chars=sum(map(len, stop)), logit_bias_entries=len(self.logit_bias or {}),
                           output_tokens=None if max_tokens is None else max(max_tokens, 0) * prompts,
                           output_param=self._max_tokens_param(), **self._grammar_cost())

    def tokens_cost(self, prompt_lens: Sequence[int], max_model_len: int) -> RequestCost:
        """What the tokenized prompts cost: their tokens and their output budgets (max_tokens, else what is left of
        the context, as the engine fills it in), each times n."""
        max_tokens = self._max_tokens()
        output = sum(max(max_model_len - p if max_tokens is None else max_tokens, 0) for p in prompt_lens)
        return RequestCost(n=self.n, prompts=len(prompt_lens), prompts_param=self.prompt_param,
                           prompt_tokens=sum(prompt_lens), output_tokens=output, output_param=self._max_tokens_param())

    def _prompt_count(self) -> int:
        return 1

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _max_tokens_param(self) -> str:
        return "max_tokens"

    def _grammar_cost(self) -> dict[str, Any]:
        """The characters of the grammar source the engine would parse, and the field that asked for it (none: 0;
        a constraint that is malformed, or nests past what json can write, is refused later by its own checks)."""
        param = "structured_outputs" if self.structured_outputs is not None else "response_format"
        try:
            constraint = self._structured_outputs()
            chars = 0 if constraint is None else len(grammar_source(constraint).text)
        except (ValueError, TypeError, RecursionError):
            chars = 0
        return {"grammar_chars": chars, "grammar_param": param}

    def _extra_args(self) -> dict[str, Any] | None:
        """SamplingParams.extra_args: vllm_xargs, and kv_transfer_params under its own key."""
        if self.kv_transfer_params is None:
            return self.vllm_xargs or None
        return {**(self.vllm_xargs or {}), "kv_transfer_params": self.kv_transfer_params}

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """`response_format` (OpenAI's) or `structured_outputs` (vLLM's) as one constraint; ValueError for both."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError("Give response_format or structured_outputs, not both.")
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object,
                                           disable_any_whitespace=so.disable_any_whitespace)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError('response_format {"type": "json_schema"} needs json_schema.schema.')
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    def _params(self, max_tokens: int | None, logprobs: int | None, **extra) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self._structured_outputs(),
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            extra_args=self._extra_args(),
            **extra,
        )


class CompletionRequest(_SamplingRequest):
    unsupported_fields: ClassVar[Unsupported] = _SAMPLING_UNSUPPORTED
    prompt_param: ClassVar[str] = "prompt"
    prompt: Prompts
    max_tokens: EngineInt | None = DEFAULT_COMPLETION_MAX_TOKENS  # null too: OpenAI's and vLLM's default
    logprobs: int | None = Field(None, ge=0, le=INT64_MAX)  # --max-logprobs bounds it (a 400 naming the limit)
    echo: bool = False
    suffix: str | None = None
    best_of: EngineInt | None = None
    use_beam_search: bool = False  # vLLM's: n beams of each prompt, best first
    length_penalty: float = 1.0  # beam search's: a beam's cumulative logprob over its length to this power

    @field_validator("max_tokens")
    @classmethod
    def null_is_the_default(cls, max_tokens: int | None) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens

    def _prompt_count(self) -> int:
        return _input_count(self.prompt)

    @classmethod
    def raw_cost(cls, data: dict[str, Any]) -> RequestCost | None:
        prompt = data.get("prompt")
        return RequestCost(prompts=_input_count(prompt)) if isinstance(prompt, list) else None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's and vLLM's): the answer is the prompt alone, e.g. to score it by its
        logprobs; one token is generated, and left out."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        # echo with logprobs shows the prompt's logprobs too: as many as `logprobs` unless prompt_logprobs says
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._params(1 if self.echo_only else max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs)

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """use_beam_search's parameters, as vLLM makes them (n beams; the temperature 1.0 where not given); a
        ValueError naming a field that beam search would not apply, or an n past what its steps can ask for."""
        ignored = [name for name in _NOT_UNDER_BEAM_SEARCH if getattr(self, name)]
        if self._structured_outputs() is not None:
            ignored.append("structured_outputs" if self.structured_outputs is not None else "response_format")
        if ignored:
            raise ValueError(f"{ignored[0]} is not applied by beam search (use_beam_search); leave it out.")
        if 2 * self.n > MAX_TOP_LOGPROBS:
            raise ValueError(f"use_beam_search takes n up to {MAX_TOP_LOGPROBS // 2} (each step asks for 2 * n "
                             f"logprobs of every beam, at most {MAX_TOP_LOGPROBS}); got n={self.n}.")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=1.0 if self.temperature is None else self.temperature,
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)


# ---- tools (OpenAI's shapes) ----

class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# OpenAI's media content parts (and vLLM's audio_url): the part's type -> its modality
MEDIA_PART_MODALITIES = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One media content part of a chat request, where it sits and what it names: a URL (image_url, audio_url,
    video_url) or base64 data in a format (input_audio). Loaded by serving_chat's media threads."""
    message: int  # the index of its message
    part: int  # its index in the message's content
    kind: str  # the part's type: a key of MEDIA_PART_MODALITIES
    url: str | None = None
    data: str | None = None
    audio_format: str | None = None

    @property
    def modality(self) -> str:
        return MEDIA_PART_MODALITIES[self.kind]

    @property
    def param(self) -> str:
        return f"messages.{self.message}.content"

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}] ({self.kind})"


def _media_part(message: int, index: int, part: dict[str, Any]) -> MediaPart:
    """A media content part's fields, or a ValueError naming what is missing. The URL parts take {"url": ...}
    (OpenAI's) or the URL string itself (as vLLM does)."""
    kind = part["type"]
    body = part.get(kind)
    if kind == "input_audio":
        if not isinstance(body, dict) or not isinstance(body.get("data"), str) or not isinstance(
                body.get("format", ""), str):
            raise ValueError('an input_audio part needs {"data": <base64>, "format": "wav"|"mp3"|"flac"|"ogg"}')
        return MediaPart(message, index, kind, data=body["data"], audio_format=body.get("format") or None)
    url = body.get("url") if isinstance(body, dict) else body
    if not isinstance(url, str) or not url:
        raise ValueError(f'the {kind} part needs {{"url": <a data:, http(s): or file: URL>}}')
    return MediaPart(message, index, kind, url=url)


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # name and the like reach the template as given
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def known_parts(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """Text parts, and media parts in their OpenAI shapes (their URLs and data are checked when loaded)."""
        for index, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type")
            if kind in MEDIA_PART_MODALITIES:
                _media_part(0, index, part)
            elif kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content parts may be text, {', '.join(MEDIA_PART_MODALITIES)}; got type {kind!r}")
        return content

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines; media parts are not text)."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content if part.get("type") == "text")
        return self.content or ""

    def media_parts(self, message: int) -> list[MediaPart]:
        """The message's media content parts, in order (`message`: its index in the request)."""
        if not isinstance(self.content, list):
            return []
        return [_media_part(message, index, part) for index, part in enumerate(self.content)
                if part.get("type") in MEDIA_PART_MODALITIES]


def media_parts(messages: Sequence[ChatMessage]) -> list[MediaPart]:
    """Every media content part of a conversation, in prompt order."""
    return [part for index, message in enumerate(messages) for part in message.media_parts(index)]


class TokenizeMessage(ChatMessage):
    """A message of /tokenize: text parts only. The media parts' tokens are the model's processor's to count,
    and no model pressroom serves takes media yet."""

    @field_validator("content")
    @classmethod
    def text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text":
                raise ValueError(f"/tokenize counts text content parts only; got type {part.get('type')!r}")
        return content


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_SamplingRequest):
    unsupported_fields: ClassVar[Unsupported] = _SAMPLING_UNSUPPORTED | _CHAT_UNSUPPORTED
    prompt_param: ClassVar[str] = "messages"
    messages: Annotated[list[ChatMessage], HashableFailFast()] = Field(min_length=1)
    max_tokens: EngineInt | None = None
    max_completion_tokens: EngineInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)  # --max-logprobs bounds it (a 400 naming the limit)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # template variables only; tokenizer arguments get a 400
    reasoning_effort: ReasoningEffort | None = None  # a chat template variable, for templates that take it
    thinking_token_budget: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1: vLLM's unlimited
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (OpenAI's default)
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the last message, when it is the answer's role, begins the answer

    def to_sampling_params(self, max_tokens: int | None, **extra) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs  # echo asks for them too, as vLLM does (the response carries them)
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.top_logprobs or 0
        return self._params(max_tokens, logprobs, thinking_token_budget=self.thinking_token_budget,
                            prompt_logprobs=prompt_logprobs, **extra)

    @property
    def answer_role(self) -> str:
        """The role the answer is given (vLLM's): the assistant's after a generation prompt, else the last
        message's, which the answer continues."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed(self) -> str:
        """What `echo` puts before each answer (vLLM's): the last message's text where it has the answer's role."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == self.answer_role else ""

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _max_tokens(self) -> int | None:
        return self.requested_max_tokens

    def _max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` when given
        (the field wins over a key of the same name in chat_template_kwargs)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[TokenizeMessage], HashableFailFast()] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # as in chat: needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # given to the chat template, as in chat

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)


# ---- responses ----

class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prompt's tokens read from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details (vLLM's)
    completion_tokens_details: CompletionTokensDetails | None = None


class PromptLogprob(BaseModel):
    """One token's entry at a prompt position (vLLM's Logprob as its responses write it)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position (the first None), token id -> its entry: the prompt's token, the top n
PromptLogprobs = list[dict[int, PromptLogprob] | None]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # return_token_ids (vLLM's): whole, both; streamed, the prompt's in a choice's first chunk and each chunk's new ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs, or echo with logprobs (vLLM's)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    service_tier: ServiceTier | None = None
    system_fingerprint: str | None = None  # whole responses; a stream's last chunk (vLLM's)
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV producer's, for the decode engine (vLLM's)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """OpenAI's message keys, null where pressroom has nothing to say, and vLLM 0.32's `reasoning` (its older
    `reasoning_content` is taken on input only)."""
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None


class _WithoutNulls(BaseModel):
    """Serialized without its unset (None) fields: a streamed tool call's deltas carry only what they say."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """OpenAI's streamed call: the first delta of call `index` has its id, type, name and empty arguments;
    the next ones only fragments of the arguments, which concatenate to the whole arguments text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids (vLLM's)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    service_tier: ServiceTier | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs or echo (vLLM's)
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM's)
    kv_transfer_params: dict[str, Any] | None = None  # a KV producer's, for the decode engine (vLLM's)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # vLLM 0.32's name
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the ids new in this chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # the last chunk's (vLLM's)
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pressroom"
    root: str | None = None
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None
    # what a chat message may carry to it: "text", and "image" or "audio" for a model that takes them (pressroom's;
    # the chat page offers its image button where "image" is listed)
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- pooling: /v1/embeddings (OpenAI), /pooling, /score, /rerank (vLLM) ----

# One text, several texts, one prompt's token ids or several prompts' token ids (OpenAI's accepted shapes).
PoolingInput = Prompts


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: EngineInt | None = None  # keep the first n dimensions, renormalised (Matryoshka)
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None = the model's pooling config
    priority: Priority | None = None

    def cost(self) -> RequestCost:
        return RequestCost(prompts=_input_count(self.input), prompts_param="input", generates=False)

    @classmethod
    def raw_cost(cls, data: dict[str, Any]) -> RequestCost | None:
        value = data.get("input")
        if not isinstance(value, list):
            return None
        return RequestCost(prompts=_input_count(value), prompts_param="input", generates=False)


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same input, the model's pooled vector as `data`."""


class ScoreRequest(OpenAIModel):
    """vLLM's /score: text_1 against each text_2 (one to many), or pairwise when both are lists of equal length."""
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: Priority | None = None

    def cost(self) -> RequestCost:
        left, right = _input_count(self.text_1), _input_count(self.text_2)
        return RequestCost(prompts=left + right, prompts_param="text_1" if left > right else "text_2",
                           generates=False)


class RerankRequest(OpenAIModel):
    """vLLM's /rerank (Jina / Cohere shape): the documents ordered by relevance to the query."""
    model: str | None = None
    query: str
    documents: list[str]
    top_n: EngineInt | None = None  # None or 0: every document
    return_documents: bool = True
    priority: Priority | None = None

    def cost(self) -> RequestCost:
        return RequestCost(prompts=1 + len(self.documents), prompts_param="documents", generates=False)


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
