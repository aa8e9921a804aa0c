"""The console script end to end, in a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

ENGINE = ["--dtype", "float32", "--kv-cache-memory-gib", "0.05"]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_each_completion(tiny_model_dir):
    r = _cli("generate", "Hello there", "Second prompt", "--model", tiny_model_dir("llama"), "--max-tokens", "5",
             *ENGINE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- ") == 2 and "'Hello there'" in r.stdout


def test_chat_streams_replies_for_each_turn(tiny_model_dir):
    r = _cli("chat", "--model", tiny_model_dir("qwen3"), "--max-tokens", "6", "--temperature", "0", *ENGINE,
             stdin="hi\nagain\n")
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 2


def test_unknown_model_is_a_clear_error():
    r = _cli("generate", "x", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_bench_throughput_writes_json(tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    r = _cli("bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "4", "--input-len", "8",
             "--output-len", "4", "--ignore-eos", "--output-json", str(out), *ENGINE)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    result = report["results"][0]
    assert result["backend"] == "pressroom" and result["total_output_tokens"] == 16
    assert result["output_tokens_per_s"] > 0
