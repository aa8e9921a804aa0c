"""`pressroom bench disagg`: disaggregated prefill/decode against one engine (issue 49).

Two configurations on one device, run one after the other, each as real processes on loopback:

- colocated: one `pressroom serve` engine holding the whole KV budget;
- disagg: a prefill engine (NixlConnector producer) and a decode engine (consumer), each with half the KV budget,
  behind `pressroom router`.

The same mixed workload goes to each: `--streams` requests decoding `--stream-output-len` tokens (EOS ignored) while
`--long-prompts` prompts of `--long-input-len` tokens arrive at `--long-rate` per second. Colocated, a long prompt's
prefill shares steps with the running streams and stalls them; disaggregated, the prefill engine computes it and the
decode engine only reads its KV. The report gives, per configuration, the running streams' inter-token latencies
(P50/P99, measured client-side between streamed chunks, `bench serve`'s client), the long prompts' TTFT, output
throughput, the tokens asked and received, and the disagg/colocated ratios (issue 49's bar: P99 ITL at most 0.5x).

Prompts are random token ids sent as ids. Unless --tokenizer is given, the engines get a synthetic word-level
tokenizer of the model's vocabulary size ("t0" ... "tN-1"), written to a temporary directory: every token decodes to
text, so each streamed chunk is one token, and dummy weights (`--load-format dummy`) need no real tokenizer.

The memory split: on CUDA the KV budget is explicit (--kv-cache-gib, halved for each disaggregated engine), so no
engine's memory profile reads another's allocations as its own; on the CPU it is the same flag.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pressroom.benchmarks.serve import RequestResult, send_request
from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.benchmarks.workload import machine, report_from_args

SERVED_NAME = "bench"
CONFIGS = ("colocated", "disagg")
# NIXL's error when its metadata listener cannot bind kv_port: a port picked free can be taken before the engine
# binds it, and such a start is retried on another port.
KV_PORT_CLASH = "Failed to bind metadata listener socket"
ITL_CURVE_PERCENTILES = (50.0, 75.0, 90.0, 95.0, 98.0, 99.0, 99.5, 99.9, 100.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The mixed workload, the same for both configurations."""
    streams: int
    stream_input_len: int
    stream_output_len: int
    long_prompts: int
    long_input_len: int
    long_output_len: int
    long_rate: float
    seed: int


# Defaults by device, each written once: a GPU's is issue 49's figure (64 streams, 4k-token prompts, Llama-3.1-8B's
# shape), the CPU's small enough for a 2-core machine.
DEFAULTS = {
    "cuda": dict(streams=64, stream_input_len=128, stream_output_len=1024, long_prompts=32, long_input_len=4096,
                 long_output_len=16, long_rate=2.0, kv_cache_gib=48.0, kv_buffer_mib=2048),
    "cpu": dict(streams=4, stream_input_len=16, stream_output_len=48, long_prompts=3, long_input_len=256,
                long_output_len=4, long_rate=1.0, kv_cache_gib=0.25, kv_buffer_mib=64),
}


def add_disagg_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=shape_arg, default=None,
                        help=shape_help("the model (required unless --from-json); a shape wants --load-format dummy"))
    parser.add_argument("--load-format", default="auto", help="auto, or dummy for random weights at the config's "
                                                              "shapes")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: theirs)")
    parser.add_argument("--tokenizer", default=None,
                        help="the engines' tokenizer (default: a synthetic one of the model's vocabulary size)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="picks the defaults below (auto: cuda when torch sees a GPU)")
    load = parser.add_argument_group("workload (defaults: GPU / CPU)")
    load.add_argument("--streams", type=int, default=None, help="decoding streams (64 / 4)")
    load.add_argument("--stream-input-len", type=int, default=None, help="a stream's prompt tokens (128 / 16)")
    load.add_argument("--stream-output-len", type=int, default=None, help="a stream's output tokens (1024 / 48)")
    load.add_argument("--long-prompts", type=int, default=None, help="long prompts sent while they decode (32 / 3)")
    load.add_argument("--long-input-len", type=int, default=None, help="a long prompt's tokens (4096 / 256)")
    load.add_argument("--long-output-len", type=int, default=None, help="a long prompt's output tokens (16 / 4)")
    load.add_argument("--long-rate", type=float, default=None, help="long prompts per second, evenly spaced (2 / 1)")
    load.add_argument("--seed", type=int, default=0, help="the prompts' token ids")
    engines = parser.add_argument_group("engines")
    engines.add_argument("--kv-cache-gib", type=float, default=None,
                         help="the colocated engine's KV cache; each disaggregated engine gets half (48 / 0.25)")
    engines.add_argument("--kv-buffer-mib", type=int, default=None,
                         help="each disaggregated engine's NIXL staging buffer, host memory (2048 / 64)")
    engines.add_argument("--configs", default=",".join(CONFIGS), help="which to run, of colocated,disagg")
    engines.add_argument("--serve-args", default="", help="more `pressroom serve` flags for every engine, one string")
    engines.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the engines to come up")
    engines.add_argument("--request-timeout", type=float, default=1800.0, help="seconds for one request")
    parser.add_argument("--output-json", default=None, help="write the report here")
    parser.add_argument("--from-json", default=None, help="load a report written before (for --plot) instead of "
                                                          "running")
    parser.add_argument("--plot", default=None, help="draw the ITL curves and throughput to this PNG (matplotlib)")


# ---- configuration ----

def resolve_device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _setting(args, device: str, name: str):
    value = getattr(args, name)
    return DEFAULTS[device][name] if value is None else value


def workload_from_args(args, device: str) -> Workload:
    fields = {name: _setting(args, device, name) for name in Workload.__dataclass_fields__ if name != "seed"}
    workload = Workload(**fields, seed=args.seed)
    if min(workload.streams, workload.stream_input_len, workload.stream_output_len, workload.long_input_len,
           workload.long_output_len) < 1 or workload.long_prompts < 0 or workload.long_rate <= 0:
        raise ValueError("--streams and every length must be at least 1, --long-prompts not negative and "
                         "--long-rate positive.")
    return workload


def vocab_size(model: str) -> int:
    """The model's vocabulary size, from its config.json (a multimodal config's text_config)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model} has no config.json to read the vocabulary size from; pass --tokenizer.")
    config = json.loads(path.read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise ValueError(f"{path} names no vocab_size; pass --tokenizer.")
    return int(size)


def write_token_tokenizer(directory: Path, size: int) -> Path:
    """A word-level tokenizer of `size` entries "t0" ... "t{size-1}", split on whitespace: each id decodes to text of
    its own (a stream's chunks are one token each) and no checkpoint's tokenizer is needed."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with a space
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transfer_config(role: str, buffer_bytes: int) -> dict:
    """A NixlConnector's --kv-transfer-config as tests/disagg's engines use it, on a free port."""
    extra = {"abort_request_timeout_s": 120} if role == "kv_producer" else {"transfer_timeout_s": 60}
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port(), "kv_buffer_size": buffer_bytes,
            "kv_connector_extra_config": extra}


def engine_args(args, tokenizer: str, workload: Workload, kv_gib: float, transfer: dict | None) -> list[str]:
    """One `pressroom serve`'s arguments (no --port): room for every stream and long prompt at once."""
    seqs = workload.streams + workload.long_prompts + 1
    out = ["serve", args.model, "--served-model-name", SERVED_NAME, "--load-format", args.load_format,
           "--tokenizer", tokenizer, "--max-num-seqs", str(seqs), "--kv-cache-memory-gib", f"{kv_gib:g}"]
    out += ["--dtype", args.dtype] if args.dtype else []
    out += ["--kv-transfer-config", json.dumps(transfer)] if transfer else []
    return out + shlex.split(args.serve_args)


# ---- processes ----

@dataclass
class Process:
    name: str
    argv: list[str]  # the cli's arguments, --port excluded
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _spawn(name: str, argv: list[str], log_dir: Path) -> Process:
    port = free_port()
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        # its own session: the engine core and its workers are stopped with it (see _stop)
        proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", "--log-level", "WARNING", *argv,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Process(name, argv, port, proc, log_path)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def lost_a_port(log: str) -> bool:
    """A start that failed on a taken port: NIXL's kv_port, uvicorn's bind, or serve's own check of --port."""
    text = log.lower()
    return KV_PORT_CLASH in log or "address already in use" in text or "is in use by another process" in text


def with_new_kv_port(argv: list[str]) -> list[str]:
    """`argv` with its --kv-transfer-config's kv_port replaced by another free port."""
    i = argv.index("--kv-transfer-config") + 1
    config = json.loads(argv[i])
    return [*argv[:i], json.dumps({**config, "kv_port": free_port()}), *argv[i + 1:]]


def _stop(process: Process) -> None:
    """SIGTERM to the server's session (a clean shutdown stops its engine core), SIGKILL to what is left after 30 s;
    its ports are free once it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.proc.pid, signal.SIGTERM)
    try:
        process.proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.proc.pid, signal.SIGKILL)  # a core that outlived its server, too
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.proc.wait(10)


@contextlib.contextmanager
def running(specs: dict[str, list[str]], log_dir: Path, timeout_s: float) -> Iterator[dict[str, Process]]:
    """Starts each `pressroom` command of `specs` (name -> arguments) side by side and yields name -> Process once
    every one answers /health; stops them all on the way out, whatever happened. A process that lost a port it was
    given to another process between the pick and its bind (its HTTP port, or its NIXL agent's kv_port:
    KV_PORT_CLASH) is started again on other ports, twice at most."""
    started: dict[str, Process] = {}
    retries: dict[str, int] = {}
    try:
        for name, argv in specs.items():
            started[name] = _spawn(name, argv, log_dir)
        deadline = time.monotonic() + timeout_s
        waiting = set(started)
        while waiting:
            for name in sorted(waiting):
                p = started[name]
                if p.proc.poll() is not None:
                    log = p.log_tail()
                    if lost_a_port(log) and retries.get(name, 0) < 2:
                        retries[name] = retries.get(name, 0) + 1
                        argv = with_new_kv_port(p.argv) if KV_PORT_CLASH in log else p.argv
                        started[name] = _spawn(name, argv, log_dir)  # on another HTTP port too
                        continue
                    raise RuntimeError(f"{name} exited while starting (rc {p.proc.returncode}):\n{p.log_tail()}")
                if _healthy(p.url):
                    waiting.discard(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(sorted(waiting))} did not come up within {timeout_s:.0f} s:\n"
                                   + "\n".join(started[n].log_tail(1500) for n in sorted(waiting)))
            time.sleep(0.5)
        yield started
    finally:
        for p in started.values():
            _stop(p)


def router_args(prefill: str, decode: str, timeout_s: float) -> list[str]:
    return ["router", "--prefill", prefill, "--decode", decode, "--health-interval", "1",
            "--request-timeout", f"{timeout_s:g}"]


# ---- the workload ----

def _prompts(workload: Workload, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """The streams' and the long prompts' token ids, away from the lowest ids (special tokens)."""
    rng = random.Random(workload.seed)
    low = min(1000, vocab // 4)

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]
    return ([ids(workload.stream_input_len) for _ in range(workload.streams)],
            [ids(workload.long_input_len) for _ in range(workload.long_prompts)])


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def drive(url: str, workload: Workload, vocab: int, timeout_s: float,
                on_warm: Callable[[], None] | None = None) -> dict:
    """The workload against one front (an engine or the router): the streams start together; the long prompts
    arrive every 1 / long_rate s from then on. A warm-up first (a few streams and one long prompt) so that kernels
    compiled at first use do not land in the figures; `on_warm` runs after it."""
    import aiohttp
    streams, longs = _prompts(workload, vocab)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client:
        target = f"{url}/v1/completions"
        # reversed prompts: the same lengths, no prefix the measured requests could hit in the cache
        warm = [send_request(client, target, _body(p[::-1], 8), len(p)) for p in streams[:4]]
        warm += [send_request(client, target, _body((longs or streams)[0][::-1], 2), workload.long_input_len)]
        failed = [r.error for r in await asyncio.gather(*warm) if not r.success]
        if failed:
            raise RuntimeError(f"the warm-up failed at {url}: {failed[0]}")
        if on_warm is not None:
            on_warm()

        async def long_arrivals() -> list[RequestResult]:
            tasks = []
            for prompt in longs:
                await asyncio.sleep(1.0 / workload.long_rate)
                tasks.append(asyncio.create_task(send_request(client, target, _body(prompt, workload.long_output_len),
                                                              len(prompt))))
            return list(await asyncio.gather(*tasks))

        start = time.perf_counter()
        stream_results, long_results = await asyncio.gather(
            asyncio.gather(*[send_request(client, target, _body(p, workload.stream_output_len), len(p))
                             for p in streams]),
            long_arrivals())
        duration = time.perf_counter() - start
    return summarize(list(stream_results), long_results, workload, duration)


def _ms(values: list[float], p: float) -> float | None:
    return round(float(np.percentile(values, p)) * 1000.0, 3) if values else None


def summarize(streams: list[RequestResult], longs: list[RequestResult], workload: Workload, duration: float) -> dict:
    """One configuration's figures: the streams' ITLs pooled over every stream, the long prompts' TTFTs, tokens."""
    itl = [gap for r in streams if r.success for gap in r.itl]
    # a chunk may carry several tokens (a server that lags merges steps; one read may hold several events, a gap of
    # 0): each stream's TPOT, (last chunk - first chunk) / (tokens - 1), is the per-token view beside the gaps
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in streams if r.success and r.output_tokens > 1]
    ttft = [r.ttft for r in longs if r.success]
    stream_tokens = sum(r.output_tokens for r in streams if r.success)
    long_tokens = sum(r.output_tokens for r in longs if r.success)
    errors = [r.error for r in streams + longs if not r.success]
    return {
        "duration_s": round(duration, 3),
        "streams_ok": sum(r.success for r in streams), "long_prompts_ok": sum(r.success for r in longs),
        "stream_tokens_asked": workload.streams * workload.stream_output_len,
        "stream_tokens_received": stream_tokens,
        "long_tokens_asked": workload.long_prompts * workload.long_output_len,
        "long_tokens_received": long_tokens,
        "itl_count": len(itl),
        "p50_itl_ms": _ms(itl, 50), "p99_itl_ms": _ms(itl, 99), "max_itl_ms": _ms(itl, 100),
        "mean_itl_ms": round(float(np.mean(itl)) * 1000.0, 3) if itl else None,
        "itl_curve_ms": {f"p{p:g}": _ms(itl, p) for p in ITL_CURVE_PERCENTILES},
        "p50_tpot_ms": _ms(tpot, 50), "p99_tpot_ms": _ms(tpot, 99),
        "p50_long_ttft_ms": _ms(ttft, 50), "p99_long_ttft_ms": _ms(ttft, 99),
        "output_tokens_per_s": round((stream_tokens + long_tokens) / duration, 2) if duration else None,
        "stream_output_tokens_per_s": round(stream_tokens / duration, 2) if duration else None,
        "errors": errors[:5],
    }


# ---- the run ----

def run_config(config: str, args, workload: Workload, tokenizer: str, vocab: int, kv_gib: float, buffer_mib: int,
               log_dir: Path) -> dict:
    """Starts one configuration's processes, drives the workload through its front, stops them."""
    if config == "colocated":
        specs = {"engine": engine_args(args, tokenizer, workload, kv_gib, None)}
    else:
        buffer = buffer_mib << 20
        specs = {"prefill": engine_args(args, tokenizer, workload, kv_gib / 2, transfer_config("kv_producer", buffer)),
                 "decode": engine_args(args, tokenizer, workload, kv_gib / 2, transfer_config("kv_consumer", buffer))}
    t0 = time.perf_counter()
    with running(specs, log_dir, args.startup_timeout) as engines:
        if config == "colocated":
            return _drive_logged(engines["engine"].url, workload, vocab, args, t0)
        front = router_args(engines["prefill"].url, engines["decode"].url, args.request_timeout)
        with running({"router": front}, log_dir, args.startup_timeout) as router:
            before: dict[str, float] = {}
            result = _drive_logged(router["router"].url, workload, vocab, args, t0,
                                   on_warm=lambda: before.update(transfer_counts(engines["decode"].url)))
            after = transfer_counts(engines["decode"].url)
            return {**result, "decode_engine": {k: v - before.get(k, 0.0) for k, v in after.items()}}


def _drive_logged(url: str, workload: Workload, vocab: int, args, t0: float,
                  on_warm: Callable[[], None] | None = None) -> dict:
    startup = time.perf_counter() - t0
    result = asyncio.run(drive(url, workload, vocab, args.request_timeout, on_warm))
    return {"startup_s": round(startup, 1), **result}


_SAMPLE = re.compile(r'^vllm:(\w+)\{([^}]*)\} (\S+)$')


def transfer_counts(url: str) -> dict[str, float]:
    """The decode engine's evidence that it read the prompts' KV rather than computing them: its prompt tokens by
    source (local_compute, external_kv_transfer, ...) and its kv_transfer_* counters, each summed over labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == "prompt_tokens_by_source_total":
            source = re.search(r'source="([^"]+)"', labels)
            name = f"prompt_tokens_{source.group(1) if source else 'unknown'}"
        elif not (name.startswith("kv_transfer_") and name.endswith("_total")):
            continue
        counts[name] = counts.get(name, 0.0) + float(value)
    return counts


def ratios(results: dict[str, dict]) -> dict:
    """disagg / colocated of the figures issue 49 names (None where either is missing)."""
    if not all(c in results for c in CONFIGS):
        return {}

    if any("error" in r for r in results.values()):
        return {}

    def ratio(key: str) -> float | None:
        a, b = results["disagg"].get(key), results["colocated"].get(key)
        return round(a / b, 4) if a is not None and b else None
    p99 = ratio("p99_itl_ms")
    return {"p99_itl": p99, "p50_itl": ratio("p50_itl_ms"), "p99_tpot": ratio("p99_tpot_ms"),
            "p99_long_ttft": ratio("p99_long_ttft_ms"),
            "output_tokens_per_s": ratio("output_tokens_per_s"),
            "p99_itl_at_most_half": None if p99 is None else p99 <= 0.5}


def run(args) -> dict:
    if not args.model:
        raise ValueError("pressroom bench disagg needs --model (or --from-json).")
    device = resolve_device(args.device)
    workload = workload_from_args(args, device)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or set(configs) - set(CONFIGS):
        raise ValueError(f"--configs {args.configs!r}: name colocated, disagg or both.")
    kv_gib, buffer_mib = _setting(args, device, "kv_cache_gib"), _setting(args, device, "kv_buffer_mib")
    with tempfile.TemporaryDirectory(prefix="pressroom-disagg-") as tmp:
        tokenizer = args.tokenizer or str(write_token_tokenizer(Path(tmp) / "tokenizer", vocab_size(args.model)))
        vocab = vocab_size(args.model) if not args.tokenizer else _tokenizer_size(args.tokenizer)
        log_dir = Path(args.output_json).with_suffix(".logs") if args.output_json else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        results = {}
        for config in configs:
            print(f"bench disagg: {config} ...", file=sys.stderr, flush=True)
            try:
                results[config] = run_config(config, args, workload, tokenizer, vocab, kv_gib, buffer_mib, log_dir)
            except (RuntimeError, OSError) as e:  # the other configuration's figures still count
                results[config] = {"error": str(e)[-3000:]}
                print(f"{config} failed: {e}", file=sys.stderr, flush=True)
                continue
            print_config(config, results[config])
            report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
                      "device": _device_name(device), "model": args.model, "load_format": args.load_format,
                      "workload": asdict(workload), "kv_cache_gib": {"colocated": kv_gib, "disagg_each": kv_gib / 2},
                      "kv_buffer_mib": buffer_mib, "serve_args": args.serve_args, "results": results,
                      "ratios": ratios(results)}
            if args.output_json:  # each configuration's figures as soon as they exist: a run cut short keeps them
                Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _tokenizer_size(path: str) -> int:
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(path))


def _device_name(device: str) -> str:
    if device != "cuda":
        return f"CPU: {machine()['cpu']}"
    import torch
    return torch.cuda.get_device_name(0)


def print_config(config: str, r: dict) -> None:
    print(f"{config:>9}: ITL p50 {r['p50_itl_ms']} ms, p99 {r['p99_itl_ms']} ms, max {r['max_itl_ms']} ms; TPOT p99 "
          f"{r['p99_tpot_ms']} ms; long prompts' TTFT p50 {r['p50_long_ttft_ms']} ms; {r['output_tokens_per_s']} "
          f"output tok/s; streams {r['stream_tokens_received']}/{r['stream_tokens_asked']} tokens; "
          f"{r['duration_s']} s", flush=True)
    if "decode_engine" in r:
        d = r["decode_engine"]
        print(f"{'':>9}  the decode engine read {d.get('prompt_tokens_external_kv_transfer', 0):.0f} prompt tokens' KV "
              f"and computed {d.get('prompt_tokens_local_compute', 0):.0f}", flush=True)


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot drawn", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = report["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    results = {config: r for config, r in results.items() if "error" not in r}
    for config, r in results.items():
        curve = r["itl_curve_ms"]
        left.plot(list(ITL_CURVE_PERCENTILES), [curve[f"p{p:g}"] for p in ITL_CURVE_PERCENTILES], marker="o",
                  label=config)
    left.set_xlabel("percentile of the running streams' ITLs")
    left.set_ylabel("inter-token latency (ms)")
    left.set_yscale("log")
    left.legend()
    right.bar(list(results), [r["output_tokens_per_s"] for r in results.values()], color="tab:green")
    right.set_ylabel("output tokens/s")
    w = report["workload"]
    fig.suptitle(f"{Path(report['model']).name} on {report['device']}: {w['streams']} streams x "
                 f"{w['stream_output_len']} tokens, {w['long_prompts']} prompts of {w['long_input_len']} tokens at "
                 f"{w['long_rate']:g}/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    # SIGTERM (a `timeout`, a job runner) unwinds like Ctrl-C, through `running`'s stop of every engine: they run in
    # sessions of their own, which no signal to this process reaches
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        report = report_from_args(args, run, plot)
    finally:
        signal.signal(signal.SIGTERM, before)
    print(json.dumps(report["ratios"]))
    return 0 if all("error" not in r for r in report["results"].values()) else 1
