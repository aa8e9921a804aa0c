"""`pressroom bench context`: a whole engine's batch-1 decode step time against the context length, for one or more
models at real shapes with dummy weights: a linear-attention or state-space model (whose recurrent layers cost the
same at any context) beside a full-attention one (whose every layer reads a KV cache that grows with it).

For each model, context and batch size (`--batch-sizes`, default 1): that many requests of `context` random prompt
tokens are prefilled (timed, as the prefill), then `--decode-steps` engine steps of their decode are timed one by
one (the median is the step time). Each step is also set against the copy bandwidth of the card over the bytes it
reads: the weights its tokens use (bench gpu's decode_read_bytes, counted once: at batch 1 exactly, above it a lower
bound, as more experts are touched), the KV cache of every request at that context and their recurrent states
(bytes from the engine's own cache layout: its ModelSpec). A batch whose KV does not fit is skipped. On the CPU it
runs a tiny shape, to check the plumbing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pressroom.benchmarks.gpu import (
    DTYPES,
    copy_bandwidth,
    free_device_memory,
    model_size,
    positive_ints,
    resolve_device,
    sync,
)
from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.benchmarks.workload import machine, random_prompts, report_from_args
from pressroom.config import json_object

DEFAULT_MODELS = ["kimi-linear-48b-a3b", "qwen3-30b-a3b"]
NOTE = ("decode: median of --decode-steps engine steps of one request after its prompt (dummy weights, bf16 on "
        "CUDA); bytes per step: the weights one token uses (bench gpu's decode_read_bytes) + KV bytes per token x "
        "context + one request's recurrent state, from the engine's own cache layout; bound: copy bandwidth / "
        "those bytes")


def measure_model(model: str, args, device: torch.device, bandwidth: float) -> dict:
    from pressroom import LLM, SamplingParams
    from pressroom.model.loader import load_hf_config
    overrides = args.hf_overrides.get(Path(model).name)
    hf_config = load_hf_config(model, overrides)
    contexts = args.contexts
    llm = LLM(model=model, load_format="dummy", dtype=args.dtype, device=args.device, skip_tokenizer_init=True,
              hf_overrides=overrides,
              max_model_len=max(contexts) + args.decode_steps + 8, enable_prefix_caching=False, seed=args.seed,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(4, *args.batch_sizes),
              **({"kv_cache_memory_gib": args.kv_cache_memory_gib} if args.kv_cache_memory_gib else {}))
    spec, block_size = llm.engine.core.model_spec, llm.engine.core.config.cache.block_size
    kv_per_token = spec.kv_bytes_per_block / block_size
    weights = model_size(hf_config, DTYPES[args.dtype]).decode_read_bytes
    capacity = (llm.engine.core.kv_cache.pool.num_blocks - 1) * block_size
    rows = []
    for batch in args.batch_sizes:
        for i, context in enumerate(contexts):
            if batch * (context + args.decode_steps + block_size) > capacity:
                print(f"{Path(model).name} batch {batch} context {context}: skipped, the KV cache holds {capacity} "
                      "tokens", flush=True)
                continue
            prompts = random_prompts(batch, context, hf_config.vocab_size, args.seed + i)
            prefill_s, steps = _decode_steps(llm, prompts, args.decode_steps, device, SamplingParams)
            step_s = statistics.median(steps)
            read = weights + batch * (kv_per_token * context + spec.state_bytes_per_slot)
            rows.append({"batch": batch, "context": context, "prefill_s": round(prefill_s, 4),
                         "decode_step_ms": round(1e3 * step_s, 4), "bytes_per_step": int(read),
                         "bound_step_ms": round(1e3 * read / bandwidth, 4),
                         "over_bound": round(read / bandwidth / step_s, 4)})
            print(f"{Path(model).name} batch {batch} context {context:>7}: prefill {prefill_s:7.2f} s, decode step "
                  f"{1e3 * step_s:8.3f} ms ({rows[-1]['over_bound']:.0%} of the copy-bandwidth bound)", flush=True)
    llm.shutdown()
    del llm
    free_device_memory(device)
    return {"model": model, "hf_overrides": overrides, "kv_bytes_per_token": kv_per_token,
            "state_bytes_per_request": spec.state_bytes_per_slot, "weights_read_per_step": weights, "rows": rows,
            "growth": _growth(rows)}


def _growth(rows: list[dict]) -> dict[str, float]:
    """Each row's step time over the smallest context's at its batch size: keys "context" at batch 1, else
    "context@batch"."""
    first = {}
    for r in rows:
        first.setdefault(r["batch"], r["decode_step_ms"])
    return {(str(r["context"]) if r["batch"] == 1 else f"{r['context']}@{r['batch']}"):
            round(r["decode_step_ms"] / first[r["batch"]], 4) for r in rows}


def _decode_steps(llm, prompts: list[list[int]], num_steps: int, device: torch.device, params_cls
                  ) -> tuple[float, list[float]]:
    """Seconds of the prompts' prefill (until each has its first token), and of each decode step after it."""
    engine = llm.engine
    params = params_cls(temperature=0, max_tokens=num_steps + 1, ignore_eos=True, detokenize=False)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"context-bench-{i}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    sync(device)
    prefill = time.perf_counter() - start
    steps = []
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        engine.step()
        sync(device)
        steps.append(time.perf_counter() - begin)
    return prefill, steps


def run(args) -> dict:
    device = resolve_device(args.device)
    bandwidth = copy_bandwidth(device, int((4.0 if device.type == "cuda" else 0.25) * (1 << 30)))
    models = [measure_model(str(m), args, device, bandwidth) for m in args.models]
    return {"benchmark": "context", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": args.dtype,
            "copy_bytes_per_s": bandwidth, "decode_steps": args.decode_steps, "note": NOTE, "models": models}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    contexts = sorted({r["context"] for m in report["models"] for r in m["rows"]})
    for m in report["models"]:
        for batch in sorted({r["batch"] for r in m["rows"]}):
            rows = [r for r in m["rows"] if r["batch"] == batch]
            label = Path(m["model"]).name + ("" if batch == 1 else f", batch {batch}")
            ax.plot([r["context"] for r in rows], [r["decode_step_ms"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step, ms")
    ax.set_title(f"decode step against context, {report['device']}, {report['dtype']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    report = report_from_args(args, run, plot)
    print(json.dumps({Path(m["model"]).name: m["growth"] for m in report["models"]}))
    return 0


def add_context_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=lambda text: [shape_arg(t) for t in text.split(",") if t],
                        default=DEFAULT_MODELS, help=shape_help("comma-separated models, dummy weights"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda, or cpu to test the plumbing with a tiny shape")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the weights' dtype")
    parser.add_argument("--contexts", type=positive_ints, default=[4096, 16384, 65536, 131072],
                        help="comma-separated context lengths")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed at each context")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1],
                        help="comma-separated request counts decoded together at each context")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of the GPU the engine takes")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=None, help="the cache's size (CPU runs)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the dummy weights")
    parser.add_argument("--hf-overrides", type=lambda text: json_object(text, "--hf-overrides"), default={},
                        help='per model (its name in --models), config values to replace, e.g. {"qwen3-30b-a3b": '
                             '{"max_position_embeddings": 131200}} to time a model past its checkpoint\'s limit')
    parser.add_argument("--output-json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="write a PNG of step time against context (needs matplotlib)")
    parser.add_argument("--from-json", default=None, help="plot a saved report instead of running")
