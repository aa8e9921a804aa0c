"""Structured outputs (xgrammar): a request's constraint as grammar source, checked, parsed once and compiled
off the engine's loop.

Under the server, `GrammarSandbox` (the API process) checks the source against the limits below, then parses it
and compiles it against the tokenizer in a worker process (grammar_worker.py, in a sandbox.WorkerPool) with a
deadline (GRAMMAR_COMPILE_TIMEOUT_S) and a memory cap (GRAMMAR_COMPILE_MAX_BYTES): over either, or a source
xgrammar refuses, is a ValueError (a 400 naming structured_outputs) and costs only that worker, which is
replaced. What the request carries to the engine core is the parsed grammar (xgrammar's JSON of it,
`parsed_grammar`), never parsed again there. The compiled grammar is not shipped: its JSON holds the token
masks, 3.8 MB for a two-field schema against a 49k vocabulary (against 6 KB parsed, and a 16 ms compile), for
every request and each of its n samples. The core compiles it again instead, a compile that just finished in
the sandbox under its caps, against the same tokenizer info.

The engine core's `GrammarCompiler` compiles on a small thread pool (xgrammar releases the GIL while it
compiles), one future per source in an LRU, and the scheduler leaves the request in the queue until its future
is done (vLLM's WAITING_FOR_FSM) while the other requests run. The model runner matches each request's tokens
against the compiled grammar and masks its logits (worker/grammar.py). Offline (no server), `check` parses in
the engine's process, and the compile reads that parse from its cache.

Limits, applied by `check_limits` before xgrammar sees the source, because xgrammar's cost grows far faster
than the text (a schema nested 800 deep, 8 KB of it, parsed for 17 s; one 6,500 deep grew the process by
gigabytes):
- MAX_SOURCE_CHARS: the source's text (a schema's JSON text, the regex, the EBNF);
- MAX_DEPTH: nesting, of a schema's JSON objects and arrays, or of a regex's or grammar's parentheses;
- MAX_SCHEMA_WIDTH: the items of one anyOf, oneOf, allOf or enum, and MAX_SCHEMA_NODES: the values in a schema;
- MAX_REPEAT and MAX_REPEAT_TOTAL: repetition bounds ({m,n} in a regex, an EBNF or any string of a schema),
  each one and all of them together, a bound on a group counting times the group's own. (A schema's
  minLength, maxItems... are counted, not expanded: 20,000 compiles in 0.02 s, so they are not limited.)
A schema is judged as JSON decoded, so a bound written with JSON escapes ("\\u007b1,10000\\u007d") is the same
bound; over any limit, a ValueError names the limit and its value (a 400). The sandbox's deadline and memory
cap then bound what the limits cannot foresee.
"""
from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xgrammar as xgr

from pressroom.core import grammar_worker
from pressroom.core.grammar_worker import NAMES as _NAMES
from pressroom.core.grammar_worker import reason as _reason
from pressroom.sampling_params import StructuredOutputsParams
from pressroom.sandbox import WorkerFailed, WorkerPool, WorkerTimeout, job_line

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
COMPILE_THREADS = 2
# The server's sandbox (GrammarSandbox): a real schema parses and compiles in tens of milliseconds, and in a few
# megabytes (its token masks); the bombs above took minutes and gigabytes. The memory is what a compile may map
# beyond the worker's own start (its interpreter, xgrammar and torch).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
GRAMMAR_COMPILE_MAX_BYTES = 2 << 30
GRAMMAR_WORKERS = 2
SANDBOX_RESULTS_CHARS = 64 << 20  # the sandbox's verdicts kept (parsed grammars' JSON, refusals), by their size


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """What is compiled, and the cache's key: `kind` is json (a schema's text), regex or ebnf. `parsed`: the
    server sandbox's parse of it (xgrammar's JSON), which the engine core compiles instead; not part of the key."""
    kind: str
    text: str
    any_whitespace: bool = True
    parsed: str | None = field(default=None, compare=False, repr=False)


def grammar_source(params: StructuredOutputsParams) -> GrammarSource:
    """The constraint as one grammar source (with its parse, when the server's sandbox made one)."""
    source = _source(params)
    return source if params.parsed_grammar is None else replace(source, parsed=params.parsed_grammar)


def _source(params: StructuredOutputsParams) -> GrammarSource:
    """`choice` becomes an EBNF alternation of string literals."""
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
    """The request's grammar source, checked against the limits and parsed in this process (unless the server's
    sandbox has parsed it: `parsed_grammar`); ValueError naming what is wrong with it (or the limit that it
    exceeds)."""
    if params.parsed_grammar is not None:
        return grammar_source(params)
    source = check_limits(params)
    _parse(source)
    return source


def check_limits(params: StructuredOutputsParams, max_chars: int = MAX_SOURCE_CHARS) -> GrammarSource:
    """The request's grammar source, checked against the limits without parsing it; ValueError naming the limit
    that it exceeds. `max_chars`: the source's length (the server's --max-grammar-chars; offline MAX_SOURCE_CHARS)."""
    if isinstance(params.json, dict):
        _check_schema(params.json)  # before it is written as text: the encoder recurses
    source = grammar_source(params)
    if len(source.text) > max_chars:
        raise ValueError(f"The structured output's {source.kind} is {len(source.text)} characters long; the limit "
                         f"is {max_chars}.")
    if source.kind == "json":
        if not isinstance(params.json, dict):
            _check_schema(_load_schema(source.text))
    else:
        _check_repetitions(source.kind, _pattern_cost(source.text, source.kind))
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
    return grammar_worker.parse(source.kind, source.text, source.any_whitespace)


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> xgr.TokenizerInfo:
    """What xgrammar compiles against: the tokenizer's vocabulary, padded to the model's `vocab_size` (its
    logits' width, which may exceed the tokenizer's), and EOS as the token that ends a grammar."""
    stop = [eos_token_id] if eos_token_id is not None else None
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)


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
        grammar = _parse(source) if source.parsed is None else xgr.Grammar.deserialize_json(source.parsed)
        compiled = self._xgr_compiler().compile_grammar(grammar)
        return compiled.serialize_json() if self.portable else compiled

    def tokenizer_info_json(self) -> str:
        """The tokenizer info portable grammars are read with (built by the first compile)."""
        self._xgr_compiler()
        return self._info.serialize_json()

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = tokenizer_info(self._load_tokenizer(), self._vocab_size, self._eos)
                # our LRU holds the compiled grammars: xgrammar's own cache would keep a second copy
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
                self._info = info
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarSandbox:
    """The server's parse: each new grammar source parsed and compiled in grammar worker processes, under
    `timeout_s` and `max_bytes` (a worker over either is killed and replaced). Verdicts are kept by source,
    refusals too (a source that ran out its deadline would cost a worker again), and requests with a source in
    progress wait for its one job; the job goes on when they are cancelled, so its worker is not lost. The
    workers start at the first constrained request: a server that never constrains never pays for them."""

    def __init__(self, tokenizer: Any, workers: int = GRAMMAR_WORKERS, timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
                 max_bytes: int = GRAMMAR_COMPILE_MAX_BYTES) -> None:
        self.tokenizer, self.workers, self.timeout_s, self.max_bytes = tokenizer, workers, timeout_s, max_bytes
        self._pool: WorkerPool | None = None
        self._pool_lock: asyncio.Lock | None = None  # made in the serving event loop
        self._verdicts: OrderedDict[GrammarSource, str | ValueError] = OrderedDict()
        self._verdict_chars = 0
        self._jobs: dict[GrammarSource, asyncio.Task[str]] = {}

    async def parsed(self, source: GrammarSource, vocab_size: int) -> str:
        """xgrammar's JSON of the source parsed, once it compiled within the caps (the limits are checked before:
        `check_limits`); ValueError naming the cap it ran past or why xgrammar refused it; sandbox.PoolBusy when
        every worker stayed busy. `vocab_size`: the model's."""
        verdict = self._verdicts.get(source)
        if verdict is None:
            job = self._jobs.get(source)
            if job is None:
                job = self._jobs[source] = asyncio.ensure_future(self._judge(source, vocab_size))
                job.add_done_callback(functools.partial(self._forget, source))
            return await asyncio.shield(job)
        self._verdicts.move_to_end(source)
        if isinstance(verdict, ValueError):
            raise ValueError(str(verdict))
        return verdict

    async def _judge(self, source: GrammarSource, vocab_size: int) -> str:
        pool = await self._workers(vocab_size)
        try:
            job = {"kind": source.kind, "text": source.text, "any_whitespace": source.any_whitespace}
            reply = await pool.ask(job_line(job))
            verdict = reply["grammar"] if "grammar" in reply else ValueError(self._refusal(source, reply["error"]))
        except WorkerTimeout:
            verdict = ValueError(f"The structured output's {_NAMES[source.kind]} took longer than "
                                 f"{self.timeout_s:g} s to compile, the server's limit "
                                 "(pressroom serve --max-grammar-compile-seconds).")
        except WorkerFailed:  # it died: past its memory cap in a way it could not report, or crashed
            verdict = ValueError(self._refusal(source, "memory"))
        self._keep(source, verdict)
        if isinstance(verdict, ValueError):
            raise verdict
        return verdict

    def _forget(self, source: GrammarSource, job: asyncio.Task[str]) -> None:
        """A job done: its verdict is kept (or it failed for no fault of the source's); its error is read here,
        since every request that waited for it may have gone."""
        self._jobs.pop(source, None)
        if not job.cancelled():
            job.exception()

    def _refusal(self, source: GrammarSource, error: str) -> str:
        if error != "memory":
            return error
        return (f"The structured output's {_NAMES[source.kind]} needs more memory to compile than the server "
                f"allows: {self.max_bytes >> 20} MiB (pressroom serve --max-grammar-compile-mib).")

    def _keep(self, source: GrammarSource, verdict: str | ValueError) -> None:
        self._verdicts[source] = verdict
        self._verdict_chars += _chars(source, verdict)
        while self._verdict_chars > SANDBOX_RESULTS_CHARS and self._verdicts:
            old, old_verdict = self._verdicts.popitem(last=False)
            self._verdict_chars -= _chars(old, old_verdict)

    async def _workers(self, vocab_size: int) -> WorkerPool:
        """The pool, started at the first job with the tokenizer info (built on a thread: a tenth of a second).
        A worker that cannot start raises its WorkerError here, which no source is blamed for."""
        self._pool_lock = self._pool_lock or asyncio.Lock()
        async with self._pool_lock:
            if self._pool is None:
                info = await asyncio.to_thread(self._tokenizer_info_json, vocab_size)
                self._pool = WorkerPool(Path(grammar_worker.__file__), size=self.workers, timeout_s=self.timeout_s,
                                        max_bytes=self.max_bytes, setup=info.encode() + b"\n")
            await self._pool.start()
            return self._pool

    def _tokenizer_info_json(self, vocab_size: int) -> str:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return tokenizer_info(self.tokenizer, vocab_size, eos).serialize_json()

    async def close(self) -> None:
        for job in list(self._jobs.values()):
            job.cancel()
        if self._pool is not None:
            await self._pool.close()
        self._pool = None


def _chars(source: GrammarSource, verdict: str | ValueError) -> int:
    return len(source.text) + len(str(verdict))


def grammar_ready(future: Future | None) -> bool:
    """Whether a request may be scheduled: no grammar, or one compiled without error."""
    return future is None or (future.done() and future.exception() is None)


def compile_error(future: Future) -> str | None:
    """Why a finished compile failed, or None."""
    error = future.exception() if future.done() else None
    return None if error is None else _reason(error)
