"""`pressroom bench serve`: an async HTTP load client with vLLM's `bench serve` semantics.

It drives any OpenAI-compatible server (pressroom, vLLM, llama.cpp's server, ...) with streaming
requests, issued at a Poisson request rate (or all at once) and/or capped at a maximum number in
flight, and reports request throughput, output tok/s and mean / median / P99 of:

- TTFT: request sent to the first streamed chunk carrying text;
- TPOT: per request, (e2e latency - TTFT) / (output tokens - 1);
- ITL:  the gaps between successive streamed chunks carrying text, over all requests;
- E2EL: request sent to the last byte of the stream.

Output token counts come from the final usage chunk (`stream_options.include_usage`) when the
server sends one, else from the number of text chunks (one token each on pressroom and vLLM).

Datasets: `random` builds each prompt from uniformly random token ids (away from the special-token
range) decoded to text by the server's `/detokenize`, re-tokenized with `/tokenize` and adjusted
until it is exactly `--random-input-len` tokens long where possible; a server without those
endpoints gets prompts of random plain words instead. `jsonl` reads `{"prompt": ...}` per line (or
plain text lines) from `--dataset-path`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pressroom.benchmarks.workload import read_prompt_texts

_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office door health person "
          "art war history party result change morning reason research girl guy moment air teacher force "
          "education").split()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                        help="the route each request is sent to")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--dataset-name", default="random", choices=["random", "jsonl"],
                        help="random: prompts of random token ids; jsonl: --dataset-path's prompts")
    parser.add_argument("--dataset-path", default=None, help="for jsonl: {\"prompt\": ...} per line, or plain lines")
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens of random prompts")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="max_tokens per request (jsonl too, unless --output-len)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="max_tokens for jsonl prompts (default: --random-output-len)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="timed requests")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s, arrivals a Poisson process (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: no cap)")
    parser.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos extra")
    parser.add_argument("--structured-outputs", type=json.loads, default=None,
                        help='sent as vLLM\'s structured_outputs with every request (JSON, e.g. \'{"json": {...}}\')')
    parser.add_argument("--temperature", type=float, default=0.0, help="sent with every request (0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="untimed requests first (prompts drawn apart from the timed ones)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a byte before failing")
    parser.add_argument("--save-detailed", action="store_true", help="per-request figures in the JSON too")
    parser.add_argument("--output-json", default=None, help="write the report here too (default: print only)")


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0           # from usage when given, else the dataset's count (-1: unknown)
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    usage_given: bool = False
    error: str = ""


# ---- the client side of one request ----

def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _payload(args, model: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": args.temperature}
    if args.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.structured_outputs is not None:
        body["structured_outputs"] = args.structured_outputs
    return body


def _chunk_text(data: dict) -> str | None:
    """The text a chunk carries (completions or chat), None when it carries no choice."""
    choices = data.get("choices")
    if not choices:
        return None
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(client, url: str, body: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:300]}"
                return result
            buffer = b""
            async for raw in response.content.iter_any():
                now = time.perf_counter()
                buffer += raw
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        data = json.loads(payload)
                        if "error" in data and "choices" not in data:
                            result.error = f"stream error: {json.dumps(data['error'])[:300]}"
                            return result
                        text = _chunk_text(data)
                        if text:  # a chunk carrying text: the first one is TTFT, later ones give ITL gaps
                            if chunks == 0:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last)
                            chunks += 1
                            last = now
                        usage = data.get("usage")
                        if usage and usage.get("completion_tokens") is not None:
                            result.output_tokens = int(usage["completion_tokens"])
                            if usage.get("prompt_tokens") is not None:
                                result.prompt_len = int(usage["prompt_tokens"])
                            result.usage_given = True
        result.latency = time.perf_counter() - start
        if not result.usage_given:
            result.output_tokens = chunks
        if chunks == 0:
            result.error = "the stream carried no text"
            return result
        result.success = True
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported, none stops the run
        result.error = f"{type(e).__name__}: {e}"[:300]
    return result


# ---- datasets ----

async def _get_model(client, base: str) -> str:
    async with client.get(f"{base}/v1/models") as r:
        r.raise_for_status()
        data = (await r.json()).get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; pass --model.")
    return data[0]["id"]


async def _vocab_size(client, base: str, model: str) -> int | None:
    """The server's vocabulary size, found by bisection on /detokenize; None when it has no /detokenize."""
    async def ok(token: int) -> bool | None:
        async with client.post(f"{base}/detokenize", json={"model": model, "tokens": [token]}) as r:
            await r.read()
        if r.status in (404, 405, 501):
            return None
        return r.status == 200

    first = await ok(0)
    if not first:
        return None
    low, high = 0, 1 << 22  # ok(low) is True; ok(high) assumed False
    if await ok(high):
        return None
    while high - low > 1:
        mid = (low + high) // 2
        if await ok(mid):
            low = mid
        else:
            high = mid
    return low + 1


async def _token_prompt(client, base: str, model: str, rng: random.Random, length: int, low: int,
                        high: int) -> tuple[str, int]:
    """Random ids decoded to text, re-tokenized and adjusted (a few tries) to `length` tokens."""
    ids = [rng.randrange(low, high) for _ in range(length)]
    text, count = "", -1
    for _ in range(10):
        async with client.post(f"{base}/detokenize", json={"model": model, "tokens": ids}) as r:
            r.raise_for_status()
            text = (await r.json())["prompt"]
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        async with client.post(f"{base}/tokenize", json=body) as r:
            if r.status != 200:
                return text, -1
            tokens = (await r.json())["tokens"]
        count = len(tokens)
        if count == length:
            break
        ids = tokens[:length] if count > length else tokens + [rng.randrange(low, high) for _ in range(length - count)]
    return text, count


def _word_prompt(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(length))


async def build_prompts(args, client, base: str, model: str, num: int,
                        seed: int) -> tuple[list[tuple[str, int, int]], str]:
    """(prompt text, prompt tokens or -1, max_tokens) each, and how they were made."""
    rng = random.Random(seed)
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path.")
        texts = read_prompt_texts(args.dataset_path)
        out_len = args.output_len or args.random_output_len
        return [(texts[i % len(texts)], -1, out_len) for i in range(num)], "jsonl"
    vocab = await _vocab_size(client, base, model)
    if vocab is None:
        return [(_word_prompt(rng, args.random_input_len), -1, args.random_output_len) for _ in range(num)], "words"
    low, high = min(1000, vocab // 4), vocab - 1
    gate = asyncio.Semaphore(16)  # a few tokenizer calls at a time

    async def one(prompt_rng: random.Random) -> tuple[str, int]:
        async with gate:
            return await _token_prompt(client, base, model, prompt_rng, args.random_input_len, low, high)

    made = await asyncio.gather(*[one(random.Random(rng.random())) for _ in range(num)])
    return [(text, count, args.random_output_len) for text, count in made], "token ids via /detokenize"


# ---- the run ----

async def _arrivals(num: int, rate: float, rng: random.Random):
    for i in range(num):
        yield i
        if math.isfinite(rate) and rate > 0 and i < num - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_async(args) -> dict:
    try:
        import aiohttp
    except ImportError:
        raise ValueError("pressroom bench serve needs aiohttp: pip install aiohttp") from None
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    url = base + args.endpoint
    # aiohttp, as vLLM's client: at 256 streams of ~70 chunks/s each, httpx's per-chunk cost made the client
    # the bottleneck on the H200 (the server's API process held the GIL 21% of the time, the engine idled).
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30.0)
    connector = aiohttp.TCPConnector(limit=0)  # no cap: --max-concurrency is the only limit
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=_headers(args.api_key)) as client:
        model = args.model or await _get_model(client, base)
        prompts, source = await build_prompts(args, client, base, model, args.num_prompts, args.seed)
        if args.num_warmups > 0:
            warm, _ = await build_prompts(args, client, base, model, args.num_warmups, args.seed + 1_000_003)
            warm_results = await asyncio.gather(*[send_request(client, url, _payload(args, model, p, n), c)
                                                  for p, c, n in warm])
            bad = [r.error for r in warm_results if not r.success]
            if bad and len(bad) == len(warm_results):
                raise ValueError(f"The warmup request failed: {bad[0]}")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: str, prompt_len: int, max_tokens: int) -> RequestResult:
            body = _payload(args, model, prompt, max_tokens)
            if semaphore is None:
                return await send_request(client, url, body, prompt_len)
            async with semaphore:
                return await send_request(client, url, body, prompt_len)

        rng = random.Random(args.seed)
        tasks = []
        start = time.perf_counter()
        async for i in _arrivals(len(prompts), args.request_rate, rng):
            tasks.append(asyncio.create_task(limited(*prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return report(args, model, source, results, duration)


def _stats(values: list[float], name: str) -> dict:
    arr = np.asarray(values, dtype=float) * 1000.0
    if arr.size == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": round(float(arr.mean()), 3), f"median_{name}_ms": round(float(np.median(arr)), 3),
            f"std_{name}_ms": round(float(arr.std()), 3), f"p99_{name}_ms": round(float(np.percentile(arr, 99)), 3)}


def report(args, model: str, source: str, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done if r.prompt_len >= 0)
    total_out = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [gap for r in done for gap in r.itl]
    rate = args.request_rate
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": "openai-http", "base_url": args.base_url,
        "endpoint": args.endpoint, "model_id": model, "dataset_name": args.dataset_name, "prompt_source": source,
        "num_prompts": len(results), "request_rate": rate if math.isfinite(rate) else "inf",
        "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "seed": args.seed,
        "duration": round(duration, 6), "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "output_tokens_from_usage": bool(done) and all(r.usage_given for r in done),
        "request_throughput": round(len(done) / duration, 4) if duration > 0 else 0.0,
        "output_throughput": round(total_out / duration, 2) if duration > 0 else 0.0,
        "total_token_throughput": round((total_in + total_out) / duration, 2) if duration > 0 else 0.0,
        **_stats([r.ttft for r in done], "ttft"), **_stats(tpots, "tpot"), **_stats(itls, "itl"),
        **_stats([r.latency for r in done], "e2el"),
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }
    if args.save_detailed:
        out.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                   ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                   latencies=[r.latency for r in results], request_errors=[r.error for r in results])
    return out


def print_report(r: dict) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Maximum request concurrency:", r["max_concurrency"]), ("Request rate (req/s):", r["request_rate"]),
            ("Benchmark duration (s):", f"{r['duration']:.2f}"), ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value!s:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{title:-^50}")
        for k in ("mean", "median", "p99"):
            v = r[f"{k}_{name}_ms"]
            print(f"{k.capitalize() if k != 'p99' else 'P99'} {name.upper()} (ms):".ljust(40)
                  + (f"{v:.2f}" if v is not None else "n/a"))
    print(line)
    for e in r["errors"]:
        print(f"error: {e}", file=sys.stderr)


def run(args) -> dict:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1.")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (or inf).")
    result = asyncio.run(run_async(args))
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
