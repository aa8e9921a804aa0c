"""`jamba`: AI21 Jamba's calls, `<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`, after any
content (the format of Jamba 1.5/1.6's chat template)."""
from __future__ import annotations

from pressroom.entrypoints.openai.tool_parsers.marked import Call, MarkedCallStream, json_calls


class JambaToolStream(MarkedCallStream):
    OPENS = ("<tool_calls>",)
    CLOSE = "</tool_calls>"

    def parse(self, body: str) -> list[Call] | None:
        return json_calls(body)
