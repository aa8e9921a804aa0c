"""`hermes`: calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes, Qwen and
SmolLM2 chat templates ask for, with any content around them. The last call may lack its closing tag (the
output ended on the JSON)."""
from __future__ import annotations

import json

from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream, function_call, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


class HermesToolStream(ToolCallStream):
    MARKERS = (OPEN, CLOSE)

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._pending = ""  # content that may be the start of OPEN, or the body of an open call
        self._in_call = False

    def _feed(self, delta: str) -> None:
        text, self._pending = self._pending + delta, ""
        while text:
            text = self._call_part(text) if self._in_call else self._content_part(text)

    def _content_part(self, text: str) -> str:
        """Reports content up to a call's opening tag; returns what follows the tag ("" if none yet)."""
        at = text.find(OPEN)
        if at < 0:
            keep = partial_suffix(text, OPEN)
            self.add_content(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            return ""
        self.add_content(text[:at])
        self._in_call = True
        return text[at + len(OPEN):]

    def _call_part(self, text: str) -> str:
        """Settles the open call once its closing tag came; returns what follows the tag."""
        at = text.find(CLOSE)
        if at < 0:
            self._pending = text
            return ""
        self._settle(text[:at], closed=True)
        return text[at + len(CLOSE):]

    def _finish(self) -> None:
        text, self._pending = self._pending, ""
        if self._in_call:
            self._settle(text, closed=False)
        else:
            self.add_content(text)

    def _settle(self, body: str, closed: bool) -> None:
        self._in_call = False
        call = _parse(body)
        if call is None:
            self.add_content(OPEN + body + (CLOSE if closed else ""))
        else:
            self.add_call(*call)


def _parse(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return function_call(value, ARGUMENT_KEYS)
