"""Chat prompts from client input, away from the engine: the template is rendered to text in worker processes
(template_worker.py) under a time, size and memory limit, and the text is tokenized with fixed arguments on a
small thread pool of the API process. Structured outputs' grammars are parsed and compiled the same way, in
workers of their own (core/structured_outputs.py's GrammarSandbox).

`chat_template_kwargs` are template variables only (as vLLM resolves them): the tokenizer's own arguments
(padding, truncation, max_length, return_tensors, ...) never come from a request. A request's own
`chat_template` needs a server started with --trust-request-chat-template.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from pressroom.core.structured_outputs import MAX_SOURCE_CHARS, GrammarSandbox, check_limits
from pressroom.entrypoints.openai import template_worker
from pressroom.entrypoints.openai.errors import APIError
from pressroom.logger import printable
from pressroom.sampling_params import StructuredOutputsParams
from pressroom.sandbox import PoolBusy, WorkerError, WorkerFailed, WorkerPool, WorkerTimeout, job_line

logger = logging.getLogger("pressroom")

T = TypeVar("T")

RENDER_TIMEOUT_S = 3.0  # a model's own template renders in milliseconds; a loop bomb gets a 400 after this
WORKER_MEMORY_BYTES = 2 << 30  # a template's allocations beyond these fail in the worker (MemoryError: a 400)
RENDER_WORKERS = 2
TOKENIZER_THREADS = 2
# Tokenizer work on a long input (past BIG_JOB_CHARS characters, or a body past as many bytes) runs on a lane of
# its own, so that short prompts never queue behind a long one.
BIG_JOB_CHARS = 1 << 16
BIG_LANE_THREADS = 1
MESSAGES_ON_LOOP = 1024  # a conversation longer than this is turned into the template's dicts on the big lane
# A prompt far past the context is refused from a prefix: max_tokens x this many characters first (text runs
# some 4 characters a token), doubled while it stays under twice max_tokens tokens.
PREFIX_CHARS_PER_TOKEN = 16
WAIT_FOR_WORKER_S = 10.0  # every worker busy this long: the server is overloaded (503), not the request wrong

# apply_chat_template's and the tokenizer's own arguments: a request that sets one through chat_template_kwargs
# gets a 400 naming it (they allocated terabytes or panicked the Rust tokenizer when passed through).
TOKENIZER_ARGUMENTS = frozenset({
    "conversation", "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "sanitize_control_tokens",
    "add_special_tokens", "padding_side", "pad_to_multiple_of", "stride", "is_split_into_words", "text",
    "text_pair", "split_special_tokens", "return_attention_mask", "return_token_type_ids", "return_length",
    "return_overflowing_tokens", "return_special_tokens_mask", "return_offsets_mapping", "verbose",
})
RESERVED_VARIABLES = ("messages",)  # filled from the request's own field
FLAG_VARIABLES = ("add_generation_prompt", "continue_final_message")  # may override the request's fields, as in vLLM
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as template variables; a 400 naming any key that is not one."""
    variables = dict(kwargs or {})
    for key in variables:
        where = f"chat_template_kwargs.{key}"
        if key in TOKENIZER_ARGUMENTS:
            hint = " (send `chat_template` as a request field)" if key == "chat_template" else ""
            raise APIError(400, f"`{where}` is a tokenizer argument, not a chat template variable; the server "
                                f"sets the tokenizer's arguments itself{hint}.", param=where)
        if key in RESERVED_VARIABLES:
            raise APIError(400, f"`{where}` is not allowed: the conversation is the request's `messages`.",
                           param=where)
        if key in FLAG_VARIABLES and not isinstance(variables[key], bool):
            raise APIError(400, f"`{where}` must be a boolean.", param=where)
    return variables


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers gives them to a template: keys whose value is None dropped, reasoning under
    each name templates read it by, and tool calls' arguments as objects (templates write them with tojson)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_with_argument_object(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _with_argument_object(call: dict) -> dict:
    """The call with its `function.arguments` JSON text decoded (text that is not a JSON object stays text)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (json.JSONDecodeError, RecursionError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class TemplateRenderer:
    """A few template worker processes (a sandbox.WorkerPool). A render that overruns RENDER_TIMEOUT_S kills its
    worker (a replacement starts), so a template that loops, recurses or allocates costs the server one worker
    for that long at most."""

    def __init__(self, max_chars: int, workers: int = RENDER_WORKERS, timeout_s: float = RENDER_TIMEOUT_S,
                 max_bytes: int = WORKER_MEMORY_BYTES) -> None:
        self.timeout_s = timeout_s
        self.pool = WorkerPool(Path(template_worker.__file__), [max_chars], size=workers, timeout_s=timeout_s,
                               max_bytes=max_bytes, wait_s=WAIT_FOR_WORKER_S)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    async def render(self, template: str, messages: list[dict], variables: dict[str, Any],
                     add_generation_prompt: bool, continue_final_message: bool) -> str:
        job = _job(template, messages, variables, add_generation_prompt, continue_final_message)
        try:
            reply = await self.pool.ask(job)
        except PoolBusy:
            raise APIError(503, "Every chat template worker is busy; retry shortly.", "service_unavailable") from None
        except WorkerTimeout:
            raise APIError(400, f"The chat template took longer than {self.timeout_s:g} s to render.",
                           param="messages") from None
        except WorkerFailed:
            raise APIError(400, "The chat template could not be rendered (its worker failed).",
                           param="messages") from None
        if "error" in reply:
            raise APIError(400, f"The chat template failed: {reply['error']}", param="messages")
        return reply["text"]


def _job(template: str, messages: list[dict], variables: dict[str, Any], add_generation_prompt: bool,
         continue_final_message: bool) -> bytes:
    job = {"template": template, "messages": messages, "variables": variables,
           "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    try:
        return job_line(job)
    except (RecursionError, ValueError):
        raise APIError(400, "The messages or chat_template_kwargs nest too deeply.", param="messages") from None


def encode_within(encode: Callable[[str], list[int]], text: str, max_tokens: int, param: str) -> list[int]:
    """`encode(text)`, or a 400 for length found from a prefix of `text` when that alone has twice `max_tokens`
    tokens or more: a prompt of megabytes costs the tokenizer a few times the context, not the whole text. Twice:
    a prefix cut mid-word may count a few more tokens than its characters take within the whole text."""
    chars = max_tokens * PREFIX_CHARS_PER_TOKEN
    while 2 * chars < len(text):
        count = len(encode(text[:chars]))
        if count >= 2 * max_tokens:
            raise APIError(400, f"This model's maximum context length is {max_tokens} tokens, and the prompt has "
                                f"more (its first {chars} characters alone are {count} tokens); shorten the prompt.",
                           param=param, code="context_length_exceeded")
        chars *= 2
    return encode(text)


class Preprocessor:
    """Prompt work of the API process: chat templates and structured outputs' grammars in worker processes,
    tokenizer calls on a small thread pool (never on the engine loop, never on the event loop), in two lanes: long
    inputs on one thread of their own, so that they never hold up short ones."""

    def __init__(self, tokenizer, max_chars: int, trust_request_chat_template: bool = False,
                 renderer: TemplateRenderer | None = None, grammars: GrammarSandbox | None = None,
                 max_grammar_chars: int = MAX_SOURCE_CHARS, chat_template: str | None = None,
                 default_template_kwargs: dict[str, Any] | None = None) -> None:
        """`chat_template`: the server's (--chat-template) in place of the tokenizer's; `default_template_kwargs`
        (--default-chat-template-kwargs): template variables every request has unless it sets them."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        try:
            self.default_template_kwargs = template_variables(default_template_kwargs or {})
        except APIError as e:
            raise ValueError(f"--default-chat-template-kwargs: {e}") from None
        # the template's special-token variables (bos_token, ...), as plain JSON for the workers
        special = getattr(tokenizer, "special_tokens_map", None) or {}
        self.special_tokens = json.loads(json.dumps(dict(special), default=str))
        self.trust_request_chat_template = trust_request_chat_template
        self.renderer = renderer or TemplateRenderer(max_chars)
        self.grammars = grammars or GrammarSandbox(tokenizer)
        self.max_grammar_chars = max_grammar_chars
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pressroom-tokenizer")
        self.big_pool = ThreadPoolExecutor(BIG_LANE_THREADS, thread_name_prefix="pressroom-tokenizer-big")

    async def start(self) -> None:
        await self.renderer.start()

    async def close(self) -> None:
        await self.renderer.close()
        await self.grammars.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.big_pool.shutdown(wait=False, cancel_futures=True)

    async def structured_outputs(self, params: StructuredOutputsParams, vocab_size: int) -> StructuredOutputsParams:
        """The constraint checked against the limits (on the tokenizer threads), then parsed and compiled in the
        grammar sandbox: returned with its parsed grammar, which the engine core compiles without parsing it
        again. A 400 naming the limit or cap it exceeds, or why it cannot be compiled. `vocab_size`: the model's."""
        try:
            source = await self.run(functools.partial(check_limits, params, self.max_grammar_chars))
        except APIError as e:
            raise APIError(e.status, e.message, param="structured_outputs") from None
        try:
            parsed = await self.grammars.parsed(source, vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="structured_outputs") from None
        except PoolBusy:
            raise APIError(503, "Every structured-output grammar worker is busy; retry shortly.",
                           "service_unavailable") from None
        except WorkerError:
            logger.exception("the structured-output grammar workers could not start")
            raise APIError(503, "Structured outputs are unavailable: the grammar workers could not start.",
                           "service_unavailable") from None
        return replace(params, parsed_grammar=parsed)

    async def run(self, fn: Callable[[], T], chars: int = 0) -> T:
        """`fn`, tokenizer work on a request's input, on the tokenizer threads (`chars`, the input's size: past
        BIG_JOB_CHARS, on the big lane). Its failure is the client's (a 400): an APIError as raised, a ValueError,
        TypeError or KeyError with its message; any other exception, a panic of the Rust tokenizer (pyo3's
        PanicException, a BaseException) included, with a generic one."""
        pool = self.big_pool if chars > BIG_JOB_CHARS else self.pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        except APIError:
            raise
        except (ValueError, TypeError, KeyError, OverflowError) as e:
            raise APIError(400, _client_message(e)) from None
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 — whatever the tokenizer raised on this input, it is this input's
            logger.warning("the tokenizer failed on a request's input: %s: %s", type(e).__name__,
                           printable(_client_message(e)))
            raise APIError(400, "The tokenizer could not process the request's input.") from None

    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                       kwargs: dict[str, Any] | None, request_template: str | None = None,
                       tools: list[dict] | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of the conversation rendered by the chat template (the model's, or the request's when the
        server trusts request templates); `tools`, the request's tool definitions, are its `tools` variable. A
        rendering far past `max_tokens` (the context) is a 400 for length after a prefix of it (encode_within)."""
        variables = self.default_template_kwargs | template_variables(kwargs) | ({"tools": tools} if tools else {})
        add_generation_prompt = variables.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = variables.pop("continue_final_message", continue_final_message)
        template = self._template(request_template)
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # continuing the last message: no new assistant header after it
        if len(messages) <= MESSAGES_ON_LOOP:
            messages = template_messages(messages)
        else:
            messages = await self.run(functools.partial(template_messages, messages), BIG_JOB_CHARS + 1)
        text = await self.renderer.render(template, messages, self.special_tokens | variables,
                                          add_generation_prompt, continue_final_message)
        tok = self.tokenizer

        def encode(part: str) -> list[int]:
            return list(tok.encode(part, add_special_tokens=False))
        if max_tokens is None:
            return await self.run(functools.partial(encode, text), len(text))
        return await self.run(functools.partial(encode_within, encode, text, max_tokens, "messages"), len(text))

    def _template(self, request_template: str | None) -> str:
        if request_template is not None:
            if not self.trust_request_chat_template:
                raise APIError(400, "This server does not accept a chat template from the request (start it with "
                                    "--trust-request-chat-template to allow that).", param="chat_template")
            return request_template
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one, as transformers picks it
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.",
                           param="messages")
        return template


def _client_message(e: Exception) -> str:
    """An exception's message for a client: its first line, at most 300 characters, without object reprs
    (which carry install paths)."""
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    if " object at 0x" in message or "/site-packages/" in message or "PreTrainedTokenizer" in message:
        message = f"{type(e).__name__} while processing the request's input"
    return message[:300]
