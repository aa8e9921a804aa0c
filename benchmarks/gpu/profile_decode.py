"""Where a decode step's time goes on the GPU: torch.profiler over batch-1 decode (CUDA graphs) and
over decode steps of a large batch (eager beyond the largest graph), Llama-3.1-8B shape, dummy weights.
Prints per-step wall time, the top operators by device and host time, and from each Chrome trace the
steps one by one (split at each step's first KV write): span, GPU-busy time and the largest kernels.
Run on the GPU machine: python benchmarks/gpu/profile_decode.py [llama-3.1-8b] [OUT_DIR] [b1,b1000,b256] [0.85]
(the first argument: a shipped shape's name or a model path; the third picks the profiles, default all three;
the fourth: the engine's gpu_memory_utilization, higher for a model that barely fits, e.g. 0.97 for the reduced
DeepSeek-V4-Flash on an 80 GB card).
"""
import collections
import itertools
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pressroom import LLM, SamplingParams
from pressroom.benchmarks.shapes import resolve_shape


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profiled(llm: LLM, prompts: list[list[int]], max_tokens: int, name: str, out: str) -> None:
    timed(llm, prompts, max_tokens)  # warm-up at this shape
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = timed(llm, prompts, max_tokens)
    print(f"\n== {name}: {len(prompts)} prompts x {max_tokens} tokens in {seconds:.3f} s "
          f"({len(prompts) * max_tokens / seconds:.1f} output tok/s)")
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    prof.export_chrome_trace(f"{out}/{name}.json")
    print_steps(f"{out}/{name}.json", llm.engine.hf_config.num_hidden_layers)


def print_steps(trace: str, num_layers: int, shown: int = 3) -> None:
    """Per step of a trace: wall span, summed kernel time, and the twelve largest kernels (ms)."""
    with open(trace) as f:
        kernels = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    writes = [i for i, e in enumerate(kernels) if "_write_kv" in e["name"]]
    starts = writes[::num_layers] + [len(kernels)]
    steps = list(itertools.pairwise(starts))
    for n, (a, b) in enumerate(steps):
        if shown <= n < len(steps) - 1:
            continue  # the first few and the last
        seg = kernels[a:b]
        span = (seg[-1]["ts"] + seg[-1]["dur"] - seg[0]["ts"]) / 1e3
        by_name = collections.Counter()
        for e in seg:
            by_name[e["name"][:40]] += e["dur"] / 1e3
        top = "; ".join(f"{k} {v:.2f}" for k, v in by_name.most_common(12))
        print(f"step {n}: span {span:.2f} ms, busy {sum(by_name.values()):.2f} ms; {top}")


def main() -> None:
    model = str(resolve_shape(sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"))
    out = sys.argv[2] if len(sys.argv) > 2 else "."
    which = sys.argv[3].split(",") if len(sys.argv) > 3 else ["b1", "b1000", "b256"]
    utilization = float(sys.argv[4]) if len(sys.argv) > 4 else 0.85
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False,
              gpu_memory_utilization=utilization)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.hf_config.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(0, vocab, (n, length), generator=gen).tolist()

    one = prompts(1, 32)
    for tokens in (64, 256):
        s = timed(llm, one, tokens)
        print(f"batch 1, {tokens} tokens: {s:.3f} s, {s / tokens * 1e3:.3f} ms per token")
    if "b1" in which:
        profiled(llm, one, 16, "decode_b1", out)
    if "b1000" in which:
        profiled(llm, prompts(1000, 32), 8, "decode_b1000", out)
    if "b256" in which:
        profiled(llm, prompts(256, 32), 16, "decode_b256", out)


if __name__ == "__main__":
    main()
