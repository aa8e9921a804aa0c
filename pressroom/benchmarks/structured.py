"""`pressroom bench structured`: structured outputs' cost when serving. One `pressroom serve` subprocess, loaded by
`bench serve`'s client in alternating rounds: unconstrained, then every request constrained by one fixed JSON
schema (vLLM's `structured_outputs`), at the same concurrency, prompts and output length (EOS ignored, so both
emit the same tokens; once a constrained output completes its schema, the grammar allows only EOS). It reports
output tok/s of both and their ratio (constrained / unconstrained).

Dummy weights have no tokenizer of their own; the embedded SmolLM2's stands in (as `benchmarks/gpu/serve_vs_offline.sh`
does): it makes the random prompts and the grammar's vocabulary, masked to the model's larger logits width.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from pressroom.benchmarks import serve as serve_bench
from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.benchmarks.workload import machine
from pressroom.model.gguf_file import embedded_model_path

# An order with nested objects, an enum, bounded integers and numbers, a string pattern and a bounded array.
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "maxLength": 60},
            "vip": {"type": "boolean"}}, "required": ["name", "email", "vip"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 16},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0, "maximum": 10000}}, "required": ["sku", "quantity", "price"]}},
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": ["order_id", "status", "customer", "items", "notes"],
}
MODES = ("unconstrained", "constrained")


def add_structured_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=shape_arg, default=None,
                        help=shape_help("the model (default: the embedded SmolLM2); a shape wants --load-format dummy"))
    parser.add_argument("--load-format", default="auto", help="auto, or dummy for random weights at the config's "
                                                              "shapes")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or .gguf (default: the model's; the embedded SmolLM2's for dummy "
                             "weights)")
    parser.add_argument("--schema", default=None, help="a JSON schema file (default: a built-in order schema)")
    parser.add_argument("--max-concurrency", type=int, default=32, help="streams in flight (and the server's "
                                                                        "max_num_seqs)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per round")
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--random-output-len", type=int, default=128, help="output tokens per request (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
    parser.add_argument("--serve-args", default="", help="more `pressroom serve` flags, as one string")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the server to come up")
    parser.add_argument("--seed", type=int, default=0, help="the prompts")
    parser.add_argument("--output-json", default=None, help="write the report here")


def _serve_command(args, port: int) -> list[str]:
    tokenizer = args.tokenizer or (embedded_model_path() if args.load_format == "dummy" else None)
    cmd = [sys.executable, "-m", "pressroom.entrypoints.cli", "--log-level", "WARNING", "serve"]
    cmd += [args.model] if args.model else []
    cmd += ["--load-format", args.load_format, "--port", str(port), "--max-num-seqs", str(args.max_concurrency)]
    cmd += ["--tokenizer", tokenizer] if tokenizer else []
    return cmd + shlex.split(args.serve_args)


def _client_args(args, url: str, constrained: bool, schema: dict) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_bench.add_cli_args(parser)
    ns = parser.parse_args(["--base-url", url, "--ignore-eos", "--num-prompts", str(args.num_prompts),
                            "--max-concurrency", str(args.max_concurrency), "--random-input-len",
                            str(args.random_input_len), "--random-output-len", str(args.random_output_len),
                            "--seed", str(args.seed)])
    ns.structured_outputs = {"json": schema} if constrained else None
    return ns


def run(args) -> dict:
    """Starts the server, runs the rounds (unconstrained first), stops the server; the report."""
    schema = _load_schema(args.schema)
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(_serve_command(args, port), stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(server, log, url, args.startup_timeout)
            rounds = [(mode, _round(args, url, mode, schema)) for _ in range(args.rounds) for mode in MODES]
        finally:
            server.terminate()
            server.wait(60)
    report = {"date": _now(), "machine": machine(), "command": _serve_command(args, port), "schema": schema,
              "max_concurrency": args.max_concurrency, "num_prompts": args.num_prompts,
              "input_len": args.random_input_len, "output_len": args.random_output_len, **summarize(rounds),
              "runs": [{"mode": mode, **result} for mode, result in rounds]}
    print_summary(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, log, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited while starting:\n{log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not come up within {timeout:.0f} s")


def _round(args, url: str, mode: str, schema: dict) -> dict:
    result = asyncio.run(serve_bench.run_async(_client_args(args, url, mode == "constrained", schema)))
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} {mode} requests failed: {result['errors']}")
    return result


def summarize(rounds: list[tuple[str, dict]]) -> dict:
    """Per mode: output tokens over the time of its rounds; and constrained / unconstrained."""
    totals = {}
    for mode in MODES:
        mine = [r for m, r in rounds if m == mode]
        tokens, seconds = sum(r["total_output_tokens"] for r in mine), sum(r["duration"] for r in mine)
        totals[mode] = {"output_throughput": round(tokens / seconds, 2), "output_tokens": tokens,
                        "seconds": round(seconds, 3), "rounds": [r["output_throughput"] for r in mine],
                        "median_tpot_ms": [r["median_tpot_ms"] for r in mine]}
    ratio = totals["constrained"]["output_throughput"] / totals["unconstrained"]["output_throughput"]
    return {**totals, "ratio": round(ratio, 4)}


def print_summary(report: dict) -> None:
    for mode in MODES:
        m = report[mode]
        print(f"{mode:<16}{m['output_throughput']:>10.1f} output tok/s  (rounds: {m['rounds']})")
    print(f"{'ratio':<16}{report['ratio']:>10.3f}  (constrained / unconstrained)")


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _load_schema(path: str | None) -> dict:
    if path is None:
        return SCHEMA
    with open(path) as f:
        return json.load(f)
