"""`kimi_k2`: Moonshot Kimi-K2's calls, a section of calls between `<|tool_calls_section_begin|>` and
`<|tool_calls_section_end|>`, each `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}
<|tool_call_end|>`. The id `functions.NAME:N` is the call's id (K2's template writes it back as is); the name is
what stands between the last dot and the colon."""
from __future__ import annotations

import re

from pressroom.entrypoints.openai.tool_parsers.marked import Call, MarkedCallStream, json_object_text

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                   re.DOTALL)
_ID = re.compile(r"(?:[\w-]+\.)*([\w-]+):\d+")


class KimiK2ToolStream(MarkedCallStream):
    OPENS = (SECTION_BEGIN, "<|tool_call_section_begin|>")  # the singular form some K2 outputs have
    CLOSE = SECTION_END

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return (*cls.OPENS, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

    def parse(self, body: str) -> list[Call] | None:
        calls, at = [], 0
        while (match := _CALL.match(body, at)) is not None:
            identifier, arguments = match.group(1), json_object_text(match.group(2).strip())
            name = _ID.fullmatch(identifier)
            if name is None or arguments is None:
                return None
            calls.append(Call(name.group(1), arguments, identifier))
            at = match.end()
        return calls if not body[at:].strip() else None
