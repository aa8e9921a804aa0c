"""Tool-call parsers (`--tool-call-parser`, vLLM's names) and the JSON readers of forced tool choices.

Every parser is a `ToolCallStream` subclass: fed an output's text deltas, it reports content and
OpenAI-shaped tool-call deltas; `extract` runs one over a whole output.
"""
from __future__ import annotations

from pressroom.entrypoints.openai.tool_parsers.base import Extraction, ToolCallStream, ToolDelta, assemble, extract
from pressroom.entrypoints.openai.tool_parsers.deepseek import (
    DeepSeekV3ToolStream,
    DeepSeekV4ToolStream,
    DeepSeekV31ToolStream,
    DeepSeekV32ToolStream,
)
from pressroom.entrypoints.openai.tool_parsers.forced import (
    NamedToolStream,
    RequiredToolStream,
    named_schema,
    required_schema,
)
from pressroom.entrypoints.openai.tool_parsers.granite import GraniteToolStream
from pressroom.entrypoints.openai.tool_parsers.harmony import OpenAIToolStream
from pressroom.entrypoints.openai.tool_parsers.hermes import HermesToolStream
from pressroom.entrypoints.openai.tool_parsers.internlm import InternLMToolStream
from pressroom.entrypoints.openai.tool_parsers.jamba import JambaToolStream
from pressroom.entrypoints.openai.tool_parsers.kimi_k2 import KimiK2ToolStream
from pressroom.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolStream
from pressroom.entrypoints.openai.tool_parsers.mistral import MistralToolStream
from pressroom.entrypoints.openai.tool_parsers.pythonic import PythonicToolStream
from pressroom.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolStream

TOOL_PARSERS: dict[str, type[ToolCallStream]] = {
    "deepseek_v3": DeepSeekV3ToolStream,
    "deepseek_v31": DeepSeekV31ToolStream,
    "deepseek_v32": DeepSeekV32ToolStream,
    "deepseek_v4": DeepSeekV4ToolStream,
    "granite": GraniteToolStream,
    "hermes": HermesToolStream,
    "internlm": InternLMToolStream,
    "jamba": JambaToolStream,
    "kimi_k2": KimiK2ToolStream,
    "llama3_json": Llama3JsonToolStream,
    "mistral": MistralToolStream,
    "openai": OpenAIToolStream,
    "pythonic": PythonicToolStream,
    "qwen3_coder": Qwen3CoderToolStream,
}

__all__ = ["TOOL_PARSERS", "DeepSeekV31ToolStream", "DeepSeekV32ToolStream", "DeepSeekV3ToolStream",
           "DeepSeekV4ToolStream", "Extraction", "GraniteToolStream", "HermesToolStream", "InternLMToolStream",
           "JambaToolStream", "KimiK2ToolStream", "Llama3JsonToolStream", "MistralToolStream", "NamedToolStream",
           "OpenAIToolStream", "PythonicToolStream", "Qwen3CoderToolStream", "RequiredToolStream", "ToolCallStream",
           "ToolDelta", "assemble", "extract", "named_schema", "required_schema"]
