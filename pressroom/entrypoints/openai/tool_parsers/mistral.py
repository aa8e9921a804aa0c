"""`mistral`: Mistral's tool calls after the `[TOOL_CALLS]` control token, in the forms mistral-common's tokenizers
write them (the assistant turn `InstructTokenizer` encodes, whose ids a Mistral model learned):

- v2-v7: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}, ...]`, one JSON array;
- v11: `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`, the marker repeated before each call;
- v13 and later: `[TOOL_CALLS]NAME[ARGS]{...}`, likewise.

Content may come before the first `[TOOL_CALLS]`. Ids are 9 letters and digits, as Mistral's templates and
mistral-common's validation require of the ids sent back with the results; the model's own id is kept.
"""
from __future__ import annotations

import random
import re
import string

from pressroom.entrypoints.openai.tool_parsers.marked import Call, MarkedCallStream, json_calls, json_object_text

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
_NAMED = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\](.*)", re.DOTALL)
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolStream(MarkedCallStream):
    OPENS = (TOOL_CALLS,)
    CLOSE = None

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return TOOL_CALLS, CALL_ID, ARGS

    @staticmethod
    def make_id() -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def parse(self, body: str) -> list[Call] | None:
        if body.lstrip().startswith(("[", "{")):  # the JSON form (v2-v7)
            return json_calls(body)
        named = _NAMED.fullmatch(body)
        if named is None:
            return None
        name, identifier, arguments = named.groups()
        arguments = json_object_text(arguments.strip())
        return None if arguments is None else [Call(name, arguments, identifier)]
