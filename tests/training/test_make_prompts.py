"""`pressroom make-prompts`: training prompts the target writes itself, cleaned, distinct, of every kind,
conversations among them, and never near a held-out prompt."""
from __future__ import annotations

import json

import pytest

from pressroom.training.prompts import KINDS, Exclusion, clean, make_prompts, plan_requests, read_training_prompts


def test_cleaning_keeps_requests_and_drops_answers():
    assert clean('Question 3: "How do magnets work?"') == "How do magnets work?"
    assert clean("Sure! Here is a question about cats.") is None  # an assistant's voice, not a request
    assert clean("ok") is None and clean("12345 678 91011") is None
    assert clean("Why is the sky blue?\n\nBecause of Rayleigh scattering.") == "Why is the sky blue?"


def test_exclusion_catches_held_out_prompts_and_their_long_runs():
    held_out = ["My tomato plants have yellow leaves. What could be wrong with them this summer?"]
    ex = Exclusion(held_out)
    assert ex.excludes("my tomato plants have YELLOW leaves. what could be wrong with them this summer")
    assert ex.excludes("Help: my tomato plants have yellow leaves what could be wrong, please?")  # 8 words shared
    assert not ex.excludes("My tomato plants are tall. What should I feed them?")


def test_every_kind_is_planned_with_its_examples():
    requests = plan_requests(len(KINDS) * 3, seed=0)
    assert {r.kind for r in requests} == set(KINDS)
    assert all(r.instruction.rstrip().endswith("3.") for r in requests if r.kind != "summary")


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from pressroom import LLM
    return LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05)


def test_written_prompts_are_distinct_of_every_kind_and_avoid_the_held_out(tiny_llm, tiny_model_dir, tmp_path):
    records = make_prompts(tiny_llm, 16, seed=3, batch=27, max_tokens=16, answer_tokens=8)
    assert len(records) == 16
    texts = [json.dumps(r.get("prompt") or r["messages"]).lower() for r in records]
    assert len(set(texts)) == len(texts)
    assert len({r["kind"] for r in records}) >= len(KINDS) - 2
    conversations = [r["messages"] for r in records if "messages" in r]
    assert conversations and all([m["role"] for m in c] == ["user", "assistant", "user"] for c in conversations)
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    assert read_training_prompts(str(path)) == [r.get("prompt") or r["messages"] for r in records]
    # The same run, from the command line, told to stay away from what it wrote first, writes none of it.
    from pressroom.entrypoints.cli import main
    first = [r["prompt"] for r in records if "prompt" in r]
    (tmp_path / "held_out.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in first))
    out = tmp_path / "again.jsonl"
    assert main(["make-prompts", "--model", tiny_model_dir("llama"), "--dtype", "float32", "--kv-cache-memory-gib",
                 "0.05", "--num-prompts", "6", "--batch", "27", "--max-tokens", "16", "--seed", "3",
                 "--exclude", str(tmp_path / "held_out.jsonl"), "--output", str(out)]) == 0
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(again) == 6 and not {r.get("prompt") for r in again} & set(first)
