"""`llama3_json`: Llama 3.x's JSON calls, `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`. An output that does not start with a call is content, as is
what follows the last call that parses."""
from __future__ import annotations

from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream
from pressroom.entrypoints.openai.tool_parsers.json_sequence import JsonCallSequence

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolStream(ToolCallStream):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._calls = JsonCallSequence(self, ARGUMENT_KEYS, opening=None, separator=";", closing=None,
                                       prefix=PYTHON_TAG)

    def _feed(self, delta: str) -> None:
        self._calls.feed(delta)

    def _finish(self) -> None:
        self._calls.finish()
