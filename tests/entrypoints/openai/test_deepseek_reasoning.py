"""DeepSeek's reasoning formats round-tripped through their chat templates (R1, V3.1 with its `thinking` switch,
V4's thinking modes and reasoning effort): a conversation whose last assistant turn has reasoning and content
(and, for V4, tool calls) is rendered by a minimal template written from the published format, the turn is cut
out of the rendered text (what the model writes after the generation prompt), and the parser that
`--reasoning-parser deepseek_*` picks reads it back, whole and streamed in small random chunks, with the prompt's
token ids deciding whether the output starts inside the span, as the server decides it.

V4's template maps `reasoning_effort` (the request field, a template variable) and `thinking` /
`enable_thinking` (chat_template_kwargs) to its modes as vLLM's DeepSeek-V4 tokenizer does: thinking unless
switched off or effort "none"; effort "max" -> max, "low"/"minimal"/"medium" -> low, any other -> high (the
default in thinking mode); the effort's prompt goes first, in thinking mode only. The effort prompts here are
abbreviated; "low" adds none."""
from __future__ import annotations

import json
import random
import re

import pytest

from pressroom.entrypoints.openai.chat_template import template_messages, template_variables
from pressroom.entrypoints.openai.protocol import ChatCompletionRequest
from pressroom.entrypoints.openai.reasoning import ReasoningParser, make_parser
from pressroom.entrypoints.openai.template_worker import Renderer
from pressroom.entrypoints.openai.tool_parsers import DeepSeekV4ToolStream, assemble

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# R1: the generation prompt opens the span; earlier turns keep only their answers.
R1_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜>
{%- if loop.index0 > ns.last_user %}{{ '<think>\n' + m.reasoning_content + '</think>' }}{% endif %}
{{- m.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}"""

# V3.1: `<think>` (thinking) or `</think>` (not) after the assistant marker; earlier turns without reasoning.
V31_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜>
{%- if thinking and loop.index0 > ns.last_user %}{{ '<think>' + m.reasoning_content + '</think>' }}
{%- else %}</think>{% endif %}{{ m.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{{ '<think>' if thinking else '</think>' }}{% endif %}"""

# V4: the mode and effort from the request, the effort's prompt first (thinking mode), tools after the system
# prompt, tool results merged into a user turn; in thinking mode, earlier turns lose their reasoning (and open
# with `</think>`) unless there are tools.
EFFORT_PROMPTS = {"low": "", "high": "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\n",
                  "max": "Reasoning Effort: Beyond maximum.\n\n"}
V4_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1, thinking=true, effort='high', drop=not tools) %}
{%- if thinking is defined or enable_thinking is defined %}
{%- set ns.thinking = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) %}
{%- endif %}
{%- if reasoning_effort is defined and reasoning_effort is string %}
{%- if reasoning_effort == 'none' %}{% set ns.thinking = false %}
{%- elif reasoning_effort == 'max' %}{% set ns.effort = 'max' %}
{%- elif reasoning_effort in ['low', 'minimal', 'medium'] %}{% set ns.effort = 'low' %}
{%- endif %}
{%- endif %}
{%- for m in messages %}{% if m.role in ['user', 'tool'] %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}{{ effort_prompts[ns.effort] if ns.thinking else '' }}
{%- for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}
{%- if tools %}{{ '\n\n## Tools\n\nCall tools in a <｜DSML｜tool_calls> block.\n\n### Available Tool Schemas\n\n' }}
{%- for tool in tools %}{{ tool.function | tojson }}{{ '\n' }}{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'tool' %}{{ '<｜User｜>' if loop.previtem.role != 'tool' else '\n\n' }}<tool_result>
{{- m.content }}</tool_result>
{%- elif m.role == 'assistant' %}
{%- if ns.thinking and (loop.index0 > ns.last_user or not ns.drop) %}{{ (m.reasoning_content or '') + '</think>' }}
{%- endif %}
{{- m.content or '' }}
{%- if m.tool_calls %}{{ '\n\n<｜DSML｜tool_calls>\n' }}
{%- for call in m.tool_calls %}{{ '<｜DSML｜invoke name="' + call.function.name + '">\n' }}
{%- for key, value in call.function.arguments.items() %}
{{- '<｜DSML｜parameter name="' + key + '" string="' + ('true' if value is string else 'false') + '">' }}
{{- value if value is string else value | tojson }}</｜DSML｜parameter>{{ '\n' if not loop.last }}
{%- endfor %}{{ '\n</｜DSML｜invoke>' }}{{ '\n' if not loop.last }}
{%- endfor %}{{ '\n</｜DSML｜tool_calls>' }}{% endif %}{{ eos_token }}
{%- endif %}
{%- if m.role in ['user', 'tool'] and (loop.last or loop.nextitem.role == 'assistant') %}<｜Assistant｜>
{{- '<think>' if ns.thinking and (loop.index0 >= ns.last_user or not ns.drop) else '</think>' }}
{%- endif %}
{%- endfor %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


class _Tok:
    """DeepSeek's vocabulary in miniature: `<think>` and `</think>` single tokens that are not special (they stay
    in the decoded text), every other character a token of its own."""
    unk_token_id = 0
    all_special_ids: list[int] = []
    MARKERS = {"<think>": 1, "</think>": 2}

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.MARKERS.get(token, self.unk_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for part in re.split("(<think>|</think>)", text):
            ids.extend([self.MARKERS[part]] if part in self.MARKERS else [1000 + ord(c) for c in part])
        return ids


TOK = _Tok()


def render(template: str, messages: list[dict], add_generation_prompt: bool, **variables) -> str:
    variables = {"bos_token": BOS, "eos_token": EOS, "effort_prompts": EFFORT_PROMPTS} | variables
    return Renderer(1 << 20).render(template, template_messages(messages), variables, add_generation_prompt, False)


def turn_of(template: str, messages: list[dict], **variables) -> tuple[list[int], str]:
    """(the prompt's token ids, what the model writes as the last message): the text after the prompt that asks
    for it, without the end-of-sentence token (a stop token, not text)."""
    prompt = render(template, messages[:-1], True, **variables)
    whole = render(template, messages, False, **variables)
    assert whole.startswith(prompt) and whole.endswith(EOS), (prompt, whole)
    return TOK.encode(prompt), whole[len(prompt):-len(EOS)]


def conversation(reasoning: str, content: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Earlier thoughts."},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": content, "reasoning_content": reasoning}]


def random_chunks(text: str, rng: random.Random, most: int = 4) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, most)
        pieces.append(text[at:at + step])
        at += step
    return pieces


def streamed_split(parser: ReasoningParser, pieces: list[str], opens: bool) -> tuple[str | None, str]:
    stream = parser.stream(opens)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    first_content = next((k for k, (_, c) in enumerate(parts) if c), len(parts))
    assert not any(r for r, _ in parts[first_content + 1:]), "reasoning after content"
    reasoning = "".join(r for r, _ in parts)
    return (reasoning if stream.seen_span else None), "".join(c for _, c in parts)


def check_round_trip(name: str, prompt_ids: list[int], text: str, expected: tuple[str | None, str]) -> None:
    parser = make_parser(name, TOK)
    opens = parser.prompt_opens(prompt_ids)
    assert parser.split(text, opens) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        assert streamed_split(parser, random_chunks(text, rng), opens) == expected


REASONING, ANSWER = "Three and three.\nThat is six.\n", "\n\n**6** (and <think> is a tag)"


def test_r1_round_trip():
    prompt_ids, text = turn_of(R1_TEMPLATE, conversation(REASONING, ANSWER))
    assert text == REASONING + "</think>" + ANSWER  # the generation prompt opened the span
    check_round_trip("deepseek_r1", prompt_ids, text, (REASONING, ANSWER))


def test_r1_output_starts_inside_the_span_whatever_the_prompt():
    """R1 thinks first: with a template that leaves `<think>` to the model (written or not), the output still
    starts in the span; every token up to `</think>` counts as reasoning."""
    parser = make_parser("deepseek_r1", TOK)
    assert parser.prompt_opens(TOK.encode("<｜User｜>hi<｜Assistant｜>"))
    assert parser.split("<think>\nwhy</think>because", True) == ("\nwhy", "because")
    assert parser.split("why</think>because", True) == ("why", "because")
    assert parser.split("still thinking", True) == ("still thinking", "")
    assert parser.count_reasoning_tokens(TOK.encode("why</think>because"), True) == 4


@pytest.mark.parametrize("thinking", [True, False])
def test_v31_round_trip_in_both_modes(thinking):
    prompt_ids, text = turn_of(V31_TEMPLATE, conversation(REASONING, ANSWER), thinking=thinking)
    expected = (REASONING, ANSWER) if thinking else (None, ANSWER)  # without thinking, `<think>` is just text
    check_round_trip("deepseek_v3", prompt_ids, text, expected)
    parser = make_parser("deepseek_v3", TOK)
    reasoning_tokens = len(TOK.encode(REASONING)) + 1 if thinking else 0
    assert parser.count_reasoning_tokens(TOK.encode(text), parser.prompt_opens(prompt_ids)) == reasoning_tokens


def test_the_think_parser_would_take_a_leading_tag_for_a_span():
    """Why deepseek_v3 reads the mode from the prompt alone: in non-thinking mode an answer may start with the
    tag, which the generic parser takes for reasoning."""
    prompt_ids, text = turn_of(V31_TEMPLATE, conversation("", "<think> is a tag</think>, see."), thinking=False)
    assert make_parser("think", TOK).split(text, False) == (" is a tag", ", see.")
    assert make_parser("deepseek_v3", TOK).split(text, False) == (None, "<think> is a tag</think>, see.")


CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Zürich\n", "days": 0})]


def _with_calls(reasoning: str, content: str | None) -> list[dict]:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate(CALLS)]
    messages = conversation(reasoning, "")
    messages[-1] |= {"content": content, "tool_calls": calls}
    return messages


def _reasoning_content_calls(pieces: list[str], opens: bool) -> tuple[str, str | None, list]:
    """The server's order: the reasoning parser first, then the tool parser on what it leaves as content."""
    splitter, caller = make_parser("deepseek_v4", TOK).stream(opens), DeepSeekV4ToolStream()
    reasoning, content, deltas = "", "", []
    for piece in [*pieces, None]:
        r, c = splitter.feed(piece) if piece is not None else splitter.finish()
        reasoning += r
        for out in [caller.feed(c)] + ([caller.finish()] if piece is None else []):
            content += out.content
            deltas += out.calls
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in assemble(deltas)]
    return reasoning, content or None, calls


@pytest.mark.parametrize("content", [None, "Checking both."])
def test_v4_reasoning_and_tool_calls_round_trip(content):
    prompt_ids, text = turn_of(V4_TEMPLATE, _with_calls(REASONING, content), tools=[WEATHER])
    parser = make_parser("deepseek_v4", TOK)
    opens = parser.prompt_opens(prompt_ids)
    assert opens and text.startswith(REASONING + "</think>")
    assert _reasoning_content_calls([text], opens) == (REASONING, content, CALLS)
    rng = random.Random(7)
    for _ in range(20):
        assert _reasoning_content_calls(random_chunks(text, rng), opens) == (REASONING, content, CALLS)


def test_v4_tool_calls_right_after_thinking_end_the_span():
    """V4 may go from thinking straight to its tool-call block without `</think>`: the block ends the span and
    is content for the tool parser; the reasoning tokens are those before it."""
    _, text = turn_of(V4_TEMPLATE, _with_calls("", None), tools=[WEATHER], thinking=False)
    assert text.startswith("\n\n<｜DSML｜tool_calls>")
    text = REASONING + text  # chat mode renders no reasoning: the block as the model writes it after thinking
    expected = (REASONING + "\n\n", None, CALLS)  # the blank lines before the block were still thinking
    assert _reasoning_content_calls([text], True) == expected
    for cut in range(len(text) + 1):
        assert _reasoning_content_calls([text[:cut], text[cut:]], True) == expected, cut
    parser = make_parser("deepseek_v4", TOK)
    assert parser.count_reasoning_tokens(TOK.encode(text), True) == len(TOK.encode(expected[0]))


def test_v4_chat_mode_has_no_reasoning():
    prompt_ids, text = turn_of(V4_TEMPLATE, conversation(REASONING, ANSWER), reasoning_effort="none")
    check_round_trip("deepseek_v4", prompt_ids, text, (None, ANSWER))


EFFORTS = [  # (template variables, thinking, effort prompt)
    ({}, True, "high"),
    ({"reasoning_effort": "none"}, False, None),
    ({"reasoning_effort": "minimal"}, True, "low"),
    ({"reasoning_effort": "low"}, True, "low"),
    ({"reasoning_effort": "medium"}, True, "low"),
    ({"reasoning_effort": "high"}, True, "high"),
    ({"reasoning_effort": "xhigh"}, True, "high"),
    ({"reasoning_effort": "max"}, True, "max"),
    ({"thinking": False}, False, None),
    ({"thinking": False, "reasoning_effort": "max"}, False, None),  # effort means nothing without thinking
    ({"enable_thinking": True, "reasoning_effort": "low"}, True, "low"),
    ({"thinking": True, "reasoning_effort": "none"}, False, None),
]


@pytest.mark.parametrize("variables,thinking,effort", EFFORTS)
def test_v4_reasoning_effort_picks_the_mode(variables, thinking, effort):
    prompt = render(V4_TEMPLATE, [{"role": "user", "content": "hi"}], True, **variables)
    assert prompt.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    prefix = prompt[len(BOS):prompt.index("<｜User｜>")]
    assert prefix == (EFFORT_PROMPTS[effort] if thinking else "")
    parser = make_parser("deepseek_v4", TOK)
    assert parser.prompt_opens(TOK.encode(prompt)) == thinking


@pytest.mark.parametrize("effort,thinking", [("none", False), ("low", True), ("xhigh", True), (None, True)])
def test_the_request_field_reaches_the_template(effort, thinking):
    """`reasoning_effort` travels as the server sends it: the request's template variables."""
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], reasoning_effort=effort,
                                chat_template_kwargs={"reasoning_effort": "none"})
    variables = template_variables(req.template_kwargs)
    prompt = render(V4_TEMPLATE, [{"role": "user", "content": "hi"}], True, **variables)
    # the field wins over the same key in chat_template_kwargs; without the field, the kwargs' "none" holds
    assert prompt.endswith("<think>") == (thinking and effort is not None)


def test_make_parser_knows_vllms_deepseek_names():
    for name in ("deepseek_r1", "deepseek_v3", "deepseek_v4"):
        parser = make_parser(name, TOK)
        assert parser.start == "<think>" and parser.end == "</think>" and not parser.markers_are_special
