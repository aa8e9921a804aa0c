"""Grammar bombs (issue 41): the schemas, patterns and regexes whose parse took xgrammar minutes and gigabytes are
refused by `check` within a second, with a ValueError naming the limit, however the bound is written; a
realistic schema still passes."""
import json
import time

import pytest

from pressroom.core import structured_outputs as so
from pressroom.sampling_params import StructuredOutputsParams

DEEP_TEXT = '{"items":' * 6500 + "{}" + "}" * 6500  # 65,002 characters: the API grew by 4.8 GB


def _deep_dict(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"items": schema}
    return schema


# a \u007b escape is "{" once decoded: the bound it hides is {1,10000}
ESCAPED_PATTERN = '{"type": "string", "pattern": "[a-z]\\u007b1,10000\\u007d"}'

BOMBS = [
    (StructuredOutputsParams(json=DEEP_TEXT), "MAX_DEPTH"),
    (StructuredOutputsParams(json=_deep_dict(800)), "MAX_DEPTH"),
    (StructuredOutputsParams(json=ESCAPED_PATTERN), "MAX_REPEAT"),
    (StructuredOutputsParams(regex="(a|b){1,10000}"), "MAX_REPEAT"),
    (StructuredOutputsParams(regex="((a|b){1,1000}){1,1000}"), "MAX_REPEAT_TOTAL"),
    (StructuredOutputsParams(regex="(" * 100 + "a" + ")" * 100), "MAX_DEPTH"),
    (StructuredOutputsParams(json={"enum": list(range(so.MAX_SCHEMA_WIDTH + 1))}), "MAX_SCHEMA_WIDTH"),
    (StructuredOutputsParams(json={"anyOf": [{"type": "integer"}] * (so.MAX_SCHEMA_WIDTH + 1)}), "MAX_SCHEMA_WIDTH"),
    (StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                    for i in range(so.MAX_SCHEMA_NODES)}}),
     "MAX_SCHEMA_NODES"),
]


@pytest.mark.parametrize("params,limit", BOMBS, ids=["deep-text", "deep-dict", "escaped-bound", "regex-bound",
                                                     "nested-bounds", "deep-regex", "wide-enum", "wide-anyof",
                                                     "many-nodes"])
def test_a_grammar_bomb_is_refused_within_a_second_naming_its_limit(params, limit):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=limit):
        so.check(params)
    assert time.perf_counter() - start < 1.0


def test_a_bound_is_the_same_bound_however_the_schema_writes_it():
    plain = {"type": "string", "pattern": "[a-z]{1,10000}"}
    for written in (plain, json.dumps(plain), ESCAPED_PATTERN):
        with pytest.raises(ValueError, match="JSON schema repeats too much"):
            so.check(StructuredOutputsParams(json=written))


def test_an_escaped_brace_in_a_regex_is_a_literal_not_a_bound():
    so.check(StructuredOutputsParams(regex=r"a\{1,10000\}"))
    so.check(StructuredOutputsParams(regex="[{]1,10000}"))


def _realistic_schema(depth: int) -> dict:
    """An order: nested objects `depth` deep, a few anyOf, enums, patterns and bounds as real schemas have."""
    leaf = {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 100},
        "note": {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "null"}]},
        "unit": {"enum": ["kg", "g", "l", "ml", "piece"]}}, "required": ["sku", "qty"]}
    schema = leaf
    for level in range(depth - 1):
        schema = {"type": "object", "properties": {
            "name": {"type": "string", "description": f"level {level} (the {{name}} placeholder)"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "child": {"anyOf": [schema, {"type": "null"}]}}, "required": ["name"]}
    return schema


@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_a_realistic_nested_schema_is_accepted(as_text):
    schema = _realistic_schema(8)
    source = so.check(StructuredOutputsParams(json=json.dumps(schema) if as_text else schema))
    assert source.kind == "json" and json.loads(source.text) == schema


def test_the_limits_leave_room_for_what_they_allow():
    """The deepest, widest schema and the most repetitive regex the limits allow parse quickly."""
    start = time.perf_counter()
    so.check(StructuredOutputsParams(json=_deep_dict(so.MAX_DEPTH - 1)))
    so.check(StructuredOutputsParams(json={"enum": list(range(so.MAX_SCHEMA_WIDTH))}))
    so.check(StructuredOutputsParams(regex="[a-z]{1,1000}"))
    so.check(StructuredOutputsParams(json={"type": "string", "maxLength": 20000}))  # counted by xgrammar, not expanded
    assert time.perf_counter() - start < 5.0
