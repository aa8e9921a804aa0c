"""`pressroom bench structured`'s parts: the server it starts (dummy weights get the embedded SmolLM2's tokenizer),
the client's body (the schema in `structured_outputs`), and the summary's ratio."""
from __future__ import annotations

import argparse

from pressroom.benchmarks import serve
from pressroom.benchmarks.structured import SCHEMA, _client_args, _serve_command, add_structured_bench_args, summarize
from pressroom.model.gguf_file import embedded_model_path


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_structured_bench_args(parser)
    return parser.parse_args(list(argv))


def test_dummy_weights_get_the_embedded_tokenizer():
    cmd = _serve_command(_args("--model", "llama-3.1-8b", "--load-format", "dummy",
                               "--serve-args", "--gpu-memory-utilization 0.85"), 8123)
    assert cmd[cmd.index("--tokenizer") + 1] == embedded_model_path()
    assert cmd[-2:] == ["--gpu-memory-utilization", "0.85"] and cmd[cmd.index("--max-num-seqs") + 1] == "32"
    assert "--tokenizer" not in _serve_command(_args(), 8123)


def test_the_constrained_rounds_send_the_schema():
    args = _args()
    body = serve._payload(_client_args(args, "http://x", True, SCHEMA), "m", "hi", 8)
    assert body["structured_outputs"] == {"json": SCHEMA} and body["ignore_eos"]
    assert "structured_outputs" not in serve._payload(_client_args(args, "http://x", False, SCHEMA), "m", "hi", 8)


def test_summary_ratio():
    rounds = [("unconstrained", {"total_output_tokens": 1000, "duration": 10.0, "output_throughput": 100.0,
                                 "median_tpot_ms": 5.0}),
              ("constrained", {"total_output_tokens": 1000, "duration": 12.5, "output_throughput": 80.0,
                               "median_tpot_ms": 6.0})]
    report = summarize(rounds)
    assert report["unconstrained"]["output_throughput"] == 100.0 and report["ratio"] == 0.8
