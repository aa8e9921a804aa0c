"""Parses and compiles structured outputs' grammars in a process of its own: the API server's GrammarSandbox
(structured_outputs.py) keeps a few of these in a sandbox.WorkerPool, which caps their memory and kills one
that overruns its deadline, so that no schema, regex or grammar can take the server's time or memory.

Run by path (`python -I grammar_worker.py`), this file imports only the standard library and xgrammar. Its
first line on stdin is the tokenizer info (xgrammar's JSON of it); once it is read the worker says so
({"ready": true}), then reads one job per line, {"kind", "text", "any_whitespace"} (a GrammarSource), and
writes one reply per line: {"grammar": xgrammar's JSON of the parsed grammar} when the source parses and
compiles against the tokenizer, else {"error": why} ({"error": "memory", "retire": true}: over the pool's
memory cap; the pool replaces the worker).

`parse` is also how the engine's own process parses a source (offline, without a server).
"""
from __future__ import annotations

import json
import re
import sys

import xgrammar as xgr

# Whitespace between JSON tokens, where any is allowed: a small model can otherwise emit newlines until max_tokens.
MAX_JSON_WHITESPACE = 20
NAMES = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar (EBNF)"}
# xgrammar's messages start with a timestamp, its source location and the failed check's expression.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# past the memory cap: xgrammar's C++ may not have unwound cleanly, so the pool replaces this worker
OUT_OF_MEMORY = {"error": "memory", "retire": True}


def parse(kind: str, text: str, any_whitespace: bool = True) -> xgr.Grammar:
    """The source as xgrammar's grammar; a ValueError that says what is wrong with it (a MemoryError when
    xgrammar's allocations failed)."""
    try:
        if kind == "json":
            whitespace = MAX_JSON_WHITESPACE if any_whitespace else None
            return xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace, max_whitespace_cnt=whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        if _out_of_memory(e):
            raise MemoryError from None
        raise ValueError(f"Invalid structured output {NAMES[kind]}: {reason(e)}") from None


def _out_of_memory(error: BaseException) -> bool:
    return "bad_alloc" in str(error)  # how xgrammar's C++ reports a failed allocation


def reason(error: BaseException) -> str:
    return _NOISE.sub("", str(error)).strip()


def reply_for(compiler: xgr.GrammarCompiler, job: dict) -> dict:
    try:
        grammar = parse(job["kind"], job["text"], job["any_whitespace"])
        compiler.compile_grammar(grammar)  # its time and memory are what the pool bounds: the core compiles it again
        return {"grammar": grammar.serialize_json()}
    except ValueError as e:
        return {"error": str(e)}
    except MemoryError:
        return OUT_OF_MEMORY
    except RuntimeError as e:  # the compile's own failures
        return OUT_OF_MEMORY if _out_of_memory(e) else {"error": f"xgrammar failed: {reason(e)}"}


def main() -> int:
    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.buffer.readline().decode())
    # one thread: a job's cost is its own; no cache: each source is compiled here once (the server keeps results)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')  # the pool caps this process's memory from here on
    out.flush()
    for line in sys.stdin.buffer:  # EOF (the server closed the pipe or died): exit
        try:
            reply = reply_for(compiler, json.loads(line))
        except (ValueError, KeyError, TypeError, RecursionError, MemoryError):
            reply = {"error": "the job could not be read"}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
