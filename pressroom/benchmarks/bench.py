"""`pressroom bench throughput|latency`: vLLM's bench semantics, several backends back to back in one run."""
from __future__ import annotations

import json
import statistics
import time

from pressroom.benchmarks import backends
from pressroom.benchmarks.workload import Workload, file_prompts, machine, random_prompts

# pressroom-nospec: the same engine with speculative decoding off, beside a speculative run in one bench
BACKENDS = ("pressroom", "pressroom-nospec", "pressroom-lora", "hf", "vllm", "llamacpp")


def build_workload(args, tokenizer, vocab_size: int, num: int) -> Workload:
    if args.dataset_path:
        prompts = file_prompts(args.dataset_path, tokenizer, num, args.input_len, getattr(args, "chat", False))
    else:
        prompts = random_prompts(num, args.input_len, vocab_size, args.seed)
    return Workload(prompts, args.output_len, args.ignore_eos)


def throughput_result(name: str, workload: Workload, elapsed: float, extra: dict | None = None) -> dict:
    out_tokens = len(workload.prompts) * workload.output_len
    return {"backend": name, "elapsed_s": round(elapsed, 3), "num_requests": len(workload.prompts),
            "total_input_tokens": workload.num_input_tokens, "total_output_tokens": out_tokens,
            "requests_per_s": round(len(workload.prompts) / elapsed, 3),
            "output_tokens_per_s": round(out_tokens / elapsed, 2),
            "total_tokens_per_s": round((out_tokens + workload.num_input_tokens) / elapsed, 2), **(extra or {})}


def latency_result(name: str, workload: Workload, batch_size: int, latencies: list[float],
                   extra: dict | None = None) -> dict:
    ordered = sorted(latencies)
    avg = statistics.fmean(latencies)
    return {"backend": name, "batch_size": batch_size, "latencies_s": [round(x, 4) for x in latencies],
            "avg_latency_s": round(avg, 4),
            "p50_latency_s": round(ordered[len(ordered) // 2], 4),
            "p99_latency_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
            "output_tokens_per_s": round(batch_size * workload.output_len / avg, 2), **(extra or {})}


def run(args, engine_kwargs: dict) -> dict:
    names = [b.strip() for b in args.backend.split(",")]
    bad = [b for b in names if b not in BACKENDS]
    if bad:
        raise ValueError(f"Unknown backend(s) {bad}; choose from {', '.join(BACKENDS)}.")
    from pressroom.model.loader import load_hf_config, load_tokenizer, resolve_model_path
    path = resolve_model_path(engine_kwargs.get("model"))
    tokenizer = load_tokenizer(engine_kwargs.get("tokenizer") or path)
    vocab = load_hf_config(path).vocab_size
    latency = args.command == "latency"
    num = latency_prompts(args) if latency else args.num_prompts
    workload = build_workload(args, tokenizer, vocab, num)
    results = [r for name in names for r in _run_backends(name, args, engine_kwargs, path, workload, latency)]
    report = {"benchmark": args.command, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "model": path, "input_len": args.input_len, "output_len": args.output_len,
              "num_prompts": num, "ignore_eos": args.ignore_eos, "results": results,
              "ratios": _ratios(results)}
    _print(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def latency_prompts(args) -> int:
    """A dataset gives each timed iteration its own batch (acceptance lengths then average over that many
    prompts); random prompts repeat one batch, as `vllm bench latency` does."""
    return args.batch_size * (args.num_iters if args.dataset_path else 1)


def latency_batches(args) -> list[list[int]]:
    """Prompt indices of each timed iteration, as `latency_prompts` laid them out."""
    b = args.batch_size
    if not args.dataset_path:
        return [list(range(b))] * args.num_iters
    return [list(range(i * b, (i + 1) * b)) for i in range(args.num_iters)]


def _run_backends(name: str, args, engine_kwargs: dict, path: str, workload: Workload, latency: bool) -> list[dict]:
    """One result per backend, and one per dtype for vllm (--peer-dtype float32,bfloat16: its best of both)."""
    n = len(workload.prompts)
    if name == "vllm":
        mode = "latency" if latency else "throughput"
        dtypes = [d.strip() for d in args.peer_dtype.split(",")]
        size = args.batch_size if latency else n  # vLLM's peer repeats the first batch
        results = [backends.run_vllm(workload, mode, size, args.num_iters_warmup, args.num_iters if latency else 1, d)
                   for d in dtypes]
        for r, d in zip(results, dtypes):
            r["backend"] = "vllm-cpu" if len(dtypes) == 1 else f"vllm-cpu-{d}"
        return results
    if name == "llamacpp":
        if not latency:
            raise ValueError("The llama.cpp peer runs bench latency only (llama-cpp-python does not batch).")
        if args.batch_size != 1:
            raise ValueError("The llama.cpp peer runs at batch 1: pass --batch-size 1.")
        return [backends.run_llamacpp(workload, path, args.llamacpp_isa, args.num_iters_warmup, args.num_iters)]
    return [_run_local(name, args, engine_kwargs, path, workload, latency)]


def _run_local(name: str, args, engine_kwargs: dict, path: str, workload: Workload, latency: bool) -> dict:
    n = len(workload.prompts)
    batches = latency_batches(args) if latency else [list(range(n))]
    if name == "pressroom-lora":
        times, extra = _run_with_adapters(args, engine_kwargs, path, workload, batches)
    elif name in ("pressroom", "pressroom-nospec"):
        kwargs = dict(engine_kwargs, speculative_config=None) if name == "pressroom-nospec" else engine_kwargs
        times, extra = backends.run_pressroom(kwargs, workload, batches, args.num_iters_warmup)
    else:
        times = backends.run_hf(path, args.hf_dtype, workload, batches, args.num_iters_warmup)
        extra = {"dtype": args.hf_dtype}
    if latency:
        return latency_result(name, workload, len(batches[0]), times, extra)
    return throughput_result(name, workload, times[0], extra)


def _run_with_adapters(args, engine_kwargs: dict, path: str, workload: Workload, batches: list[list[int]]
                       ) -> tuple[list[float], dict]:
    """pressroom with --num-loras random adapters of rank --lora-rank on every projection, the prompts spread
    over them in turn (one slot each)."""
    import tempfile
    from pathlib import Path

    from pressroom.benchmarks.lora import write_random_adapters
    from pressroom.model.loader import load_hf_config
    with tempfile.TemporaryDirectory() as root:
        loras = write_random_adapters(load_hf_config(path), Path(root), args.num_loras, args.lora_rank)
        kwargs = dict(engine_kwargs, enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.lora_rank)
        times, extra = backends.run_pressroom(kwargs, workload, batches, args.num_iters_warmup, loras)
    return times, dict(extra, num_loras=args.num_loras, lora_rank=args.lora_rank)


def _ratios(results: list[dict]) -> dict:
    ours = next((r for r in results if r["backend"] == "pressroom"), None)
    if ours is None:
        return {}
    return {f"pressroom/{r['backend']}": round(ours["output_tokens_per_s"] / r["output_tokens_per_s"], 3)
            for r in results if r is not ours}


def _print_calibration(calibration: dict | None) -> None:
    """The drafter's confidences against verification: expected calibration error, and per bin the
    mean stated (or calibrated) confidence beside the acceptance observed."""
    for kind, table in (calibration or {}).items():
        if table["n"]:
            bins = ", ".join(f"{b['predicted']:.2f}->{b['observed']:.2f} ({b['n']})" for b in table["bins"])
            print(f"{'':>10}  confidences {kind}: ECE {table['ece']:.3f} over {table['n']} drafts; {bins}")


def _print(report: dict) -> None:
    print(f"\n== bench {report['benchmark']}: {report['num_prompts']} prompts x {report['input_len']} in "
          f"/ {report['output_len']} out ==")
    for r in report["results"]:
        line = f"{r['backend']:>10}  output tok/s {r['output_tokens_per_s']:>9.1f}"
        if "avg_latency_s" in r:
            line += f"   avg latency {r['avg_latency_s']:.3f}s"
        print(line + f"   dtype {r.get('dtype', '?')}")
        spec = r.get("spec_decode")
        if spec:
            print(f"{'':>10}  {spec['method']} K={spec['num_speculative_tokens']}: mean acceptance length "
                  f"{spec['mean_acceptance_length']}, per position {spec['acceptance_rate_per_pos']}")
            _print_calibration(spec.get("confidence_calibration"))
    for k, v in report["ratios"].items():
        print(f"{k}: {v:.2f}x")
