"""The server's grammar sandbox (structured_outputs.GrammarSandbox, grammar_worker.py), with lowered caps on SmolLM2's
tokenizer: a grammar past the compile deadline or the memory cap is refused (a 400 naming structured_outputs and the
cap), its worker replaced, the next grammar served and the refused one refused again at once; what the sandbox
parsed, the engine core compiles without parsing, into the very grammar it compiles from the source today."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import pytest

from pressroom.core import structured_outputs as so
from pressroom.entrypoints.openai.chat_template import Preprocessor
from pressroom.entrypoints.openai.errors import APIError
from pressroom.sampling_params import StructuredOutputsParams

VOCAB = 49152
DEADLINE_S = 0.5  # a real schema compiles in tens of milliseconds; the bomb below takes seconds
TIGHT_BYTES = 1 << 20


def _deep_schema(depth: int) -> str:
    schema: dict = {}
    for _ in range(depth):
        schema = {"items": schema}
    return json.dumps(schema)


BOMB = so.GrammarSource("json", _deep_schema(300))  # past MAX_DEPTH: given to the sandbox as is, it parses for ~2 s
# 3,000 alternatives of 50 characters (170 KB): parsed in milliseconds, in more than TIGHT_BYTES
GREEDY = so.GrammarSource("ebnf", "root ::= " + " | ".join(f'"{i:050d}"' for i in range(3000)))
NORMAL = [StructuredOutputsParams(json={"type": "object", "properties": {
              "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
          StructuredOutputsParams(json_object=True),
          StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
          StructuredOutputsParams(choice=["yes", "no", "it's \"complicated\""])]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def preprocessor(loop, smollm_tokenizer):
    pre = Preprocessor(smollm_tokenizer, 10_000, grammars=so.GrammarSandbox(smollm_tokenizer, workers=1,
                                                                               timeout_s=DEADLINE_S))
    yield pre
    loop.run_until_complete(pre.close())


def test_a_grammar_past_the_deadline_is_a_400_and_the_next_is_served(loop, preprocessor, monkeypatch):
    monkeypatch.setattr(so, "MAX_DEPTH", 1000)  # the static limit would refuse the bomb before the sandbox
    bomb = StructuredOutputsParams(json=BOMB.text)
    assert loop.run_until_complete(preprocessor.structured_outputs(NORMAL[1], VOCAB)).parsed_grammar  # started
    start = time.perf_counter()
    with pytest.raises(APIError) as refused:
        loop.run_until_complete(preprocessor.structured_outputs(bomb, VOCAB))
    assert refused.value.status == 400 and refused.value.param == "structured_outputs"
    assert "--max-grammar-compile-seconds" in refused.value.message
    assert time.perf_counter() - start < DEADLINE_S + 1
    served = loop.run_until_complete(preprocessor.structured_outputs(NORMAL[0], VOCAB))  # by the replacement
    assert served.parsed_grammar and served.json == NORMAL[0].json
    start = time.perf_counter()
    with pytest.raises(APIError, match="--max-grammar-compile-seconds"):  # the verdict is kept: no worker lost again
        loop.run_until_complete(preprocessor.structured_outputs(bomb, VOCAB))
    assert time.perf_counter() - start < 0.5


def test_the_static_limits_and_what_xgrammar_refuses_are_400s(loop, preprocessor):
    for params, words in [(StructuredOutputsParams(json=BOMB.text), "MAX_DEPTH"),
                          (StructuredOutputsParams(regex="(a"), "Invalid structured output regex"),
                          (StructuredOutputsParams(json='{"type": "nothing"}'), "Invalid structured output JSON")]:
        with pytest.raises(APIError, match=words) as refused:
            loop.run_until_complete(preprocessor.structured_outputs(params, VOCAB))
        assert refused.value.status == 400 and refused.value.param == "structured_outputs"


def test_a_grammar_past_the_memory_cap_is_refused_and_the_next_is_served(loop, smollm_tokenizer):
    sandbox = so.GrammarSandbox(smollm_tokenizer, workers=1, max_bytes=TIGHT_BYTES)
    try:
        with pytest.raises(ValueError, match="--max-grammar-compile-mib"):
            loop.run_until_complete(sandbox.parsed(GREEDY, VOCAB))
        regex = so.grammar_source(NORMAL[2])
        assert loop.run_until_complete(sandbox.parsed(regex, VOCAB))  # by the worker that replaced it
    finally:
        loop.run_until_complete(sandbox.close())


@pytest.mark.parametrize("params", NORMAL, ids=["schema", "json-object", "regex", "choice"])
def test_the_core_compiles_the_sandboxs_parse_into_todays_grammar(loop, preprocessor, smollm_tokenizer, params,
                                                                  monkeypatch):
    def compiler() -> so.GrammarCompiler:  # portable: its compiles come as xgrammar's JSON, comparable as text
        return so.GrammarCompiler(lambda: smollm_tokenizer, VOCAB, smollm_tokenizer.eos_token_id, portable=True)

    today, core = compiler(), compiler()
    try:
        expected = today.compile(params).result()
        shipped = loop.run_until_complete(preprocessor.structured_outputs(params, VOCAB))
        assert so.check(shipped) == so.grammar_source(params)  # the engine's own check does not parse again

        def no_parse(source):
            raise AssertionError("the core parsed a grammar the sandbox had parsed")

        monkeypatch.setattr(so, "_parse", no_parse)
        assert core.compile(shipped).result() == expected
        assert core.compile(replace(params, parsed_grammar=None)).result() == expected  # one compile per source
    finally:
        today.shutdown()
        core.shutdown()
