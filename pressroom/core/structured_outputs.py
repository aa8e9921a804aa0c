"""Structured outputs (xgrammar): a request's constraint as grammar source, checked by the front-end and
compiled once per source, off the engine's loop.

The front-end (`check`) parses the source without a tokenizer, so a bad schema, regex or grammar is a
ValueError (a 400 that names the reason) before anything is queued. The engine core's `GrammarCompiler`
compiles it against the tokenizer on a small thread pool (xgrammar releases the GIL while it compiles),
one future per source in an LRU, and the scheduler leaves the request in the queue until its future is
done (vLLM's WAITING_FOR_FSM) while the other requests run. The model runner matches each request's tokens
against the compiled grammar and masks its logits (worker/grammar.py).

Limits, applied by `check` before xgrammar sees the source, because xgrammar's cost grows far faster than the
text (a schema nested 800 deep, 8 KB of it, parsed for 17 s; one 6,500 deep grew the process by gigabytes):
- MAX_SOURCE_CHARS: the source's text (a schema's JSON text, the regex, the EBNF);
- MAX_DEPTH: nesting, of a schema's JSON objects and arrays, or of a regex's or grammar's parentheses;
- MAX_SCHEMA_WIDTH: the items of one anyOf, oneOf, allOf or enum, and MAX_SCHEMA_NODES: the values in a schema;
- MAX_REPEAT and MAX_REPEAT_TOTAL: repetition bounds ({m,n} in a regex, an EBNF or any string of a schema),
  each one and all of them together, a bound on a group counting times the group's own. (A schema's
  minLength, maxItems... are counted, not expanded: 20,000 compiles in 0.02 s, so they are not limited.)
A schema is judged as JSON decoded, so a bound written with JSON escapes ("\\u007b1,10000\\u007d") is the same
bound; over any limit, a ValueError names the limit and its value (a 400).
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
# Nesting: xgrammar's parse grows with about the cube of a schema's depth (400: 2.5 s, 800: 17.6 s); 64 JSON
# levels (about 30 schema levels) parse in milliseconds, and real schemas rarely nest past 10.
MAX_DEPTH = 64
MAX_SCHEMA_WIDTH = 1024  # items of one anyOf / oneOf / allOf / enum
MAX_SCHEMA_NODES = 10_000  # values (objects, arrays, strings, numbers...) in one schema
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
    """The request's grammar source, parsed once; ValueError naming what is wrong with it (or the limit that
    it exceeds)."""
    if isinstance(params.json, dict):
        _check_schema(params.json)  # before it is written as text: the encoder recurses
    source = grammar_source(params)
    if len(source.text) > MAX_SOURCE_CHARS:
        raise ValueError(f"The structured output's {source.kind} is {len(source.text)} characters long; the limit "
                         f"(MAX_SOURCE_CHARS) is {MAX_SOURCE_CHARS}.")
    if source.kind == "json":
        if not isinstance(params.json, dict):
            _check_schema(_load_schema(source.text))
    else:
        _check_repetitions(source.kind, _pattern_cost(source.text, source.kind))
    _parse(source)
    return source


def _load_schema(text: str) -> Any:
    """The schema's text decoded, its nesting measured first: the decoder recurses."""
    depth = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_DEPTH:
            raise _too_deep("json")
    try:
        return json.loads(text)
    except ValueError as e:  # a JSONDecodeError is one
        raise ValueError(f"Invalid structured output JSON schema: {e}") from None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")
_WIDE_KEYWORDS = frozenset({"anyOf", "oneOf", "allOf", "enum"})


def _check_schema(schema: Any) -> None:
    """Walks the decoded schema without recursion (a deep one cannot reach the stack): its depth, its width,
    its size, and the repetition its strings ask for, each read as a regex (patterns, but keys and the rest too)."""
    stack, nodes, repeats = [(schema, 1)], 0, 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"The structured output's JSON schema has more than {MAX_SCHEMA_NODES} values; "
                             f"the limit (MAX_SCHEMA_NODES) is {MAX_SCHEMA_NODES}.")
        if isinstance(value, str):
            repeats += _pattern_cost(value, "json", syntax="regex")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise _too_deep("json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                repeats += _pattern_cost(key, "json", syntax="regex")
                if key in _WIDE_KEYWORDS and isinstance(item, list) and len(item) > MAX_SCHEMA_WIDTH:
                    raise ValueError(f"The structured output's JSON schema has {len(item)} items in one {key}; the "
                                     f"limit (MAX_SCHEMA_WIDTH) is {MAX_SCHEMA_WIDTH}.")
            stack.append((item, depth + 1))
    _check_repetitions("json", repeats)


def _too_deep(kind: str) -> ValueError:
    return ValueError(f"The structured output's {_NAMES[kind]} nests deeper than {MAX_DEPTH} levels; the limit "
                      f"(MAX_DEPTH) is {MAX_DEPTH}.")


def _check_repetitions(kind: str, total: int) -> None:
    if total > MAX_REPEAT_TOTAL:
        raise _repeats_too_much(kind)


def _repeats_too_much(kind: str) -> ValueError:
    return ValueError(f"The structured output's {_NAMES[kind]} repeats too much: each {{m,n}} bound must be at most "
                      f"{MAX_REPEAT} (MAX_REPEAT), and all of them together at most {MAX_REPEAT_TOTAL} "
                      f"(MAX_REPEAT_TOTAL), a bound inside a repeated group counting times that group's.")


def _bound(n: int, kind: str) -> int:
    if n > MAX_REPEAT:
        raise _repeats_too_much(kind)
    return max(n, 0)


_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _pattern_cost(text: str, kind: str, syntax: str | None = None) -> int:
    """The repetition a regex (or EBNF) asks for: the sum of its {m,n} bounds, each bound on a group counting
    times one plus the group's own (a nested repetition multiplies). Escapes, character classes (and EBNF's
    string literals) are skipped, the parentheses' nesting is checked against MAX_DEPTH. `syntax`: how `text`
    reads (regex or ebnf), when it is a part of a source of another `kind` (a schema's pattern)."""
    syntax = syntax or kind
    groups = [0]  # the cost inside each open group, the outermost first
    last = 0  # the cost of the atom a quantifier would apply to (a group's, just closed)
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i, last = i + 2, 0
            continue
        if c == "[" or (c == '"' and syntax == "ebnf"):
            i, last = _skip_literal(text, i), 0
            continue
        if c == "(":
            groups.append(0)
            if len(groups) > MAX_DEPTH:
                raise _too_deep(kind)
        elif c == ")" and len(groups) > 1:
            last = groups.pop()
            groups[-1] += last
            i += 1
            continue
        elif c == "{" and (match := _QUANTIFIER.match(text, i)):
            low, high = match.groups()
            bound = max(_bound(int(low), kind), _bound(int(high), kind) if high else 0, 1)
            groups[-1] += bound * (1 + last) - last  # a group repeated: its own cost is now counted `bound` times
            if groups[-1] > MAX_REPEAT_TOTAL:
                raise _repeats_too_much(kind)
            i, last = match.end(), 0
            continue
        i, last = i + 1, 0
    return sum(groups)


def _skip_literal(text: str, start: int) -> int:
    """The index past a character class `[...]` (or an EBNF string `"..."`) that starts at `start`."""
    close = "]" if text[start] == "[" else '"'
    i = start + 1
    if close == "]" and text[i:i + 1] == "]":  # a leading ] is literal
        i += 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


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
