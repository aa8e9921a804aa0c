"""Structured outputs (xgrammar): a request's constraint as grammar source, checked by the front-end and
compiled once per source, off the engine's loop.

The front-end (`check`) parses the source without a tokenizer, so a bad schema, regex or grammar is a
ValueError (a 400 that names the reason) before anything is queued. The engine core's `GrammarCompiler`
compiles it against the tokenizer on a small thread pool (xgrammar releases the GIL while it compiles),
one future per source in an LRU, and the scheduler leaves the request in the queue until its future is
done (vLLM's WAITING_FOR_FSM) while the other requests run. The model runner matches each request's tokens
against the compiled grammar and masks its logits (worker/grammar.py).
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from pressroom.sampling_params import StructuredOutputsParams

# What a client can make the compiler do: the grammar source's length (a schema's JSON text), and how long a
# request waits for its compile before it ends with an error (xgrammar cannot cancel one; the LRU keeps its
# result for the next request with the same source).
MAX_SOURCE_CHARS = 64 * 1024
# Repetition bounds ({m,n} in a regex, a schema's pattern or EBNF): xgrammar expands them, and a schema pattern
# of [a-z]{1,30000} took a minute to parse (one of {1,1000}: 0.05 s).
MAX_REPEAT, MAX_REPEAT_TOTAL = 1000, 4000
COMPILE_TIMEOUT_S = 60.0
CACHE_SIZE = 256
# Whitespace between JSON tokens, where any is allowed: a small model can otherwise emit newlines until max_tokens.
MAX_JSON_WHITESPACE = 20
COMPILE_THREADS = 2


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """What is compiled, and the cache's key: `kind` is json (a schema's text), regex or ebnf."""
    kind: str
    text: str
    any_whitespace: bool = True


def grammar_source(params: StructuredOutputsParams) -> GrammarSource:
    """The constraint as one grammar source; `choice` becomes an EBNF alternation of string literals."""
    any_ws = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        text = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return GrammarSource("json", text, any_ws)
    if kind == "json_object":  # any JSON object (OpenAI's JSON mode)
        return GrammarSource("json", '{"type": "object"}', any_ws)
    if kind == "choice":  # JSON's string escapes are the EBNF literal's
        return GrammarSource("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
    if kind == "regex":
        return GrammarSource("regex", params.regex)
    return GrammarSource("ebnf", params.grammar)


def check(params: StructuredOutputsParams) -> GrammarSource:
    """The request's grammar source, parsed once; ValueError naming what is wrong with it."""
    source = grammar_source(params)
    if len(source.text) > MAX_SOURCE_CHARS:
        raise ValueError(f"The structured output's {source.kind} is {len(source.text)} characters long; the limit "
                         f"is {MAX_SOURCE_CHARS}.")
    _check_repetitions(source)
    _parse(source)
    return source


_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_repetitions(source: GrammarSource) -> None:
    bounds = [int(n) for match in _REPEAT.finditer(source.text) for n in match.groups() if n]
    if bounds and (max(bounds) > MAX_REPEAT or sum(bounds) > MAX_REPEAT_TOTAL):
        raise ValueError(f"The structured output's {_NAMES[source.kind]} repeats too much: each {{m,n}} bound must be "
                         f"at most {MAX_REPEAT}, and all of them together at most {MAX_REPEAT_TOTAL}.")


@functools.lru_cache(maxsize=CACHE_SIZE)
def _parse(source: GrammarSource) -> xgr.Grammar:
    try:
        if source.kind == "json":
            whitespace = MAX_JSON_WHITESPACE if source.any_whitespace else None
            return xgr.Grammar.from_json_schema(source.text, any_whitespace=source.any_whitespace,
                                                max_whitespace_cnt=whitespace)
        if source.kind == "regex":
            return xgr.Grammar.from_regex(source.text)
        return xgr.Grammar.from_ebnf(source.text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"Invalid structured output {_NAMES[source.kind]}: {_reason(e)}") from None


_NAMES = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar (EBNF)"}
# xgrammar's messages start with a timestamp, its source location and the failed check's expression.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(error: Exception) -> str:
    return _NOISE.sub("", str(error)).strip()


class GrammarCompiler:
    """Compiles grammar sources against the tokenizer on a thread pool, once per source (an LRU of futures,
    so requests with one schema share one compile). The tokenizer is loaded on the pool at the first compile:
    an engine that never constrains never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_id: int | None,
                 portable: bool = False) -> None:
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's). `portable`: the
        workers are other processes, which a compiled grammar cannot reach (it does not pickle); compiles
        then give xgrammar's JSON of it, serialized on the pool, which a worker reads back with the
        tokenizer info (`tokenizer_info_json`)."""
        self._load_tokenizer, self._vocab_size, self._eos = load_tokenizer, vocab_size, eos_token_id
        self.portable = portable
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pressroom-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarSource, Future[xgr.CompiledGrammar | str]] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar | str]:
        """The compiled grammar, or its compile in progress; a new source starts compiling."""
        source = grammar_source(params)
        future = self._cache.get(source)
        if future is None:
            future = self._pool.submit(self._compile, source)
            self._cache[source] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(source)
        return future

    def _compile(self, source: GrammarSource) -> xgr.CompiledGrammar | str:
        compiled = self._xgr_compiler().compile_grammar(_parse(source))
        return compiled.serialize_json() if self.portable else compiled

    def tokenizer_info_json(self) -> str:
        """The tokenizer info portable grammars are read with (built by the first compile)."""
        self._xgr_compiler()
        return self._info.serialize_json()

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                stop = [self._eos] if self._eos is not None else None
                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self._vocab_size,
                                                          stop_token_ids=stop)
                # our LRU holds the compiled grammars: xgrammar's own cache would keep a second copy
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
                self._info = info
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_ready(future: Future | None) -> bool:
    """Whether a request may be scheduled: no grammar, or one compiled without error."""
    return future is None or (future.done() and future.exception() is None)


def compile_error(future: Future) -> str | None:
    """Why a finished compile failed, or None."""
    error = future.exception() if future.done() else None
    return None if error is None else _reason(error)
