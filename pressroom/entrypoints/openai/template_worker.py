"""Renders chat templates in a process of its own: the server's TemplateRenderer (chat_template.py) keeps a few
of these in a sandbox.WorkerPool, which caps their memory and kills one that overruns its time, so that no
template can stall or kill the server.

Run by path (`python -I template_worker.py MAX_CHARS`), this file imports only the standard library and jinja2:
no torch, no tokenizer, nothing whose memory a template could reach. Once ready it says so ({"ready": true}),
then reads one JSON job per line on stdin and writes one JSON reply per line on stdout: {"text": ...} or
{"error": ...}.

Rendering is as transformers' `apply_chat_template` renders (the same sandboxed environment, globals and
filters, and its trick for `continue_final_message`), with limits: ranges, repetition (`*`) and powers are
capped, and the output may hold at most `max_chars` characters (the pool caps the process's memory).
"""
from __future__ import annotations

import json
import re
import sys
from collections import OrderedDict
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

MAX_RANGE = 100_000  # items in one range()
MAX_EXPONENT = 1024  # big-integer powers run in C, holding the GIL for as long as they like
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the message to continue
_LONG_NUMBER = re.compile(r"%[^a-zA-Z%]*\d{7}")  # a %-format's width or precision of 7 digits or more
TEMPLATE_CACHE = 8  # compiled templates kept (the model's own, and a few request-supplied ones)


class TemplateLimitError(Exception):
    """The template asked for more than the sandbox allows; the message says what."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class _Namespace(Namespace):
    """transformers' namespace: no underscore-prefixed attributes, so none reaches CPython's internals."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateDict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with caps on what one expression can allocate or compute before any output is counted."""
    intercepted_binops = frozenset({"*", "**", "%"})  # intercepted ones are never folded at compile time either

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_Namespace, range=_range)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            self._check_repeat(left, right)
            self._check_repeat(right, left)
        elif operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT and left not in (0, 1, -1):
            raise TemplateLimitError(f"an exponent above {MAX_EXPONENT} is not allowed in a chat template")
        elif operator == "%" and isinstance(left, str) and _LONG_NUMBER.search(left):
            raise TemplateLimitError("a %-format with a width or precision of 1,000,000 or more is not allowed")
        return super().call_binop(context, operator, left, right)

    def _check_repeat(self, seq: Any, times: Any) -> None:
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > self.max_chars:
            raise TemplateLimitError(f"a repetition of {len(seq) * times} items exceeds the limit of "
                                     f"{self.max_chars}")


def _range(*args: int) -> range:
    items = range(*args)
    if len(items) > MAX_RANGE:
        raise TemplateLimitError(f"a range of {len(items)} items exceeds the limit of {MAX_RANGE}")
    return items


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class Renderer:
    """Compiles (with a small cache) and renders templates under the limits."""

    def __init__(self, max_chars: int) -> None:
        self.env = LimitedEnvironment(max_chars)
        self.compiled: OrderedDict[str, jinja2.Template] = OrderedDict()

    def render(self, template: str, messages: list[dict], variables: dict[str, Any], add_generation_prompt: bool,
               continue_final_message: bool) -> str:
        if continue_final_message:
            messages, final = _tag_final_message(messages, template)
        parts = self._compile(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **variables)
        text = self._bounded(parts)
        return _cut_at_tag(text, final) if continue_final_message else text

    def _compile(self, template: str) -> jinja2.Template:
        compiled = self.compiled.pop(template, None) or self.env.from_string(template)
        self.compiled[template] = compiled
        while len(self.compiled) > TEMPLATE_CACHE:
            self.compiled.popitem(last=False)
        return compiled

    def _bounded(self, parts) -> str:
        out, size = [], 0
        for part in parts:
            size += len(part)
            if size > self.env.max_chars:
                raise TemplateLimitError(f"the rendered prompt exceeds the limit of {self.env.max_chars} characters")
            out.append(part)
        return "".join(out)


def _tag_final_message(messages: list[dict], template: str) -> tuple[list[dict], str]:
    """The messages with the final one's text marked at its end (transformers' way to find where it ends)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a final message with text content")
    if "content" not in template:
        raise ValueError("continue_final_message needs a chat template that renders the messages' content")
    return messages[:-1] + [{**messages[-1], "content": final + CONTINUE_TAG}], final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message: the chat template does not render the final message as given")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def reply_for(renderer: Renderer, job: dict) -> dict:
    """One job's reply; every failure of the template (or of its inputs) is an error for the client."""
    try:
        return {"text": renderer.render(job["template"], job["messages"], job["variables"],
                                        job["add_generation_prompt"], job["continue_final_message"])}
    except RecursionError:
        return {"error": "the chat template recursed too deeply"}
    except MemoryError:  # the worker is replaced: the template may have left it holding memory
        return {"error": "the chat template needed more memory than the server allows", "retire": True}
    except Exception as e:  # noqa: BLE001 — a template can raise anything; all of it is the request's fault
        return {"error": _short(f"{type(e).__name__}: {e}")}


def _short(message: str, limit: int = 500) -> str:
    return message if len(message) <= limit else message[:limit] + "..."


def main(argv: list[str]) -> int:
    max_chars = int(argv[1])
    sys.setrecursionlimit(2000)  # a recursing macro fails fast, before the C stack
    renderer = Renderer(max_chars)
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')  # the pool caps this process's memory from here on
    out.flush()
    for line in sys.stdin.buffer:  # EOF (the server closed the pipe or died): exit
        try:
            reply = reply_for(renderer, json.loads(line))
        except (ValueError, RecursionError, MemoryError):
            reply = {"error": "the chat template's inputs could not be read"}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
