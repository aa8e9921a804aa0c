"""DeepSeek's tool-call formats round-tripped through their chat templates: a conversation with tool calls is
rendered by a minimal template written from the published format (V3, V3.1, V4's DSML), the assistant's turn is
cut out of the rendered text (what the model writes after the generation prompt), and the parser of that format
reads it back into the same content and calls, whole and streamed in small random chunks. Fixed strings cover
what a model may get wrong (a call that does not parse, an output cut inside a call, text after the block).

The templates render through the server's own sandboxed renderer (`template_worker.Renderer`), given the
messages as the server gives them (`chat_template.template_messages`: tool-call arguments as objects). One test
runs the server on loopback (the shared tiny engine, `--reasoning-parser deepseek_r1 --tool-call-parser
deepseek_v3`, R1-0528's pair) with the official openai client, the output forced by structured outputs."""
from __future__ import annotations

import json
import random

import openai
import pytest
from serving import serve_in_thread

from pressroom.entrypoints.openai.chat_template import template_messages
from pressroom.entrypoints.openai.server import build_app
from pressroom.entrypoints.openai.settings import ServerSettings
from pressroom.entrypoints.openai.template_worker import Renderer
from pressroom.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolStream,
    DeepSeekV4ToolStream,
    DeepSeekV31ToolStream,
    DeepSeekV32ToolStream,
    ToolCallStream,
    assemble,
    extract,
)
from pressroom.entrypoints.openai.tool_parsers.base import markers_are_special
from pressroom.entrypoints.openai.tool_parsers.deepseek import V3_BLOCK

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# V3 / V3-0324 / R1-0528: `function<｜tool▁sep｜>NAME`, the arguments in a json fence, calls one per line; the tool
# outputs in their own block, after which the model answers without an assistant marker.
V3_TEMPLATE = """\
{{- bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}
{%- if tools %}

## Tools
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}{% endif %}
{%- set ns = namespace(tool=false) %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}
{%- if ns.tool %}<｜tool▁outputs▁end｜>{% set ns.tool = false %}{% else %}<｜Assistant｜>{% endif %}
{{- m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for call in m.tool_calls %}{{ '\\n' if not loop.first }}
{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call.function.name }}
```json
{{ call.function.arguments | tojson }}
```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}{{ eos_token }}
{%- elif m.role == 'tool' %}
{%- if ns.tool %}
<｜tool▁output▁begin｜>{% else %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{% endif %}
{{- m.content }}<｜tool▁output▁end｜>{% set ns.tool = true %}
{%- endif %}
{%- endfor %}
{%- if ns.tool %}<｜tool▁outputs▁end｜>{% elif add_generation_prompt %}<｜Assistant｜>{% endif %}"""

# V3.1: `NAME<｜tool▁sep｜>ARGS`, calls chained without separators; `</think>` after the assistant marker in
# non-thinking mode (tool calls are made in it); each tool output in its own markers, the answer right after.
V31_TEMPLATE = """\
{{- bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}
{%- if tools %}

## Tools
You have access to the following tools:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}{% endif %}
{%- set ns = namespace(tool=false) %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}{% set ns.tool = false %}
{%- elif m.role == 'assistant' %}
{%- if not ns.tool %}<｜Assistant｜></think>{% endif %}{% set ns.tool = false %}
{{- m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for call in m.tool_calls %}<｜tool▁call▁begin｜>{{ call.function.name }}<｜tool▁sep｜>
{{- call.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}{{ eos_token }}
{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% set ns.tool = true %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and not ns.tool %}<｜Assistant｜>{{ '<think>' if thinking else '</think>' }}{% endif %}"""

# V4 (DSML), non-thinking mode: tools after the system prompt, tool results merged into a user turn as
# <tool_result> blocks, each argument a DSML parameter (strings as is, other values as JSON).
V4_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role in ['user', 'tool'] %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}
{%- if tools %}{{ '\n\n## Tools\n\nCall tools in a <｜DSML｜tool_calls> block.\n\n### Available Tool Schemas\n\n' }}
{%- for tool in tools %}{{ tool.function | tojson }}{{ '\n' }}{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'tool' %}{{ '<｜User｜>' if loop.previtem.role != 'tool' else '\n\n' }}<tool_result>
{{- m.content }}</tool_result>
{%- elif m.role == 'assistant' %}{{ m.content or '' }}
{%- if m.tool_calls %}{{ '\n\n<｜DSML｜tool_calls>\n' }}
{%- for call in m.tool_calls %}{{ '<｜DSML｜invoke name="' + call.function.name + '">\n' }}
{%- for key, value in call.function.arguments.items() %}
{{- '<｜DSML｜parameter name="' + key + '" string="' + ('true' if value is string else 'false') + '">' }}
{{- value if value is string else value | tojson }}</｜DSML｜parameter>{{ '\n' if not loop.last }}
{%- endfor %}{{ '\n</｜DSML｜invoke>' }}{{ '\n' if not loop.last }}
{%- endfor %}{{ '\n</｜DSML｜tool_calls>' }}{% endif %}{{ eos_token }}
{%- endif %}
{%- if m.role in ['user', 'tool'] and (loop.last or loop.nextitem.role == 'assistant') %}<｜Assistant｜></think>
{%- endif %}
{%- endfor %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

CALLS = [  # (name, arguments): strings with markup and newlines, numbers, nesting, no arguments, unicode
    ("get_weather", {"city": "Zürich <b>", "days": 3, "options": {"units": ["C", None], "alerts": True}}),
    ("get_time", {}),
    ("get_weather", {"city": "東京\nline two", "days": -1.5}),
]


def _conversation(calls: list[tuple[str, dict]], content: str | None) -> list[dict]:
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                  for i, (name, arguments) in enumerate(calls)]
    return [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Zürich and Tokyo, and the time?"},
            {"role": "assistant", "content": content, "tool_calls": tool_calls}]


def _answered(conversation: list[dict], answer: str) -> list[dict]:
    """The conversation with each call's result and the assistant's answer after them."""
    results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"}
               for i, c in enumerate(conversation[-1]["tool_calls"])]
    return conversation + results + [{"role": "assistant", "content": answer}]


def render(template: str, messages: list[dict], add_generation_prompt: bool, **variables) -> str:
    variables = {"bos_token": BOS, "eos_token": EOS, "tools": TOOLS} | variables
    return Renderer(1 << 20).render(template, template_messages(messages), variables, add_generation_prompt, False)


def completion_of(template: str, messages: list[dict], **variables) -> str:
    """What the model writes as the last message: the whole conversation's text after the prompt that asks for
    that message, without the end-of-sentence token (a stop token, not text)."""
    prompt = render(template, messages[:-1], True, **variables)
    whole = render(template, messages, False, **variables)
    assert whole.startswith(prompt), (prompt, whole)
    assert whole.endswith(EOS)
    return whole[len(prompt):-len(EOS)]


def random_chunks(text: str, rng: random.Random, most: int = 4) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, most)
        pieces.append(text[at:at + step])
        at += step
    return pieces


def streamed(make: type[ToolCallStream], pieces: list[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    stream = make()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas) or None
    calls = assemble([c for d in deltas for c in d.calls])
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def whole(make: type[ToolCallStream], text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    found = extract(make(), text)
    return found.content, [(c.function.name, json.loads(c.function.arguments)) for c in found.calls]


FORMATS = [(V3_TEMPLATE, DeepSeekV3ToolStream), (V31_TEMPLATE, DeepSeekV31ToolStream),
           (V4_TEMPLATE, DeepSeekV4ToolStream)]
IDS = ["v3", "v31", "v4"]


@pytest.mark.parametrize("template,make", FORMATS, ids=IDS)
@pytest.mark.parametrize("content", [None, "Let me look those up."])
@pytest.mark.parametrize("n_calls", [1, 3])
def test_calls_round_trip_through_the_template(template, make, content, n_calls):
    calls = CALLS[:n_calls]
    text = completion_of(template, _conversation(calls, content))
    assert whole(make, text) == (content, calls)
    rng = random.Random(n_calls)
    for _ in range(20):
        assert streamed(make, random_chunks(text, rng)) == (content, calls)


@pytest.mark.parametrize("template,make", FORMATS, ids=IDS)
def test_the_answer_after_the_results_is_content(template, make):
    """The turn after the tool results: no calls, the answer is content (markup-like text included)."""
    answer = "Sunny in Zürich, <rain> in Tokyo; it is 9:00."
    text = completion_of(template, _answered(_conversation(CALLS, None), answer))
    assert text == answer
    assert whole(make, text) == (answer, [])
    assert streamed(make, random_chunks(text, random.Random(0))) == (answer, [])


V31_CALL = '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}<｜tool▁call▁end｜>'
V3_CALL = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜>'
DSML_CALL = ('<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">UTC</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>')
UTC = ("get_time", {"zone": "UTC"})
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
V4_BEGIN, V4_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"

EDGES = [  # (parser, output, content, calls)
    # the block never closed (the output stopped after the last call)
    (DeepSeekV31ToolStream, BEGIN + V31_CALL, None, [UTC]),
    (DeepSeekV3ToolStream, BEGIN + V3_CALL + "\n" + V3_CALL, None, [UTC, UTC]),
    (DeepSeekV4ToolStream, f"{V4_BEGIN}\n{DSML_CALL}\n", None, [UTC]),
    # content after the block is content
    (DeepSeekV31ToolStream, f"a {BEGIN}{V31_CALL}{END} b", "a  b", [UTC]),
    # a call whose arguments are not a JSON object is content; the good one is still a call
    (DeepSeekV31ToolStream, f"{BEGIN}<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>{V31_CALL}{END}",
     "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>", [UTC]),
    (DeepSeekV3ToolStream, f"{BEGIN}<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{{}}<｜tool▁call▁end｜>{END}",
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜>", []),
    # the output was cut inside a call: its text is content
    (DeepSeekV31ToolStream, f'{BEGIN}<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{{"zo',
     '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zo', []),
    # text in the block that is no call ends the block: it is content
    (DeepSeekV31ToolStream, f"{BEGIN}{V31_CALL} oops {V31_CALL}", f" oops {V31_CALL}", [UTC]),
    # a marker cut at the end of the output is just text
    (DeepSeekV31ToolStream, "Done. <｜tool▁calls▁be", "Done. <｜tool▁calls▁be", []),
    (DeepSeekV4ToolStream, "Done. <｜DSML｜tool", "Done. <｜DSML｜tool", []),
    # DSML: a non-string value that is not JSON stays a string; a parameter without its string flag breaks the call
    (DeepSeekV4ToolStream, f'{V4_BEGIN}<｜DSML｜invoke name="f"><｜DSML｜parameter name="n" string="false">'
     f'twelve</｜DSML｜parameter></｜DSML｜invoke>{V4_END}', None, [("f", {"n": "twelve"})]),
    (DeepSeekV4ToolStream, f'{V4_BEGIN}<｜DSML｜invoke name="f"><｜DSML｜parameter name="n">1</｜DSML｜parameter>'
     f'</｜DSML｜invoke>{V4_END}',
     '<｜DSML｜invoke name="f"><｜DSML｜parameter name="n">1</｜DSML｜parameter></｜DSML｜invoke>', []),
    # V3.2's block name; V4's parser does not take it
    (DeepSeekV32ToolStream, f"<｜DSML｜function_calls>\n{DSML_CALL}\n</｜DSML｜function_calls>", None, [UTC]),
    (DeepSeekV4ToolStream, f"<｜DSML｜function_calls>{DSML_CALL}", f"<｜DSML｜function_calls>{DSML_CALL}", []),
]


@pytest.mark.parametrize("make,text,content,calls", EDGES)
def test_edge_outputs_whole_and_in_every_split(make, text, content, calls):
    assert whole(make, text) == (content, calls)
    for cut in range(len(text) + 1):
        assert streamed(make, [text[:cut], text[cut:]]) == (content, calls), cut
    assert streamed(make, list(text)) == (content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call():
    stream = DeepSeekV31ToolStream(parallel=False)
    deltas = [stream.feed(f"{BEGIN}{V31_CALL}{V31_CALL.replace('get_time', 'other')}{END}"), stream.finish()]
    calls = assemble([c for d in deltas for c in d.calls])
    assert [c.function.name for c in calls] == ["get_time"] and not any(d.content for d in deltas)


def test_registry_has_vllms_deepseek_names():
    assert {name: TOOL_PARSERS[name] for name in ("deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4")} == {
        "deepseek_v3": DeepSeekV3ToolStream, "deepseek_v31": DeepSeekV31ToolStream,
        "deepseek_v32": DeepSeekV32ToolStream, "deepseek_v4": DeepSeekV4ToolStream}


def _tokenizer_with_special(special: list[str]):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    words = ["a", "b", "[UNK]", *special]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                                              unk_token="[UNK]")))
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def test_tool_tags_that_are_special_tokens_are_detected():
    """A tokenizer marking V3's tags special would drop them from text decoded with skip_special_tokens: the
    chat server keeps special tokens in the text of auto tool choice for such a parser (serving_chat)."""
    v3 = DeepSeekV3ToolStream.markers()
    assert v3 == (V3_BLOCK.open, V3_BLOCK.close, V3_BLOCK.call_open, V3_BLOCK.call_close)
    special = _tokenizer_with_special(list(v3))
    assert markers_are_special(special, v3)
    assert special.decode(special.convert_tokens_to_ids([v3[0], "a"]), skip_special_tokens=True) == "a"
    assert not markers_are_special(_tokenizer_with_special([]), v3)
    assert not markers_are_special(special, DeepSeekV4ToolStream.markers())  # DSML tags are text


# ---- through the server ----

R1_SETTINGS = ServerSettings(served_model_name=("tiny",), log_stats_interval=0, log_requests=False,
                             reasoning_parser="deepseek_r1", enable_auto_tool_choice=True,
                             tool_call_parser="deepseek_v3", trust_request_chat_template=True)


def _loopback(app):
    """The app under uvicorn on a free loopback port, in a thread; yields its base URL."""
    return serve_in_thread(app)


@pytest.mark.slow  # a server and a grammar's first compile (~10 s); the parsers' round trips above run by default
def test_r1_reasoning_and_v3_calls_through_the_server(tiny_async_engine):
    """R1 thinks, then calls in V3's format: reasoning, no content, the call, whole and streamed (the
    engine's first grammar costs seconds on the CPU; the forced output itself well under one)."""
    reasoning = "Hm.\n"
    output = f"{reasoning}</think>\n\n{BEGIN}{V3_CALL}{END}"
    body = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                max_tokens=200, temperature=0,
                extra_body={"chat_template": V3_TEMPLATE, "structured_outputs": {"choice": [output]}})
    with _loopback(build_app(tiny_async_engine, R1_SETTINGS)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        whole = client.chat.completions.create(**body)
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning == reasoning and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [UTC]
    assert whole.usage.completion_tokens_details.reasoning_tokens > 0  # exact counts: the reasoning tests
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
    assert not "".join(d.content or "" for d in deltas)
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert streamed[0].function.name == UTC[0] and streamed[0].id and streamed[0].type == "function"
    assert json.loads("".join(t.function.arguments or "" for t in streamed)) == UTC[1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage == whole.usage
