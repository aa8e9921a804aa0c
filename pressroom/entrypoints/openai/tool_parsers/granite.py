"""`granite`: IBM Granite 3.x's calls, a JSON array `[{"name": ..., "arguments": {...}}, ...]` after
`<|tool_call|>` (Granite 3.0, a special token) or `<tool_call>` (3.1 and later), and nothing after it. Content may
come before the marker."""
from __future__ import annotations

from pressroom.entrypoints.openai.tool_parsers.marked import Call, MarkedCallStream, json_calls


class GraniteToolStream(MarkedCallStream):
    OPENS = ("<|tool_call|>", "<tool_call>")
    CLOSE = None

    def parse(self, body: str) -> list[Call] | None:
        return json_calls(body) if body.lstrip().startswith("[") else None
