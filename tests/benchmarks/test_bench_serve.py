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
    # random prompts ignore EOS as in vLLM, without --ignore-eos
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in seen)
    assert all(len(b["prompt"].split()) == 12 and b["max_tokens"] == 4 for b in timed)


# ---- vLLM's `bench serve` flags ----

def _args(*argv: str):
    from pressroom.entrypoints.cli import build_parser
    return build_parser().parse_args(["bench", "serve", *argv])


def test_vllms_bench_serve_command_line_parses(tmp_path):
    from pressroom.benchmarks import serve
    args = _args("--backend", "vllm", "--host", "10.0.0.2", "--port", "8123", "--save-result", "--result-dir",
                 str(tmp_path / "out"), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9",
                 "--goodput", "ttft:500", "tpot:50", "--dataset-name", "sharegpt", "--dataset-path", "sg.json",
                 "--num-prompts", "10", "--request-rate", "4", "--burstiness", "0.5", "--label", "run1",
                 "--metadata", "tp=1", "--header", "x-team=a", "--top-k", "5", "--extra-body", '{"min_tokens": 2}',
                 "--disable-tqdm")
    serve.check_args(args)
    assert serve._base_url(args) == "http://10.0.0.2:8123" and serve._endpoint(args) == "/v1/completions"
    assert serve.parse_percentiles(args) == (["ttft", "tpot", "itl", "e2el"], [50.0, 99.9])
    assert serve.parse_goodput(args.goodput) == {"ttft": 500.0, "tpot": 50.0}
    assert serve._headers(args) == {"x-team": "a"}
    body = serve._payload(args, "m", "hello", 8)
    assert body["prompt"] == "hello" and body["max_tokens"] == 8 and body["top_k"] == 5 and body["min_tokens"] == 2
    assert "ignore_eos" not in body  # only random prompts ignore EOS unasked
    chat = _args("--backend", "openai-chat", "--base-url", "http://h:1/v1", "--dataset-name", "random")
    assert serve._endpoint(chat) == "/v1/chat/completions" and serve._base_url(chat) == "http://h:1"
    body = serve._payload(chat, "m", "hi", 3)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 3
    assert body["ignore_eos"] is True and body["temperature"] == 0.0


@pytest.mark.parametrize(("argv", "says"), [
    (["--goodput", "ttfb:5"], "not one of ttft, tpot, e2el"), (["--goodput", "ttft=5"], "KEY:MS"),
    (["--goodput", "tpot:-1"], "non-negative"), (["--percentile-metrics", "ttft,latency"], "--percentile-metrics"),
    (["--metric-percentiles", "0"], "--metric-percentiles"), (["--burstiness", "0"], "--burstiness"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "chat route"),
    (["--header", "novalue"], "KEY=VALUE")])
def test_bad_bench_serve_flags_are_value_errors(argv, says):
    from pressroom.benchmarks import serve
    with pytest.raises(ValueError, match=says):
        serve.check_args(_args(*argv))


def test_a_backend_vllm_does_not_have_in_its_list_is_refused(capsys):
    with pytest.raises(SystemExit):
        _args("--backend", "tgi")
    assert "argument --backend: invalid choice: 'tgi'" in capsys.readouterr().err


def test_percentiles_goodput_and_the_result_name_as_vllm():
    from pressroom.benchmarks import serve
    fast = serve.RequestResult(success=True, output_tokens=3, ttft=0.1, latency=0.3)   # tpot 100 ms
    slow = serve.RequestResult(success=True, output_tokens=1, ttft=0.9, latency=0.9)   # tpot 0 (one token)
    assert serve.good_requests([fast, slow], {"ttft": 500}) == 1
    assert serve.good_requests([fast, slow], {"tpot": 50}) == 1  # the one-token answer meets any TPOT
    assert serve.good_requests([fast, slow], {"e2el": 1000, "tpot": 150}) == 2
    args = _args("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9", "--goodput", "ttft:500",
                 "--save-result", "--max-concurrency", "4", "--request-rate", "2", "--metadata", "tp=1")
    r = serve.report(args, "org/model-x", "jsonl", [fast, slow], duration=2.0)
    assert r["request_goodput"] == 0.5 and r["tp"] == "1" and r["label"] == "openai"
    assert r["p50_ttft_ms"] == pytest.approx(500.0) and r["p99.9_e2el_ms"] == pytest.approx(899.4)
    assert "p50_tpot_ms" not in r and r["mean_tpot_ms"] == pytest.approx(100.0)  # mean for all, percentiles as asked
    assert serve.result_path(args, r) == f"openai-2.0qps-concurrency4-model-x-{r['date']}.json"
    assert serve.report(_args(), "m", "jsonl", [fast], 1.0)["request_goodput"] is None


def test_peak_tokens_and_requests_per_second_as_vllm():
    from pressroom.benchmarks import serve
    a = serve.RequestResult(success=True, start=10.0, ttft=0.2, itl=[0.1, 0.1, 0.9], latency=1.4)  # 3 in s0, 1 in s1
    b = serve.RequestResult(success=True, start=10.5, ttft=0.1, itl=[0.1], latency=0.3)  # s0
    c = serve.RequestResult(success=True, start=12.2, ttft=0.1, itl=[], latency=0.1)  # s2
    assert serve.peak_rates([a, b, c]) == (5.0, 2)
    assert serve.peak_rates([]) == (0.0, 0)


def _sharegpt(tmp_path, n: int) -> str:
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question number {i} " + "word " * (i % 7)},
                                              {"from": "gpt", "value": "answer " * (3 + i % 5)}]} for i in range(n)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "alone"}]})  # one turn: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return str(path)


def test_sharegpt_file_order_bounds_and_vllms_shuffle(tmp_path):
    import random

    from pressroom.benchmarks import serve
    pairs = serve.read_sharegpt(_sharegpt(tmp_path, 20))
    assert len(pairs) == 20 and pairs[0][0].startswith("question number 0")
    theirs = list(pairs)
    random.seed(7)
    random.shuffle(theirs)  # how vLLM's ShareGPTDataset orders them
    mine = list(pairs)
    random.Random(7).shuffle(mine)
    assert mine == theirs
    assert serve.sharegpt_pair_fits(4, 4, False) and not serve.sharegpt_pair_fits(3, 10, False)
    assert not serve.sharegpt_pair_fits(10, 3, False) and serve.sharegpt_pair_fits(10, 1, True)
    assert not serve.sharegpt_pair_fits(1025, 4, True) and not serve.sharegpt_pair_fits(1000, 1049, True)


def test_bench_serve_sharegpt_with_vllms_flags(server, tmp_path):
    """vLLM's command line against a real server: sharegpt prompts, host and port, a saved result named as vLLM
    names it, goodput and chosen percentiles."""
    port = server.rsplit(":", 1)[1]
    path, out_dir = _sharegpt(tmp_path, 12), tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "pressroom.entrypoints.cli", "bench", "serve", "--backend", "vllm",
                           "--host", "127.0.0.1", "--port", port, "--dataset-name", "sharegpt", "--dataset-path", path,
                           "--num-prompts", "5", "--sharegpt-output-len", "4", "--ignore-eos", "--save-result",
                           "--result-dir", str(out_dir), "--percentile-metrics", "ttft,e2el",
                           "--metric-percentiles", "50,90", "--goodput", "e2el:60000", "--num-warmups", "0"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Request goodput (req/s):" in proc.stdout and "P90 TTFT (ms):" in proc.stdout
    assert "P99" not in proc.stdout and "Inter-token Latency" not in proc.stdout
    assert "bench serve: 100%" in proc.stderr and "5/5" in proc.stderr  # the progress bar
    (saved,) = out_dir.iterdir()
    assert saved.name.startswith(f"vllm-infqps-{MODEL}-") and saved.suffix == ".json"
    r = json.loads(saved.read_text())
    assert r["completed"] == 5 and r["prompt_source"] == "sharegpt" and r["backend"] == "vllm"
    assert r["total_output_tokens"] == 20 and r["request_goodput"] == pytest.approx(r["request_throughput"], rel=0.01)
    # each prompt's length is the server's count of a ShareGPT first turn: "question number i word ..." (4+ tokens)
    assert r["total_input_tokens"] >= 5 * 4
