"""DeepSeek's tool-call formats, under vLLM's parser names: one block of calls, each between its own markers.

- `deepseek_v3` (V3, V3-0324, R1-0528): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
  newline, the arguments in a ```json fence, `<｜tool▁call▁end｜>`, more calls, `<｜tool▁calls▁end｜>`;
- `deepseek_v31` (V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...`;
- `deepseek_v32` and `deepseek_v4` (DSML): `<｜DSML｜function_calls>` (V3.2) or `<｜DSML｜tool_calls>` (V4), then
  per call `<｜DSML｜invoke name="NAME">`, one
  `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` per argument (a string as is, any
  other value as JSON), `</｜DSML｜invoke>`; and the block's closing tag.

Content may precede the block and follow it. A call is reported once its closing marker came; a call that does
not parse is content, and so is text inside the block that is neither a call nor the block's end (the block ends
there). An output that ends inside a call leaves that call's text as content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream, partial_suffix


@dataclass(frozen=True, slots=True)
class CallBlock:
    """A format's markers: the block's opening and closing, and each call's."""
    open: str
    close: str
    call_open: str
    call_close: str


V3_BLOCK = CallBlock("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
DSML = "｜DSML｜"
V32_BLOCK = CallBlock(f"<{DSML}function_calls>", f"</{DSML}function_calls>", f"<{DSML}invoke", f"</{DSML}invoke>")
V4_BLOCK = CallBlock(f"<{DSML}tool_calls>", f"</{DSML}tool_calls>", f"<{DSML}invoke", f"</{DSML}invoke>")

_V3_CALL = re.compile(r"\s*(\w+)<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)
_V31_CALL = re.compile(r"\s*([^<\s][^<]*?)\s*<｜tool▁sep｜>(.*)", re.DOTALL)
_DSML_HEAD = re.compile(r'\s+name="([^"]+)"\s*>')
_DSML_PARAMETER = re.compile(
    rf'\s*<{DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>', re.DOTALL)


class BlockToolStream(ToolCallStream):
    """The shared state machine; a format gives its markers (`BLOCK`) and reads one call's body (`parse_call`)."""
    BLOCK: ClassVar[CallBlock]

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        block = cls.BLOCK
        return block.open, block.close, block.call_open, block.call_close

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._pending = ""  # text that may be the start of a marker, or an unfinished call
        self._in_block = False

    @staticmethod
    def parse_call(body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of the text between a call's markers, or None if it is not a call."""
        raise NotImplementedError

    def _feed(self, delta: str) -> None:
        text, self._pending = self._pending + delta, ""
        while text:
            text = self._block_part(text) if self._in_block else self._content_part(text)

    def _content_part(self, text: str) -> str:
        """Reports content up to the block's opening; returns what follows it ("" if none yet)."""
        at = text.find(self.BLOCK.open)
        if at < 0:
            keep = partial_suffix(text, self.BLOCK.open)
            self.add_content(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            return ""
        self.add_content(text[:at])
        self._in_block = True
        return text[at + len(self.BLOCK.open):]

    def _block_part(self, text: str) -> str:
        """Consumes one call or the block's closing (whitespace between them is not content); returns the rest."""
        block = self.BLOCK
        body = text.lstrip()
        if body.startswith(block.close):
            self._in_block = False
            return body[len(block.close):]
        if body.startswith(block.call_open):
            end = body.find(block.call_close, len(block.call_open))
            if end < 0:
                self._pending = text
                return ""
            call = self.parse_call(body[len(block.call_open):end])
            if call is None:
                self.add_content(body[:end + len(block.call_close)])
            else:
                self.add_call(*call)
            return body[end + len(block.call_close):]
        if block.close.startswith(body) or block.call_open.startswith(body):
            self._pending = text  # whitespace so far, or the start of a marker
            return ""
        self._in_block = False  # neither a call nor the block's end: the block is over, this is content
        return text

    def _finish(self) -> None:
        text, self._pending = self._pending, ""
        if not self._in_block:
            self.add_content(text)
        elif not self.BLOCK.close.startswith(text.lstrip()):  # an unfinished call (a cut closing is no content)
            self.add_content(text)


class DeepSeekV3ToolStream(BlockToolStream):
    BLOCK = V3_BLOCK

    @staticmethod
    def parse_call(body: str) -> tuple[str, str] | None:
        match = _V3_CALL.fullmatch(body)
        if match is None or match.group(1) != "function":
            return None
        arguments = _json_object(match.group(3))
        return None if arguments is None else (match.group(2).strip(), arguments)


class DeepSeekV31ToolStream(BlockToolStream):
    BLOCK = V3_BLOCK

    @staticmethod
    def parse_call(body: str) -> tuple[str, str] | None:
        match = _V31_CALL.fullmatch(body)
        if match is None:
            return None
        arguments = _json_object(match.group(2))
        return None if arguments is None else (match.group(1), arguments)


class DeepSeekV32ToolStream(BlockToolStream):
    BLOCK = V32_BLOCK

    @staticmethod
    def parse_call(body: str) -> tuple[str, str] | None:
        head = _DSML_HEAD.match(body)
        if head is None:
            return None
        arguments, at = {}, head.end()
        while (parameter := _DSML_PARAMETER.match(body, at)) is not None:
            key, is_string, value = parameter.groups()
            arguments[key] = value if is_string == "true" else _json_value(value)
            at = parameter.end()
        if body[at:].strip():
            return None
        return head.group(1), json.dumps(arguments, ensure_ascii=False)


class DeepSeekV4ToolStream(DeepSeekV32ToolStream):
    BLOCK = V4_BLOCK


def _json_object(text: str) -> str | None:
    """`text` as normalized JSON if it is one JSON object, else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _json_value(text: str) -> object:
    """A non-string DSML argument: its JSON value; text that is not JSON stays a string (as vLLM's parser keeps it)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
