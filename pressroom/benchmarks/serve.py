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

The command line is vLLM 0.32's `vllm bench serve` for what it shares: `--backend vllm|openai|openai-chat`,
`--host`/`--port` (or `--base-url`), `--save-result` with `--result-dir`/`--result-filename`/`--label`/`--metadata`,
`--percentile-metrics`/`--metric-percentiles`, `--goodput ttft:MS tpot:MS e2el:MS`, `--burstiness`, `--header`,
`--extra-body`, the sampling flags, `--disable-tqdm` and `--dataset-name sharegpt --dataset-path FILE`. Defaults
that differ from vLLM's, on purpose: `--temperature 0` (greedy; vLLM leaves it to the server), one warmup request
(vLLM: none), and percentiles for e2el too (vLLM: ttft,tpot,itl).

Datasets: `random` builds each prompt from uniformly random token ids (away from the special-token
range) decoded to text by the server's `/detokenize`, re-tokenized with `/tokenize` and adjusted
until it is exactly `--random-input-len` tokens long where possible; a server without those
endpoints gets prompts of random plain words instead. `jsonl` reads `{"prompt": ...}` per line (or
plain text lines) from `--dataset-path`. `sharegpt` reads a ShareGPT JSON file as vLLM does: conversations
of two turns or more, shuffled by `--seed` (unless `--disable-shuffle`), the first turn the prompt and the second's
token count the output length (unless `--sharegpt-output-len` / `--output-len`), pairs outside vLLM's bounds
(prompt 4-1024 tokens, output at least 4, both at most 2048) skipped, token counts from the server's `/tokenize`.
As in vLLM, `random` prompts ignore EOS so that each request runs to its length.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
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


BACKENDS = ("vllm", "openai", "openai-chat")  # vLLM's names; vllm and openai send completions, openai-chat chat
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    _add_target_args(parser)
    _add_dataset_args(parser)
    _add_traffic_args(parser)
    _add_sampling_args(parser.add_argument_group("sampling parameters (sent with every request)"))
    _add_result_args(parser)


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="openai", choices=BACKENDS,
                        help="the request format: vllm and openai send /v1/completions bodies, openai-chat chat ones")
    parser.add_argument("--base-url", default=None, help="the server, without /v1 (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="the server's address, unless --base-url")
    parser.add_argument("--port", type=int, default=8000, help="the server's port, unless --base-url")
    parser.add_argument("--endpoint", default=None,
                        help="the route each request is sent to (default: /v1/chat/completions for --backend "
                             "openai-chat, else /v1/completions)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE",
                        help="headers sent with every request")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a byte before failing")


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "jsonl"],
                        help="random: prompts of random token ids; sharegpt: a ShareGPT JSON file's first turns; "
                             "jsonl: --dataset-path's prompts")
    parser.add_argument("--dataset-path", default=None,
                        help="sharegpt: the JSON file; jsonl: {\"prompt\": ...} per line, or plain lines")
    parser.add_argument("--disable-shuffle", action="store_true", help="sharegpt: the file's order, not shuffled")
    parser.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens of random prompts")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="max_tokens per request (jsonl too, unless --output-len)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="max_tokens of every request, whatever the dataset")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="sharegpt: max_tokens of every request (default: the length of each conversation's "
                             "answer)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="timed requests")
    parser.add_argument("--seed", type=int, default=0, help="prompts, their order and arrival times")


def _add_traffic_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s, arrivals a Poisson process (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="with a --request-rate: gaps drawn from a gamma distribution of this shape (1: "
                             "Poisson; below 1 burstier, above 1 more even)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: no cap)")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="untimed requests first (prompts drawn apart from the timed ones)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send vLLM's ignore_eos extra (random prompts always do, as in vLLM)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_sampling_args(group) -> None:
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    for name in ("top-p", "min-p", "frequency-penalty", "presence-penalty", "repetition-penalty"):
        group.add_argument(f"--{name}", type=float, default=None,
                           help=f"the request's {name.replace('-', '_')} (unset: the server's default)")
    group.add_argument("--top-k", type=int, default=None, help="the request's top_k (unset: the server's default)")
    group.add_argument("--structured-outputs", type=json.loads, default=None,
                       help='vLLM\'s structured_outputs (JSON, e.g. \'{"json": {...}}\')')
    group.add_argument("--extra-body", type=json.loads, default=None,
                       help="JSON: more fields for every request's body (they win over the flags)")


def _add_result_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                        help="comma-separated: the metrics whose percentiles are reported, of "
                             f"{','.join(PERCENTILE_METRICS)}")
    parser.add_argument("--metric-percentiles", default="99",
                        help='comma-separated percentiles reported for them, e.g. "50,90,99"')
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="service-level objectives in ms (ttft, tpot, e2el): request_goodput counts the "
                             "requests per second that meet all of them")
    parser.add_argument("--save-result", action="store_true",
                        help="write the result JSON as vLLM names it: "
                             "LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json")
    parser.add_argument("--result-dir", default=None, help="the folder for --save-result (made if missing)")
    parser.add_argument("--result-filename", default=None, help="the file name for --save-result")
    parser.add_argument("--label", default=None, help="the result's label and file-name prefix (default: --backend)")
    parser.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                        help="recorded in the result JSON")
    parser.add_argument("--save-detailed", action="store_true", help="per-request figures in the JSON too")
    parser.add_argument("--output-json", default=None, help="write the report to this path too")


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
    start: float = 0.0            # time.perf_counter() when sent


# ---- the client side of one request ----

def parse_pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    """KEY=VALUE words (--header, --metadata) as a dict."""
    pairs = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE pairs; got {item!r}.")
        pairs[key.strip()] = value.strip()
    return pairs


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """--goodput's KEY:MS pairs, as vLLM reads them: keys of ttft, tpot, e2el; values non-negative milliseconds."""
    slos = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None:
            raise ValueError(f"--goodput takes KEY:MS pairs (e.g. ttft:500 tpot:50); got {item!r}.")
        if key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: {key!r} is not one of {', '.join(GOODPUT_METRICS)}.")
        if ms < 0:
            raise ValueError(f"--goodput: {key}'s objective must be non-negative; got {ms}.")
        slos[key] = ms
    return slos


def parse_percentiles(args) -> tuple[list[str], list[float]]:
    """--percentile-metrics and --metric-percentiles, checked."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown or not metrics:
        raise ValueError(f"--percentile-metrics takes a comma-separated list of {', '.join(PERCENTILE_METRICS)}; "
                         f"got {args.percentile_metrics!r}.")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100]; got "
                         f"{args.metric_percentiles!r}.")
    return metrics, percentiles


def _base_url(args) -> str:
    """The server's root, without /v1: --base-url, else http://HOST:PORT."""
    if args.base_url:
        base = args.base_url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def _endpoint(args) -> str:
    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    if chat and not endpoint.endswith("/chat/completions"):
        raise ValueError(f"--backend openai-chat sends chat requests: --endpoint must be a chat route; got "
                         f"{endpoint!r}.")
    return endpoint


def _is_chat(args) -> bool:
    """Chat bodies for --backend openai-chat, and (pressroom's older spelling) for any chat --endpoint."""
    return _endpoint(args).endswith("/chat/completions")


def _ignores_eos(args) -> bool:
    return args.ignore_eos or args.dataset_name == "random"  # vLLM: random prompts run to their length


def _headers(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return {**headers, **parse_pairs(args.header, "--header")}


_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty")


def _payload(args, model: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    body.update({name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None})
    if _is_chat(args):
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if _ignores_eos(args):
        body["ignore_eos"] = True
    if args.structured_outputs is not None:
        body["structured_outputs"] = args.structured_outputs
    return {**body, **(args.extra_body or {})}


def _chunk_text(data: dict) -> str | None:
    """The text a chunk carries (completions or chat), None when it carries no choice."""
    choices = data.get("choices")
    if not choices:
        return None
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    # reasoning: vLLM 0.32's name (and pressroom's); reasoning_content: older servers'
    return (delta.get("content") or "") + (delta.get("reasoning") or delta.get("reasoning_content") or "")


async def send_request(client, url: str, body: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    chunks = 0
    start = result.start = time.perf_counter()
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


def read_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of each conversation with two turns or more, in the file's order (vLLM's filter)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}} entries.")
    pairs = [(e["conversations"][0]["value"], e["conversations"][1]["value"]) for e in data
             if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2]
    if not pairs:
        raise ValueError(f"{path}: no conversation of two turns or more.")
    return pairs


def sharegpt_pair_fits(prompt_len: int, output_len: int, output_len_fixed: bool) -> bool:
    """vLLM's bounds for a ShareGPT pair: a prompt of 4-1024 tokens, an answer of 4 or more (unless the output
    length is fixed), both together at most 2048."""
    return (4 <= prompt_len <= 1024 and (output_len_fixed or output_len >= 4)
            and prompt_len + output_len <= 2048)


async def _count_tokens(client, base: str, model: str, text: str) -> int:
    async with client.post(f"{base}/tokenize", json={"model": model, "prompt": text}) as r:
        if r.status != 200:
            raise ValueError(f"--dataset-name sharegpt counts tokens with the server's /tokenize, which answered "
                             f"HTTP {r.status}.")
        return len((await r.json())["tokens"])


async def sharegpt_prompts(args, client, base: str, model: str, num: int,
                           seed: int) -> list[tuple[str, int, int]]:
    """vLLM's ShareGPT sample: the pairs shuffled as `random.seed(seed); random.shuffle(...)` shuffles them (the
    same prompts as vLLM's for a seed), those that fit taken in order, repeated at random when too few fit."""
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file).")
    pairs = read_sharegpt(args.dataset_path)
    if not args.disable_shuffle:
        random.Random(seed).shuffle(pairs)
    fixed = args.sharegpt_output_len or args.output_len
    taken: list[tuple[str, int, int]] = []
    for start in range(0, len(pairs), 16):  # a few /tokenize calls at a time, until enough fit
        chunk = pairs[start:start + 16]
        counts = await asyncio.gather(*[asyncio.gather(_count_tokens(client, base, model, prompt),
                                                       _count_tokens(client, base, model, answer))
                                        for prompt, answer in chunk])
        for (prompt, _), (prompt_len, answer_len) in zip(chunk, counts):
            out_len = fixed or answer_len
            if sharegpt_pair_fits(prompt_len, out_len, fixed is not None) and len(taken) < num:
                taken.append((prompt, prompt_len, out_len))
        if len(taken) == num:
            return taken
    if not taken:
        raise ValueError(f"{args.dataset_path}: no conversation fits vLLM's bounds (prompt 4-1024 tokens, answer "
                         "4 or more, 2048 together).")
    rng = random.Random(seed)
    return taken + [rng.choice(taken) for _ in range(num - len(taken))]


async def build_prompts(args, client, base: str, model: str, num: int,
                        seed: int) -> tuple[list[tuple[str, int, int]], str]:
    """(prompt text, prompt tokens or -1, max_tokens) each, and how they were made."""
    rng = random.Random(seed)
    in_len = args.input_len or args.random_input_len
    out_len = args.output_len or args.random_output_len
    if args.dataset_name == "sharegpt":
        return await sharegpt_prompts(args, client, base, model, num, seed), "sharegpt"
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path.")
        texts = read_prompt_texts(args.dataset_path)
        return [(texts[i % len(texts)], -1, out_len) for i in range(num)], "jsonl"
    if args.dataset_path:
        raise ValueError("--dataset-name random makes its prompts: --dataset-path is for sharegpt or jsonl.")
    vocab = await _vocab_size(client, base, model)
    if vocab is None:
        return [(_word_prompt(rng, in_len), -1, out_len) for _ in range(num)], "words"
    low, high = min(1000, vocab // 4), vocab - 1
    gate = asyncio.Semaphore(16)  # a few tokenizer calls at a time

    async def one(prompt_rng: random.Random) -> tuple[str, int]:
        async with gate:
            return await _token_prompt(client, base, model, prompt_rng, in_len, low, high)

    made = await asyncio.gather(*[one(random.Random(rng.random())) for _ in range(num)])
    return [(text, count, out_len) for text, count in made], "token ids via /detokenize"


# ---- the run ----

def _gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """Seconds to the next arrival: exponential (Poisson arrivals) at burstiness 1, else gamma of that shape with
    the same mean, 1 / rate (vLLM's)."""
    if burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def _arrivals(num: int, rate: float, rng: random.Random, burstiness: float = 1.0):
    for i in range(num):
        yield i
        if math.isfinite(rate) and rate > 0 and i < num - 1:
            await asyncio.sleep(_gap(rng, rate, burstiness))


def _progress(args, total: int):
    """A progress bar over finished requests (tqdm, on stderr), or None with --disable-tqdm."""
    if getattr(args, "disable_tqdm", False):
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="bench serve", unit="req", file=sys.stderr)


async def run_async(args) -> dict:
    try:
        import aiohttp
    except ImportError:
        raise ValueError("pressroom bench serve needs aiohttp: pip install aiohttp") from None
    base = _base_url(args)
    url = base + _endpoint(args)
    # aiohttp, as vLLM's client: at 256 streams of ~70 chunks/s each, httpx's per-chunk cost made the client
    # the bottleneck on the H200 (the server's API process held the GIL 21% of the time, the engine idled).
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30.0)
    connector = aiohttp.TCPConnector(limit=0)  # no cap: --max-concurrency is the only limit
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=_headers(args)) as client:
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
        bar = _progress(args, len(prompts))

        async def limited(prompt: str, prompt_len: int, max_tokens: int) -> RequestResult:
            body = _payload(args, model, prompt, max_tokens)
            try:
                if semaphore is None:
                    return await send_request(client, url, body, prompt_len)
                async with semaphore:
                    return await send_request(client, url, body, prompt_len)
            finally:
                if bar is not None:
                    bar.update(1)

        rng = random.Random(args.seed)
        tasks = []
        start = time.perf_counter()
        async for i in _arrivals(len(prompts), args.request_rate, rng, args.burstiness):
            tasks.append(asyncio.create_task(limited(*prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return report(args, model, source, results, duration)


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)  # vLLM's key spelling: p99, p99.9


def _stats(values: list[float], name: str, percentiles: list[float] = (99.0,)) -> dict:
    """mean / median / std and the given percentiles of one metric, in ms (None when nothing was measured)."""
    arr = np.asarray(values, dtype=float) * 1000.0
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"p{_percentile_word(p)}_{name}_ms" for p in percentiles]
    if arr.size == 0:
        return dict.fromkeys(keys)
    values_ = [arr.mean(), np.median(arr), arr.std(), *(np.percentile(arr, p) for p in percentiles)]
    return {k: round(float(v), 3) for k, v in zip(keys, values_)}


def _tpot(r: RequestResult) -> float:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def good_requests(done: list[RequestResult], slos_ms: dict[str, float]) -> int:
    """Requests meeting every objective (vLLM's goodput: a one-token answer's TPOT counts as 0)."""
    measure = {"ttft": lambda r: r.ttft, "tpot": _tpot, "e2el": lambda r: r.latency}
    return sum(all(measure[k](r) * 1000.0 <= ms for k, ms in slos_ms.items()) for r in done)


def peak_rates(done: list[RequestResult]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests: the most tokens streamed, and the most requests
    in flight, in any whole second from the first request's start (a token at each streamed chunk)."""
    if not done:
        return 0.0, 0
    first = min(r.start for r in done)
    seconds = int(math.ceil(max(r.start + r.latency for r in done) - first)) + 1
    tokens, in_flight = np.zeros(seconds), np.zeros(seconds)
    for r in done:
        for t in itertools.accumulate(r.itl, initial=r.start + r.ttft):
            tokens[min(int(t - first), seconds - 1)] += 1
        in_flight[int(r.start - first):int(r.start + r.latency - first) + 1] += 1
    return float(tokens.max()), int(in_flight.max())


def report(args, model: str, source: str, results: list[RequestResult], duration: float) -> dict:
    metrics, percentiles = parse_percentiles(args)
    slos = parse_goodput(args.goodput)
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done if r.prompt_len >= 0)
    total_out = sum(r.output_tokens for r in done)
    measured = {"ttft": [r.ttft for r in done], "tpot": [_tpot(r) for r in done if r.output_tokens > 1],
                "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}
    rate = args.request_rate
    peak = peak_rates(done)
    out = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend, "backend": args.backend,
        "label": args.label or args.backend, "tokenizer_id": None,  # prompts are counted by the server's /tokenize
        "base_url": _base_url(args), "endpoint": _endpoint(args), "model_id": model,
        "dataset_name": args.dataset_name, "prompt_source": source, "num_prompts": len(results),
        **parse_pairs(args.metadata, "--metadata"),
        "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "ignore_eos": _ignores_eos(args), "seed": args.seed,
        "duration": round(duration, 6), "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "output_tokens_from_usage": bool(done) and all(r.usage_given for r in done),
        "request_throughput": round(len(done) / duration, 4) if duration > 0 else 0.0,
        "request_goodput": round(good_requests(done, slos) / duration, 4) if slos and duration > 0 else None,
        "output_throughput": round(total_out / duration, 2) if duration > 0 else 0.0,
        "total_token_throughput": round((total_in + total_out) / duration, 2) if duration > 0 else 0.0,
        "max_output_tokens_per_s": peak[0], "max_concurrent_requests": peak[1],
        "latencies": [r.latency for r in results],
        "percentile_metrics": metrics, "metric_percentiles": percentiles,
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }
    for name, values in measured.items():  # mean/median/std of all four; percentiles of those asked for
        out.update(_stats(values, name, percentiles if name in metrics else []))
    if args.save_detailed:
        out.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                   ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                   start_times=[r.start for r in results], request_errors=[r.error for r in results])
    return out


_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def print_report(r: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Maximum request concurrency:", r["max_concurrency"]), ("Request rate (req/s):", r["request_rate"]),
            ("Benchmark duration (s):", f"{r['duration']:.2f}"), ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", f"{r['request_throughput']:.2f}")]
    if r["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{r['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value!s:<10}")
    for name in r["percentile_metrics"]:
        print(f"{_TITLES[name]:-^50}")
        labels = [("mean", "Mean"), ("median", "Median")]
        labels += [(f"p{_percentile_word(p)}", f"P{_percentile_word(p)}") for p in r["metric_percentiles"]]
        for key, label in labels:
            v = r[f"{key}_{name}_ms"]
            print(f"{label} {name.upper()} (ms):".ljust(40) + (f"{v:.2f}" if v is not None else "n/a"))
    print("=" * 50)
    for e in r["errors"]:
        print(f"error: {e}", file=sys.stderr)


def result_path(args, result: dict) -> str | None:
    """Where --save-result writes, as vLLM names it; None without --save-result / --result-filename."""
    if not (args.save_result or args.result_filename):
        return None
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (f"{result['label']}-{args.request_rate}qps{concurrency}-"
                                    f"{result['model_id'].split('/')[-1]}-{result['date']}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def check_args(args) -> None:
    """What the flags must satisfy, checked before any request is sent."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1.")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (or inf).")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be positive.")
    _endpoint(args)
    parse_percentiles(args)
    parse_goodput(args.goodput)
    parse_pairs(args.header, "--header")
    parse_pairs(args.metadata, "--metadata")


def run(args) -> dict:
    check_args(args)
    result = asyncio.run(run_async(args))
    print_report(result)
    for path in filter(None, (args.output_json, result_path(args, result))):
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"result written to {path}")
    return result
