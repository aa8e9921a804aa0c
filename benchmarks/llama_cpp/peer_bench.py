"""llama.cpp peer benchmark (llama-cpp-python): one pressroom `bench latency` workload, batch 1.

Run with a llama venv's interpreter (benchmarks/llama_cpp/setup.sh makes it):

    .llama-venv-avx2/bin/python benchmarks/llama_cpp/peer_bench.py --model FILE.gguf \\
        --workload workload.json --output result.json

Workload JSON: {"mode": "latency", "prompts": [[token ids...], ...], "output_len": N, "ignore_eos": true,
"num_iters_warmup": W, "num_iters": K}; timed iteration i runs prompt i (cycled), one at a time. Greedy;
each run starts from an empty KV cache (no prefix reuse between runs, as pressroom's runs clear its prefix
cache) and generates exactly output_len tokens (llama.cpp's token loop does not stop at EOS by itself).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--workload", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    spec = json.load(open(args.workload))
    if spec["mode"] != "latency":
        raise SystemExit("the llama.cpp peer runs latency workloads only")
    from llama_cpp import Llama, __version__
    prompts, n = spec["prompts"], spec["output_len"]
    llm = Llama(model_path=args.model, n_ctx=max(map(len, prompts)) + n + 16, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, verbose=False)

    def one(prompt: list[int]) -> float:
        llm.reset()
        start = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)):
            if i + 1 == n:
                break
        return time.perf_counter() - start

    for _ in range(spec["num_iters_warmup"]):
        one(prompts[0])
    times = [one(prompts[i % len(prompts)]) for i in range(spec["num_iters"])]
    avg = statistics.fmean(times)
    ordered = sorted(times)
    result = {"backend": "llama.cpp", "llama_cpp_python": __version__, "dtype": "GGUF as shipped",
              "latencies_s": [round(t, 4) for t in times], "avg_latency_s": round(avg, 4),
              "p50_latency_s": round(ordered[len(ordered) // 2], 4), "p99_latency_s": round(ordered[-1], 4),
              "output_tokens_per_s": round(n / avg, 2), "batch_size": 1, "threads": args.threads}
    json.dump(result, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
