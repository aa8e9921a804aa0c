"""`pressroom bench serve` end to end: a real `pressroom serve` subprocess (tiny model) on loopback, loaded by
`pressroom bench serve` run as a subprocess; its JSON report must account for every request."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
from fastapi import (
    Request,  # resolved at module level: FastAPI reads the handler's annotation by name
)
from serving import free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the tiny llama served as "tiny" (shared: conftest.py)


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", "bench", "serve", *args,
                           "--output-json", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    return json.loads(out.read_text())


def _assert_sane(r: dict, num: int, out_len: int) -> None:
    assert r["completed"] == num and r["failed"] == 0 and r["errors"] == [], r
    assert r["model_id"] == MODEL  # asked of /v1/models
    assert r["output_tokens_from_usage"] is True
    assert r["total_output_tokens"] == num * out_len  # ignore_eos: every request runs to max_tokens
    assert r["duration"] > 0
    assert r["request_throughput"] == pytest.approx(num / r["duration"], rel=0.01)
    assert r["output_throughput"] == pytest.approx(num * out_len / r["duration"], rel=0.01)
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = r[f"mean_{name}_ms"], r[f"median_{name}_ms"], r[f"p99_{name}_ms"]
        assert 0 < mean < 60_000 and 0 < median <= p99 < 60_000, (name, r)
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"]
    # TPOT spreads the post-first-token time over out_len - 1 tokens, so it cannot exceed the whole latency
    assert r["mean_tpot_ms"] * (out_len - 1) <= r["mean_e2el_ms"] * 1.001


def test_bench_serve_random_dataset_max_concurrency(server, tmp_path):
    num, in_len, out_len = 6, 32, 8
    r = _bench(tmp_path, "--base-url", server, "--dataset-name", "random", "--random-input-len", str(in_len),
               "--random-output-len", str(out_len), "--num-prompts", str(num), "--max-concurrency", "3",
               "--ignore-eos", "--seed", "1", "--save-detailed")
    _assert_sane(r, num, out_len)
    assert r["prompt_source"] == "token ids via /detokenize" and r["max_concurrency"] == 3
    # prompts re-tokenize to the requested length (plus a BOS, if the model adds one)
    assert all(in_len <= n <= in_len + 1 for n in r["input_lens"]), r["input_lens"]
    # a chunk per token, unless the server coalesced tokens produced faster than it could send them (all 8 in one
    # chunk, no gap, has been seen on a loaded machine); never more chunks than tokens
    assert all(len(gaps) <= out_len - 1 for gaps in r["itls"]) and any(r["itls"]), r["itls"]


def test_bench_serve_jsonl_chat_at_a_request_rate(server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hello there", "Tell me a story", "Why?"]) + "\n")
    num, out_len = 5, 6
    r = _bench(tmp_path, "--base-url", server + "/v1", "--endpoint", "/v1/chat/completions", "--model", MODEL,
               "--dataset-name", "jsonl", "--dataset-path", str(path), "--output-len", str(out_len),
               "--num-prompts", str(num), "--request-rate", "20", "--ignore-eos", "--seed", "2")
    _assert_sane(r, num, out_len)
    assert r["request_rate"] == 20 and r["total_input_tokens"] > 0


def test_bench_serve_counts_failures(server, tmp_path):
    """A wrong model name: every request fails with the server's 404, the report says so, the exit code is 1."""
    prompts, out = tmp_path / "prompts.txt", tmp_path / "result.json"
    prompts.write_text("hi\n")
    proc = subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", "bench", "serve", "--base-url", server,
                           "--model", "missing", "--dataset-name", "jsonl", "--dataset-path", str(prompts),
                           "--num-prompts", "2", "--num-warmups", "0", "--output-json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 2 and "HTTP 404" in r["errors"][0], r


def test_bench_serve_against_a_minimal_peer_server(tmp_path):
    """A peer with no /detokenize and no usage chunk: prompts are random words, tokens are counted as chunks."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from pressroom.entrypoints.cli import build_parser, main

    app, seen = FastAPI(), []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "peer", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)

        async def chunks():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.005)
                yield f'data: {json.dumps({"choices": [{"index": 0, "text": f"w{i} "}]})}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        out = tmp_path / "peer.json"
        argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--random-input-len", "12",
                "--random-output-len", "4", "--num-prompts", "5", "--request-rate", "50", "--max-concurrency", "2",
                "--seed", "3", "--output-json", str(out)]
        assert build_parser().parse_args(argv).request_rate == 50
        assert main(argv) == 0
        r = json.loads(out.read_text())
    finally:
        server.should_exit = True
        thread.join(10)
    assert r["completed"] == 5 and r["failed"] == 0 and r["model_id"] == "peer"
    assert r["prompt_source"] == "words" and r["output_tokens_from_usage"] is False
    assert r["total_output_tokens"] == 20 and r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
    timed = seen[-5:]  # after the warmup request
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and "ignore_eos" not in b for b in seen)
    assert all(len(b["prompt"].split()) == 12 and b["max_tokens"] == 4 for b in timed)
