"""`internlm`: InternLM2/2.5's plugin calls, `<|action_start|><|plugin|>` then one JSON object
`{"name": ..., "parameters": {...}}` ("arguments" too, as vLLM's tool template writes it) then `<|action_end|>`,
after any content; several calls are several such blocks."""
from __future__ import annotations

from pressroom.entrypoints.openai.tool_parsers.marked import Call, MarkedCallStream, json_calls

ACTION_START, PLUGIN, ACTION_END = "<|action_start|>", "<|plugin|>", "<|action_end|>"


class InternLMToolStream(MarkedCallStream):
    OPENS = (ACTION_START + PLUGIN,)
    CLOSE = ACTION_END

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return ACTION_START, PLUGIN, ACTION_END

    def parse(self, body: str) -> list[Call] | None:
        calls = json_calls(body, ("parameters", "arguments"))
        return calls if calls is not None and len(calls) == 1 and body.lstrip().startswith("{") else None
