"""Tool-call and reasoning parsers under vLLM's names, round-tripped through each family's own format: an assistant
turn with tool calls is rendered by the family's template (a minimal one written from the published format, through
the server's sandboxed renderer), or by the family's own library where it has one (mistral-common's tokenizers
for `mistral`, openai-harmony's renderer for `openai` and `openai_gptoss`); the text the model would write is cut
out and parsed back, whole and streamed in random chunks, into the same content and calls.

openai-harmony needs the o200k vocabulary file, which it downloads; where it is not found (TIKTOKEN_ENCODINGS_BASE,
or its cache) the harmony tests build it from the npm `tiktoken` package when npm can fetch it, else skip.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from pressroom.entrypoints.openai.chat_template import template_messages
from pressroom.entrypoints.openai.protocol import ChatCompletionRequest
from pressroom.entrypoints.openai.reasoning import PARSERS, make_parser
from pressroom.entrypoints.openai.settings import REASONING_PARSERS
from pressroom.entrypoints.openai.template_worker import Renderer
from pressroom.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    GraniteToolStream,
    InternLMToolStream,
    JambaToolStream,
    KimiK2ToolStream,
    MistralToolStream,
    OpenAIToolStream,
    PythonicToolStream,
    Qwen3CoderToolStream,
    assemble,
    extract,
)
from pressroom.entrypoints.openai.tools import plan_tools

EOS = "<|eot|>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "options": {"type": "object"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
CALLS = [  # strings with markup, quotes and newlines, numbers, nesting, null, no arguments, unicode
    ("get_weather", {"city": "Zürich <b> \"q\"", "days": 3, "options": {"units": ["C", None], "alerts": True}}),
    ("get_time", {}),
    ("get_weather", {"city": "東京\nline two", "days": -2}),
]

# ---- the helpers: render, cut out the model's turn, parse whole and streamed ----


def conversation(calls, content):
    tool_calls = [{"id": f"call{i}abcd", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                  for i, (name, arguments) in enumerate(calls)]
    return [{"role": "user", "content": "Weather in Zürich and Tokyo, and the time?"},
            {"role": "assistant", "content": content, "tool_calls": tool_calls}]


def completion_of(template: str, messages: list[dict]) -> str:
    """The last message's text as the model writes it: the whole rendering after the generation prompt, less
    the end-of-turn token (a stop token, not text)."""
    def render(msgs, generation_prompt):
        return Renderer(1 << 20).render(template, template_messages(msgs), {"tools": TOOLS, "bos_token": ""},
                                        generation_prompt, False)
    prompt, whole = render(messages[:-1], True), render(messages, False)
    assert whole.startswith(prompt) and whole.endswith(EOS), (prompt, whole)
    return whole[len(prompt):-len(EOS)]


def random_chunks(text: str, rng: random.Random, most: int = 5) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, most)
        pieces.append(text[at:at + step])
        at += step
    return pieces


def _calls_of(calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def whole(make, text):
    found = extract(make(), text)
    return found.content, _calls_of(found.calls)


def streamed(make, pieces):
    stream = make()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas) or None
    return content, _calls_of(assemble([c for d in deltas for c in d.calls]))


def check_round_trip(make, text, content, calls, seed=0, rounds=15):
    assert whole(make, text) == (content, calls), text
    rng = random.Random(seed)
    for _ in range(rounds):
        assert streamed(make, random_chunks(text, rng)) == (content, calls), text


# ---- templates written from the published formats ----

# the calls as a JSON list of {"name", "arguments"} (the sandbox has no list.append)
_CALL_LIST = "[{%- for c in message.tool_calls %}{\"name\": {{ c.function.name | tojson }}, " \
    "\"arguments\": {{ c.function.arguments | tojson }}}{%- if not loop.last %}, {% endif %}{%- endfor %}]"

TEMPLATES = {
    # Jamba 1.5/1.6: the calls as one JSON list between <tool_calls> tags, after the content
    "jamba": "{%- for message in messages %}<|{{ message.role }}|>"
             "{%- if message.content %}{{ message.content }}{% endif %}"
             "{%- if message.tool_calls %}<tool_calls>" + _CALL_LIST + "</tool_calls>{% endif %}"
             "{%- if message.role == 'assistant' %}<|eot|>{% endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}<|assistant|>{% endif %}",
    # InternLM2.5 (vLLM's internlm2 tool template): each call its own plugin action after the content
    "internlm": "{%- for message in messages %}<|im_start|>{{ message.role + '\\n' }}"
                "{%- if message.content %}{{ message.content }}{% endif %}"
                "{%- for c in message.tool_calls or [] %}<|action_start|><|plugin|>\n"
                "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}<|action_end|>"
                "{%- endfor %}{%- if message.role == 'assistant' %}<|eot|>{% else %}<|im_end|>\n{% endif %}"
                "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # Granite 3.x: <|tool_call|> and the calls as a JSON list (no content with calls)
    "granite": "{%- for message in messages %}<|start_of_role|>{{ message.role }}<|end_of_role|>"
               "{%- if message.tool_calls %}<|tool_call|>" + _CALL_LIST + ""
               "{%- else %}{{ message.content }}{% endif %}"
               "{%- if message.role == 'assistant' %}<|eot|>{% else %}<|end_of_text|>\n{% endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}",
    # Kimi K2: a section of calls, each with its id functions.NAME:N, the arguments as JSON
    "kimi_k2": "{%- for message in messages %}<|im_{{ message.role }}|>{{ message.role }}<|im_middle|>"
               "{%- if message.content %}{{ message.content }}{% endif %}"
               "{%- if message.tool_calls %}<|tool_calls_section_begin|>"
               "{%- for c in message.tool_calls %}<|tool_call_begin|>functions.{{ c.function.name }}:{{ loop.index0 }}"
               "<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}<|tool_call_end|>{%- endfor %}"
               "<|tool_calls_section_end|>{% endif %}"
               "{%- if message.role == 'assistant' %}<|eot|>{% else %}<|im_end|>{% endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
    # Qwen3-Coder: XML-like calls; objects and arrays as JSON, everything else as text (Python's spelling)
    "qwen3_coder": "".join(line.strip() for line in r"""
        {%- for message in messages %}<|im_start|>{{ message.role }}
        {%- if not message.tool_calls %}{{ '\n' + message.content }}
        {%- else %}{%- if message.content %}{{ '\n' + message.content | trim + '\n' }}{% endif %}
        {%- for c in message.tool_calls %}{{ '\n<tool_call>\n<function=' + c.function.name + '>\n' }}
        {%- for k, v in c.function.arguments | items %}{{ '<parameter=' + k + '>\n' }}
        {%- if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}
        {%- else %}{{ v | string }}{% endif %}
        {{- '\n</parameter>\n' }}{%- endfor %}{{- '</function>\n</tool_call>' }}{%- endfor %}{% endif %}
        {%- if message.role == 'assistant' %}<|eot|>{% else %}<|im_end|>{{ '\n' }}{% endif %}{%- endfor %}
        {%- if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}""".splitlines()),
    # Llama 3.2/4 pythonic: a Python list of calls, keyword arguments (values written as JSON literals)
    "pythonic": "{%- for message in messages %}<|header|>{{ message.role }}<|end_header|>{{ '\\n\\n' }}"
                "{%- if message.tool_calls %}[{%- for c in message.tool_calls %}{{ c.function.name }}("
                "{%- for k, v in c.function.arguments | items %}{{ k }}={{ v | tojson }}"
                "{%- if not loop.last %}, {% endif %}{%- endfor %}){%- if not loop.last %}, {% endif %}"
                "{%- endfor %}]{%- else %}{{ message.content }}{% endif %}"
                "{%- if message.role == 'assistant' %}<|eot|>{% else %}<|eot_id|>{% endif %}{%- endfor %}"
                "{%- if add_generation_prompt %}<|header|>assistant<|end_header|>\n\n{% endif %}",
}
# (parser, template, whether the format carries content with the calls)
FAMILIES = [(JambaToolStream, "jamba", True), (InternLMToolStream, "internlm", True),
            (GraniteToolStream, "granite", False), (KimiK2ToolStream, "kimi_k2", True),
            (Qwen3CoderToolStream, "qwen3_coder", True), (PythonicToolStream, "pythonic", False)]


@pytest.mark.parametrize("make,family,with_content", FAMILIES, ids=[f for _, f, _ in FAMILIES])
@pytest.mark.parametrize("n_calls", [1, 3])
def test_calls_round_trip_through_the_family_template(make, family, with_content, n_calls):
    calls = CALLS[:n_calls]
    for content in [None, "Let me look those up."] if with_content else [None]:
        text = completion_of(TEMPLATES[family], conversation(calls, content))
        check_round_trip(make, text, content, calls, seed=n_calls)


@pytest.mark.parametrize("make,family,with_content", FAMILIES, ids=[f for _, f, _ in FAMILIES])
def test_a_plain_answer_is_content(make, family, with_content):
    answer = "Sunny in Zürich, <rain> [in] Tokyo; {it is} 9:00."
    text = completion_of(TEMPLATES[family], [{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": answer}])
    assert text == answer
    check_round_trip(make, text, answer, [])


def test_kimi_keeps_the_models_call_ids():
    text = completion_of(TEMPLATES["kimi_k2"], conversation(CALLS, None))
    assert [c.id for c in extract(KimiK2ToolStream(), text).calls] == \
        ["functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2"]


def test_qwen3_coder_types_values_by_the_tools_schema():
    """A string that looks like a number stays a string where the schema says so; without the schema, JSON-like
    text is read as JSON and Python's True/None as booleans and null."""
    calls = [("get_weather", {"city": "123", "days": 7, "options": {"a": [1]}})]
    text = completion_of(TEMPLATES["qwen3_coder"], conversation(calls, None))
    typed = lambda: Qwen3CoderToolStream(tools=TOOLS)  # noqa: E731
    check_round_trip(typed, text, None, calls)
    # the server's plan for an "auto" request hands the request's tools to the parser it makes
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    planned = plan_tools(request, Qwen3CoderToolStream).make_stream
    check_round_trip(planned, text, None, calls)
    assert whole(Qwen3CoderToolStream, text)[1] == [("get_weather", {"city": 123, "days": 7, "options": {"a": [1]}})]
    body = "<tool_call>\n<function=f>\n<parameter=a>\nTrue\n</parameter>\n<parameter=b>\nNone\n</parameter>\n" \
           "<parameter=c>\n\"quoted\"\n</parameter>\n</function>\n</tool_call>"
    assert whole(Qwen3CoderToolStream, body)[1] == [("f", {"a": True, "b": None, "c": '"quoted"'})]


EDGES = [  # (parser, output, content, calls): what a model may get wrong
    (JambaToolStream, '<tool_calls>[{"name": "f", "arguments": {"a": }]</tool_calls> x',
     '<tool_calls>[{"name": "f", "arguments": {"a": }]</tool_calls> x', []),
    (JambaToolStream, '<tool_calls>[{"name": "f", "arguments": {}}]', None, [("f", {})]),  # cut before closing
    (InternLMToolStream, '<|action_start|><|plugin|>\n{"name": "f", "arguments": "{\\"a\\": 1}"}<|action_end|>',
     None, [("f", {"a": 1})]),
    (InternLMToolStream, "<|action_start|><|plugin|>\nnot json<|action_end|>",
     "<|action_start|><|plugin|>\nnot json<|action_end|>", []),
    (GraniteToolStream, '<tool_call>[{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
    (GraniteToolStream, "Answer: <|tool_ca", "Answer: <|tool_ca", []),
    (KimiK2ToolStream, '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>'
     '{"a": [1, "<|x|>"]}<|tool_call_end|>', None, [("f", {"a": [1, "<|x|>"]})]),  # section never closed
    (KimiK2ToolStream, '<|tool_calls_section_begin|><|tool_call_begin|>f<|tool_call_argument_begin|>{}'
     '<|tool_call_end|><|tool_calls_section_end|>', '<|tool_calls_section_begin|><|tool_call_begin|>f'
     '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>', []),  # no functions.NAME:N id
    (Qwen3CoderToolStream, "<tool_call>\n<function=f>\n</function>\n</tool_call>", None, [("f", {})]),
    (Qwen3CoderToolStream, "<tool_call>\n<functio", "<tool_call>\n<functio", []),
    (PythonicToolStream, '[f(a="]", b={"k": (1, 2)})] then', "then", [("f", {"a": "]", "b": {"k": [1, 2]}})]),
    (PythonicToolStream, "[f(1)]", "[f(1)]", []),  # positional arguments: not a call
    (PythonicToolStream, "[f(a=x)]", "[f(a=x)]", []),  # a variable: not a literal
    (PythonicToolStream, '<|python_start|>[f(a=1)]<|python_end|>', None, [("f", {"a": 1})]),
    (PythonicToolStream, "[f(a=1)", "[f(a=1)", []),  # never closed
    (MistralToolStream, 'Hi[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "Hi", [("f", {"a": 1}), ("g", {})]),
    (MistralToolStream, "[TOOL_CALLS]f[ARGS]{oops", "[TOOL_CALLS]f[ARGS]{oops", []),
    (MistralToolStream, "a [TOOL_CA", "a [TOOL_CA", []),
    # harmony: the recipient after the channel, or right after the prompt's role; a preamble is content
    (OpenAIToolStream, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}', None,
     [("f", {"a": 1})]),
    (OpenAIToolStream, ' to=functions.f<|channel|>commentary json<|message|>{"a": "<|end|"}', None,
     [("f", {"a": "<|end|"})]),
    (OpenAIToolStream, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f"
     "<|channel|>commentary json<|message|>{}", "Checking.", [("f", {})]),
    (OpenAIToolStream, '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=browser.search'
     '<|channel|>commentary<|message|>{"q": 1}', None, []),  # a built-in tool: not a function call
    (OpenAIToolStream, "<|channel|>commentary to=functions.f json<|message|>not json", "not json", []),
    (OpenAIToolStream, "<|channel|>final<|message|>a <|chan", "a <|chan", []),
    (OpenAIToolStream, "plain answer", "plain answer", []),
]


@pytest.mark.parametrize("make,text,content,calls", EDGES)
def test_edge_outputs_whole_and_in_every_split(make, text, content, calls):
    assert whole(make, text) == (content, calls)
    for cut in range(len(text) + 1):
        assert streamed(make, [text[:cut], text[cut:]]) == (content, calls), cut
    assert streamed(make, list(text)) == (content, calls)


def test_registry_has_vllms_names():
    for name in ("mistral", "qwen3_coder", "pythonic", "deepseek_v3", "deepseek_v31", "granite", "kimi_k2",
                 "openai", "internlm", "jamba", "hermes", "llama3_json"):
        assert name in TOOL_PARSERS
    for name in ("deepseek_r1", "deepseek_v3", "qwen3", "granite", "openai_gptoss", "gpt_oss"):
        assert name in PARSERS and name in REASONING_PARSERS


# ---- mistral: mistral-common's own tokenizers write the turn ----


def _mistral_tokenizer(version: str, tmp: Path):
    """mistral-common's bundled Tekken vocabulary under a tokenizer version (v7: the JSON list, v11: [CALL_ID],
    v13: [ARGS] only), with the control tokens those versions need."""
    import mistral_common
    from mistral_common.tokens.tokenizers.base import SpecialTokens
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    model = json.loads((Path(mistral_common.__file__).parent / "data" / "tekken_240911.json").read_text())
    specials = [dict(t, token_str=str(t["token_str"])) for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    for token in SpecialTokens:
        if token.value not in {t["token_str"] for t in specials}:
            specials.append({"rank": len(specials), "token_str": token.value, "is_control": True})
    model["config"]["version"], model["special_tokens"] = version, specials
    path = tmp / f"tekken_{version}.json"
    path.write_text(json.dumps(model))
    return MistralTokenizer.from_file(str(path))


@pytest.mark.parametrize("version", ["v7", "v11", "v13"])
def test_mistral_round_trips_through_mistral_common(version, tmp_path):
    pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    tokenizer = _mistral_tokenizer(version, tmp_path)
    ids = [f"abc{i}def{i}9" for i in range(len(CALLS))]
    assistant = AssistantMessage(content="Let me check.", tool_calls=[
        ToolCall(id=i, function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
        for i, (name, arguments) in zip(ids, CALLS)])
    results = [ToolMessage(content=f"result {k}", tool_call_id=i) for k, i in enumerate(ids)]
    request = ChatCompletionRequest(messages=[UserMessage(content="Weather?"), assistant, *results],
                                    tools=[Tool(function=Function(**t["function"])) for t in TOOLS])
    tokens = tokenizer.encode_chat_completion(request).tokens
    text = tokenizer.instruct_tokenizer.tokenizer.decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP)
    turn = text[text.rindex("[/INST]") + len("[/INST]"):text.index("</s>", text.rindex("[/INST]"))]
    assert "[TOOL_CALLS]" in turn
    check_round_trip(MistralToolStream, turn, "Let me check.", CALLS)
    found = extract(MistralToolStream(), turn).calls
    if version != "v13":  # v13 writes no ids: new ones are made, 9 letters and digits as Mistral wants
        assert [c.id for c in found] == ids
    assert all(len(c.id) == 9 and c.id.isalnum() for c in found)


# ---- gpt-oss: openai-harmony renders the turn ----

_O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def _o200k_from_npm(folder: Path) -> bool:
    """o200k_base.tiktoken rebuilt from the npm `tiktoken` package's rank table (the same ranks), checked against
    the file's published hash."""
    if shutil.which("npm") is None:
        return False
    try:
        packed = subprocess.run(["npm", "pack", "tiktoken@1.0.22", "--silent"], cwd=folder, capture_output=True,
                                text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
        with tarfile.open(folder / packed) as tar:
            ranks = json.load(tar.extractfile("package/encoders/o200k_base.json"))["bpe_ranks"]
    except (subprocess.SubprocessError, OSError, KeyError, IndexError, ValueError):
        return False
    pairs = []
    for line in ranks.split("\n"):
        if line:
            _, offset, *tokens = line.split(" ")
            pairs += [(int(offset) + k, t) for k, t in enumerate(tokens)]
    data = "".join(f"{t} {r}\n" for r, t in sorted(pairs)).encode()
    base64.b64decode(pairs[0][1])  # a rank table of base64 tokens
    if hashlib.sha256(data).hexdigest() != _O200K_SHA256:
        return False
    (folder / "o200k_base.tiktoken").write_bytes(data)
    return True


@pytest.fixture(scope="module")
def harmony_encoding():
    harmony = pytest.importorskip("openai_harmony")
    try:
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except harmony.HarmonyError:
        pass
    folder = Path(os.environ.get("PRESSROOM_CACHE", Path.home() / ".cache" / "pressroom")) / "o200k"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "o200k_base.tiktoken").exists() and not _o200k_from_npm(folder):
        pytest.skip("openai-harmony's o200k vocabulary is not available offline (no npm to rebuild it)")
    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous


def _harmony_turn(encoding, messages) -> str:
    """The assistant messages as the model writes them after `<|start|>assistant`: rendered by openai-harmony
    (analysis kept), the leading start and role cut off, the last stop token (not text) dropped."""
    from openai_harmony import Conversation, RenderConversationConfig
    config = RenderConversationConfig(auto_drop_analysis=False)
    text = encoding.decode(encoding.render_conversation(Conversation.from_messages(messages), config))
    prompt = "<|start|>assistant"
    assert text.startswith(prompt)
    text = text[len(prompt):]
    for stop in ("<|call|>", "<|return|>", "<|end|>"):
        if text.endswith(stop):
            return text[:-len(stop)]
    return text


def _gpt_oss_messages(calls, final: str | None):
    from openai_harmony import Message, Role
    messages = [Message.from_role_and_content(Role.ASSISTANT, "The user wants weather; call the tools.")
                .with_channel("analysis")]
    if final is not None:
        messages.append(Message.from_role_and_content(Role.ASSISTANT, final).with_channel("final"))
    for name, arguments in calls:
        messages.append(Message.from_role_and_content(Role.ASSISTANT, json.dumps(arguments, ensure_ascii=False))
                        .with_channel("commentary").with_recipient(f"functions.{name}")
                        .with_content_type("<|constrain|>json"))
    return messages


class _HarmonyTokenizer:
    """What the reasoning parser asks of a tokenizer, answered by openai-harmony's encoding."""
    unk_token_id = None

    def __init__(self, encoding) -> None:
        self.encoding = encoding
        self.all_special_ids = [encoding.encode(t, allowed_special="all")[0] for t in encoding.special_tokens_set]

    def convert_tokens_to_ids(self, token):
        ids = self.encoding.encode(token, allowed_special="all")
        return ids[0] if len(ids) == 1 else None

    def encode(self, text, add_special_tokens=False):
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids, skip_special_tokens=False):
        return self.encoding.decode(ids)


@pytest.mark.parametrize("n_calls", [1, 3])
def test_openai_calls_round_trip_through_harmony(harmony_encoding, n_calls):
    calls = CALLS[:n_calls]
    text = _harmony_turn(harmony_encoding, _gpt_oss_messages(calls, None))
    assert text.startswith("<|channel|>analysis<|message|>")
    check_round_trip(OpenAIToolStream, text, None, calls, seed=n_calls)
    # openai-harmony's own parser reads the same calls from the tokens
    parsed = harmony_encoding.parse_messages_from_completion_tokens(
        harmony_encoding.encode(text + "<|call|>", allowed_special="all"), role=_assistant())
    assert [(m.recipient, json.loads(m.content[0].text)) for m in parsed if m.recipient] == \
        [(f"functions.{n}", a) for n, a in calls]


def _assistant():
    from openai_harmony import Role
    return Role.ASSISTANT


def test_gpt_oss_reasoning_then_tool_parser(harmony_encoding):
    """--reasoning-parser openai_gptoss with --tool-call-parser openai: analysis is reasoning, the final message
    content, the calls read from what the reasoning parser passes on; the same for any chunking."""
    tokenizer = _HarmonyTokenizer(harmony_encoding)
    parser = make_parser("openai_gptoss", tokenizer)
    assert parser.markers_are_special and make_parser("gpt_oss", tokenizer) is not None
    text = _harmony_turn(harmony_encoding, _gpt_oss_messages(CALLS[:2], "Checking now."))
    expected_reasoning = "The user wants weather; call the tools."
    assert parser.split(text, False)[0] == expected_reasoning
    rng = random.Random(7)
    for pieces in [[text]] + [random_chunks(text, rng) for _ in range(15)]:
        splitter, tools = parser.stream(False), OpenAIToolStream()
        reasoning, deltas = [], []
        for piece in pieces + [None]:
            r, c = splitter.feed(piece) if piece is not None else splitter.finish()
            reasoning.append(r)
            deltas.append(tools.feed(c))
        deltas.append(tools.finish())
        assert "".join(reasoning) == expected_reasoning
        assert "".join(d.content for d in deltas) == "Checking now."
        assert _calls_of(assemble([c for d in deltas for c in d.calls])) == CALLS[:2]
    ids = harmony_encoding.encode(text, allowed_special="all")
    analysis = harmony_encoding.encode("<|channel|>analysis<|message|>" + expected_reasoning + "<|end|>",
                                       allowed_special="all")
    assert parser.count_reasoning_tokens(ids, False) == len(analysis)


def test_gpt_oss_final_answer_only(harmony_encoding):
    tokenizer = _HarmonyTokenizer(harmony_encoding)
    parser = make_parser("openai_gptoss", tokenizer)
    from openai_harmony import Message, Role
    text = _harmony_turn(harmony_encoding, [Message.from_role_and_content(Role.ASSISTANT, "Hmm.")
                                            .with_channel("analysis"),
                                            Message.from_role_and_content(Role.ASSISTANT, "It is <b>42</b>.")
                                            .with_channel("final")])
    assert parser.split(text, False) == ("Hmm.", "It is <b>42</b>.")
    assert whole(OpenAIToolStream, text) == ("It is <b>42</b>.", [])


# ---- the other reasoning parsers ----

HARMONY_SPLITS = [  # (output, (reasoning or None, content)): harmony read as text, with no vocabulary
    ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>answer",
     ("think", "answer")),
    ("<|channel|>final<|message|>answer", (None, "answer")),
    ("<|channel|>analysis<|message|>still", ("still", "")),
    ("<|channel|>analysis<|message|>t<|end|><|start|>assistant<|channel|>commentary to=functions.f json<|message|>{}",
     ("t", "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}")),
    ("no header at all", (None, "no header at all")),
]


@pytest.mark.parametrize("text,expected", HARMONY_SPLITS)
def test_gpt_oss_reasoning_any_chunking(text, expected):
    parser = make_parser("openai_gptoss", _Vocab())
    assert not parser.markers_are_special  # this vocabulary has no harmony tokens: plain text
    assert parser.split(text, False) == expected
    for cut in range(len(text) + 1):
        stream = parser.stream(False)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        assert ((reasoning if stream.seen_span else None), "".join(c for _, c in parts)) == expected, cut



class _Vocab:
    """A tokenizer of one token per character, with <think> and </think> as special tokens."""
    unk_token_id = 0
    all_special_ids = [1, 2]
    chat_template = None

    def convert_tokens_to_ids(self, token):
        return {"<think>": 1, "</think>": 2}.get(token, 0)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) + 10 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join({1: "<think>", 2: "</think>"}.get(i, chr(i - 10) if i > 10 else "") for i in ids)


# Qwen3's template, reduced to what decides the span: enable_thinking=False closes an empty span in the prompt
QWEN3 = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}" \
        "{%- if add_generation_prompt %}<|im_start|>assistant\n" \
        "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"


@pytest.mark.parametrize("kwargs,output,expected", [
    ({}, "<think>\nwhy\n</think>\n\nbecause", ("\nwhy\n", "\n\nbecause")),
    ({"enable_thinking": False}, "because <think>", (None, "because <think>")),
])
def test_qwen3_follows_the_template(kwargs, output, expected):
    parser = make_parser("qwen3", _Vocab())
    prompt = Renderer(1 << 20).render(QWEN3, [{"role": "user", "content": "Why?"}], kwargs, True, False)
    opens = parser.prompt_opens(_ids(prompt))
    assert not opens
    assert parser.split(output, opens) == expected
    rng = random.Random(1)
    for _ in range(10):
        stream = parser.stream(opens)
        parts = [stream.feed(p) for p in random_chunks(output, rng)] + [stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        assert ((reasoning if stream.seen_span else None), "".join(c for _, c in parts)) == expected


def _ids(text: str) -> list[int]:
    """_Vocab's ids of a text whose <think> / </think> are the special tokens."""
    out, at = [], 0
    while at < len(text):
        for marker, token in (("<think>", 1), ("</think>", 2)):
            if text.startswith(marker, at):
                out.append(token)
                at += len(marker)
                break
        else:
            out.append(ord(text[at]) + 10)
            at += 1
    return out


def test_qwen3_thinking_2507_prompt_opens_the_span():
    parser = make_parser("qwen3", _Vocab())
    assert parser.prompt_opens(_ids("<|im_start|>assistant\n<think>\n"))
    assert parser.split("reasoning</think>answer", True) == ("reasoning", "answer")


GRANITE = [
    ("Here is my thought process:\nsteps\nHere is my response:\nanswer", False, ("\nsteps\n", "\nanswer")),
    ("Here's my thought process: a Here's my response: b", False, (" a ", " b")),
    ("Just an answer. Here is my response: x", False, (None, "Just an answer. Here is my response: x")),
    ("Here is my thought process: still thinking", False, (" still thinking", "")),
    ("Here is my tho", False, (None, "Here is my tho")),
]


@pytest.mark.parametrize("text,opens,expected", GRANITE)
def test_granite_reasoning_any_chunking(text, opens, expected):
    parser = make_parser("granite", _Vocab())
    assert parser.split(text, opens) == expected
    for cut in range(len(text) + 1):
        stream = parser.stream(opens)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        assert ((reasoning if stream.seen_span else None), "".join(c for _, c in parts)) == expected, cut
    ids = _Vocab().encode(text)
    counted = parser.count_reasoning_tokens(ids, opens)
    if expected[0] is None:
        assert counted == 0
    elif "response:" in text:
        assert counted == text.index("response:") + len("response:")
    else:
        assert counted == len(ids)


def test_unknown_reasoning_parser_is_a_value_error():
    with pytest.raises(ValueError, match="openai_gptoss"):
        make_parser("harmony", _Vocab())


# ---- the server: --reasoning-parser openai_gptoss --tool-call-parser openai ----


@pytest.mark.slow  # a server and a grammar's first compile (~10 s); the round trips above run by default
def test_gpt_oss_reasoning_and_calls_through_the_server(tiny_async_engine):
    """The harmony text forced by structured outputs (the tiny model's vocabulary has no harmony tokens, so the
    markers are plain text): reasoning from the analysis channel, the call from the commentary message, whole
    and streamed."""
    import openai
    from test_deepseek_tools import _loopback

    from pressroom.entrypoints.openai.server import build_app
    from pressroom.entrypoints.openai.settings import ServerSettings
    settings = ServerSettings(served_model_name=("tiny",), log_stats_interval=0, log_requests=False,
                              reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
                              tool_call_parser="openai")
    output = ('<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant to=functions.get_time'
              '<|channel|>commentary json<|message|>{"zone": "UTC"}')
    body = dict(model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=[TIME], max_tokens=200,
                temperature=0, extra_body={"structured_outputs": {"choice": [output]}})
    with _loopback(build_app(tiny_async_engine, settings)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        whole_response = client.chat.completions.create(**body)
        chunks = list(client.chat.completions.create(stream=True, **body))
    choice = whole_response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning == "Hm." and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_time", {"zone": "UTC"})]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Hm."
    assert not "".join(d.content or "" for d in deltas)
    streamed_calls = [t for d in deltas for t in d.tool_calls or []]
    assert streamed_calls[0].function.name == "get_time"
    assert json.loads("".join(t.function.arguments or "" for t in streamed_calls)) == {"zone": "UTC"}
