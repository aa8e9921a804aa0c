"""Calls written as a sequence of JSON objects: `[{...}, {...}]` (tool_choice "required") or
`{...}; {...}` (llama3_json). Each object is reported as a call once it is complete and valid; an output
that does not open the sequence, or breaks it, is content from there on (what an unfinished object held
back included)."""
from __future__ import annotations

import json
from enum import Enum

from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream, function_call, partial_suffix

_DECODER = json.JSONDecoder()


class _Phase(Enum):
    START = 0  # nothing but whitespace (or part of the prefix) yet
    OBJECT = 1  # an object (a call) is due next
    AFTER = 2  # a call ended: a separator, the closing, or the end of the output is due
    TEXT = 3  # everything from here is content


class JsonCallSequence:
    """Reports to `stream`. `opening`: the character that starts the sequence (None: its first object does);
    `prefix`: a marker that may come first and is not content."""

    def __init__(self, stream: ToolCallStream, argument_keys: tuple[str, ...], opening: str | None,
                 separator: str, closing: str | None, prefix: str | None = None) -> None:
        self.stream, self.argument_keys = stream, argument_keys
        self.opening, self.separator, self.closing, self.prefix = opening, separator, closing, prefix
        self._phase = _Phase.START
        self._buffer = ""  # text not consumed yet
        self._skipped = ""  # consumed since the last call (whitespace, prefix, separators): content if it breaks

    def feed(self, delta: str) -> None:
        self._buffer += delta
        while self._buffer and self._step():
            pass

    def finish(self) -> None:
        if self._phase is not _Phase.AFTER and (self._buffer.strip() or not self.stream.calls_begun):
            self.stream.add_content(self._skipped + self._buffer)
        self._skipped = self._buffer = ""

    def _step(self) -> bool:
        """Consumes what it can of the buffer; False when it must wait for more text."""
        if self._phase is _Phase.TEXT:
            self.stream.add_content(self._buffer)
            self._buffer = ""
            return False
        if not self._skip_whitespace():
            return False
        if self._phase is _Phase.START:
            return self._start()
        if self._phase is _Phase.OBJECT:
            return self._object()
        return self._after()

    def _start(self) -> bool:
        if self.prefix:
            if self._buffer.startswith(self.prefix):
                self._consume(len(self.prefix))
                return True
            if partial_suffix(self._buffer, self.prefix) == len(self._buffer):
                return False  # may still be the prefix
        if self.opening is None:
            return self._enter(_Phase.OBJECT if self._buffer[0] == "{" else _Phase.TEXT)
        if self._buffer[0] == self.opening:
            self._consume(1)
            return self._enter(_Phase.OBJECT)
        return self._enter(_Phase.TEXT)

    def _object(self) -> bool:
        if self.closing is not None and self._buffer[0] == self.closing and not self.stream.calls_begun:
            self._consume(1)  # an empty sequence
            return self._enter(_Phase.AFTER)
        if self._buffer[0] != "{":
            return self._enter(_Phase.TEXT)
        try:
            value, end = _DECODER.raw_decode(self._buffer)
        except json.JSONDecodeError:
            return False  # unfinished (or broken: settled at the end of the output)
        call = function_call(value, self.argument_keys)
        if call is None:
            return self._enter(_Phase.TEXT)
        self._buffer, self._skipped = self._buffer[end:], ""
        self.stream.add_call(*call)
        return self._enter(_Phase.AFTER)

    def _after(self) -> bool:
        if self._buffer[0] == self.separator:
            self._consume(1)
            return self._enter(_Phase.OBJECT)
        if self.closing is not None and self._buffer[0] == self.closing:
            self._consume(1)
            self._skipped = ""
            return self._enter(_Phase.TEXT)
        return self._enter(_Phase.TEXT)

    def _skip_whitespace(self) -> bool:
        """Moves leading whitespace to the skipped text; False if nothing else is buffered."""
        rest = self._buffer.lstrip()
        self._consume(len(self._buffer) - len(rest))
        return bool(rest)

    def _consume(self, n: int) -> None:
        self._skipped += self._buffer[:n]
        self._buffer = self._buffer[n:]

    def _enter(self, phase: _Phase) -> bool:
        if phase is _Phase.TEXT:
            self.stream.add_content(self._skipped)
            self._skipped = ""
        self._phase = phase
        return True
