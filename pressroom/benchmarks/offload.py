"""`pressroom bench offload`: a shared-document workload whose prefix working set is several times the device's
KV cache, run three times in one command: no offload (evicted prefixes are recomputed), the CPU tier, and the
CPU tier with the disk tier behind it.

Documents are random token sequences (dummy or real weights alike); each request is one document plus a
question of its own, in random order, sent with a fixed number in flight (a closed loop, as `vllm bench serve
--max-concurrency`). TTFT counts from a request's submission to its first token; throughput is output tokens
over the run's wall time. The CPU tier gets the same byte budget in both offload configurations (by default
half the working set), so the disk tier's share shows in the third. A fourth configuration, `no-eviction`, is
asked for by name: no offload and a device cache that holds the whole working set, the ceiling any tier could
reach on the same requests.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.benchmarks.workload import machine, report_from_args
from pressroom.config import resolve_device

CONFIGS = ("none", "cpu", "cpu+disk")
REFERENCE_CONFIGS = ("no-eviction",)  # run only when named
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"


def make_requests(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    docs = [[rng.randrange(10, args.vocab_limit) for _ in range(args.document_len)] for _ in range(args.num_documents)]
    return [docs[rng.randrange(args.num_documents)] + [rng.randrange(10, args.vocab_limit)
                                                        for _ in range(args.question_len)]
            for _ in range(args.num_requests)]


def engine_args(args, config: str, cpu_gib: float, disk: Path) -> dict:
    kwargs = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype, "device": args.device,
              "skip_tokenizer_init": True, "seed": args.seed, "max_num_seqs": args.max_concurrency,
              "num_gpu_blocks_override": device_cache_tokens(args, config) // 16, "enforce_eager": args.enforce_eager,
              "max_model_len": args.document_len + args.question_len + args.output_len}
    if config not in ("none", "no-eviction"):
        kwargs["kv_offloading_size"] = cpu_gib
    if config == "cpu+disk":
        kwargs["kv_offloading_disk_path"] = str(disk)
    return kwargs


def device_cache_tokens(args, config: str) -> int:
    if config != "no-eviction":
        return args.device_cache_tokens
    # every document, plus the requests in flight (their questions and outputs, and a block's rounding each)
    per_request = args.question_len + args.output_len + 2 * 16
    return args.num_documents * (args.document_len + 16) + args.max_concurrency * per_request


def run_config(args, config: str, prompts: list[list[int]], cpu_gib: float, disk: Path) -> tuple[dict, int]:
    """One configuration's closed-loop run; returns its figures and the KV bytes per token."""
    from pressroom import LLM, SamplingParams
    llm = LLM(**engine_args(args, config, cpu_gib, disk))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    pending = list(enumerate(prompts))[::-1]
    submitted, ttft, in_flight, produced = {}, {}, set(), 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < args.max_concurrency:
            i, prompt = pending.pop()
            rid = f"r{i}"
            submitted[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            in_flight.add(rid)
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[out.request_id] = now - submitted[out.request_id]
            if out.finished:
                in_flight.discard(out.request_id)
                produced += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    per_token = engine.runner.kv_cache_bytes_per_block() // 16
    llm.shutdown()
    times = sorted(ttft.values())
    row = {"config": config, "requests": len(prompts), "elapsed_s": round(elapsed, 3),
           "output_tokens_per_s": round(produced / elapsed, 2), "mean_ttft_ms": round(1e3 * statistics.mean(times), 2),
           "median_ttft_ms": round(1e3 * statistics.median(times), 2),
           "p99_ttft_ms": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 2),
           "prefix_cache_hit_tokens": stats.prefix_cache_hits}
    if stats.offload is not None:
        row["tier_chunk_hits"] = {tier: t.chunk_hits for tier, t in stats.offload.tiers.items()}
        row["corrupt_chunks"] = sum(t.corrupt_chunks for t in stats.offload.tiers.values())
    print(f"{config:>9}: {row['output_tokens_per_s']:9.1f} output tok/s, mean TTFT {row['mean_ttft_ms']:9.1f} ms, "
          f"p99 {row['p99_ttft_ms']:9.1f} ms; tier hits {row.get('tier_chunk_hits', {})}", flush=True)
    return row, per_token


def run(args) -> dict:
    prompts = make_requests(args)
    device = resolve_device(args.device)
    working_set = args.num_documents * args.document_len
    disk = Path(args.kv_offloading_disk_path or tempfile.mkdtemp(prefix="pressroom-offload-bench-"))
    shutil.rmtree(disk, ignore_errors=True)  # a warm disk tier from an earlier run would flatter the figures
    rows, cpu_gib = [], args.kv_offloading_size
    for config in args.configs:
        if config in CONFIGS[1:] and cpu_gib is None:
            raise ValueError("give --kv-offloading-size, or run the none configuration first (it measures the "
                             "KV bytes per token that size the CPU tier by default)")
        row, per_token = run_config(args, config, prompts, cpu_gib or 0.0, disk)
        if cpu_gib is None:
            cpu_gib = args.cpu_tier_fraction * working_set * per_token / (1 << 30)
        rows.append(row)
    if not args.kv_offloading_disk_path:
        shutil.rmtree(disk, ignore_errors=True)
    by = {r["config"]: r for r in rows}
    base = by.get("none")
    ratios = {config: {"ttft_vs_recompute": round(by[config]["mean_ttft_ms"] / base["mean_ttft_ms"], 3),
                       "throughput_vs_recompute": round(by[config]["output_tokens_per_s"]
                                                        / base["output_tokens_per_s"], 3)}
              for config in ("cpu", "cpu+disk", "no-eviction") if config in by and base is not None}
    return {"model": args.model or EMBEDDED_NAME, "device": device, "machine": machine(), "dtype": args.dtype,
            "workload": {"documents": args.num_documents, "document_len": args.document_len,
                         "requests": args.num_requests, "question_len": args.question_len,
                         "output_len": args.output_len, "max_concurrency": args.max_concurrency,
                         "device_cache_tokens": args.device_cache_tokens, "working_set_tokens": working_set},
            "cpu_tier_gib": cpu_gib, "rows": rows, "ratios": ratios}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report["rows"]
    names = [r["config"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.4, 3.6))
    left.bar(names, [r["mean_ttft_ms"] for r in rows], color="tab:blue")
    left.set_ylabel("mean TTFT (ms)")
    right.bar(names, [r["output_tokens_per_s"] for r in rows], color="tab:green")
    right.set_ylabel("output tokens/s")
    w = report["workload"]
    fig.suptitle(f"{Path(report['model']).name} on {report['device']}: {w['documents']} documents x "
                 f"{w['document_len']} tokens, {w['requests']} requests, device cache {w['device_cache_tokens']} "
                 "tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    report = report_from_args(args, run, plot)
    print(json.dumps(report["ratios"]))
    return 0


def configs(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = set(names) - set(CONFIGS) - set(REFERENCE_CONFIGS)
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"configurations are {', '.join(CONFIGS + REFERENCE_CONFIGS)}; "
                                         f"got {value!r}")
    return names


def add_offload_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=shape_arg, default=None,
                        help=shape_help("the model (default: the embedded SmolLM2); a shape wants --load-format dummy"))
    parser.add_argument("--load-format", default="auto", help="auto, or dummy for random weights at the config's "
                                                              "shapes")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (auto: as `pressroom serve` picks)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the engine runs")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--configs", type=configs, default=list(CONFIGS),
                        help="comma-separated: none,cpu,cpu+disk (the default), and no-eviction (the device cache "
                             "holds the working set: the ceiling of any tier)")
    parser.add_argument("--num-documents", type=int, default=24, help="distinct shared documents")
    parser.add_argument("--document-len", type=int, default=512, help="tokens per shared document")
    parser.add_argument("--num-requests", type=int, default=120, help="requests, each a random document")
    parser.add_argument("--question-len", type=int, default=16, help="each request's own tokens after its document")
    parser.add_argument("--output-len", type=int, default=8, help="output tokens per request (EOS ignored)")
    parser.add_argument("--max-concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--device-cache-tokens", type=int, default=4096,
                        help="the device KV cache's size in tokens (the working set should be several times it)")
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="CPU tier GiB (default: --cpu-tier-fraction of the working set)")
    parser.add_argument("--cpu-tier-fraction", type=float, default=0.5,
                        help="the CPU tier's share of the working set's KV bytes, when no size is given")
    parser.add_argument("--kv-offloading-disk-path", default=None, help="disk tier directory (default: a temporary "
                                                                        "one; emptied before the run)")
    parser.add_argument("--vocab-limit", type=int, default=40000, help="document token ids are below this")
    parser.add_argument("--seed", type=int, default=0, help="seeds the documents, the order and dummy weights")
    parser.add_argument("--output-json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="a PNG of mean TTFT and throughput per configuration")
    parser.add_argument("--from-json", default=None, help="plot a saved report instead of running")
