"""Where the offline-throughput workload's time goes: a step-by-step timeline of `bench gpu`'s throughput
run (1,000 random 512-token prompts, 256 output tokens, dummy weights), then torch.profiler over decode
steps at the workload's real contexts.

The timeline records, for every engine step, its wall time (under async scheduling: the loop's period
while that step was being launched, about the device's time per step) and what it held (prefill
tokens, decode rows, verification tokens), and prints the time spent in steps with prefill against pure decode steps,
and pure decode steps by batch size with their mean time per step and per token. The profile then
prefills --profile-batch prompts, lets them decode until every context is past the prompt, and traces a
few decode steps: the top operators, then each step's span, GPU-busy time and largest kernels
(profile_decode.print_steps, CUDA only); last, the same for two mixed steps (prompt chunks beside
those decodes).

Run on the GPU machine:
    python benchmarks/gpu/profile_throughput.py [--model llama-3.1-8b] [--out DIR]
Runs on the CPU too with a small config (to check the script): --device cpu --model DIR --num-prompts 16 ...
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import time
from dataclasses import dataclass

import torch
from profile_decode import print_steps  # this script's neighbour (the script's folder is on sys.path)

from pressroom import LLM, SamplingParams
from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.sampling_params import RequestOutputKind


@dataclass(slots=True)
class StepRecord:
    seconds: float
    prefill_tokens: int  # tokens of requests not yet at their last token (prompt chunks)
    decode_rows: int  # requests with one query token
    verify_tokens: int  # query tokens of requests with drafts


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def recorded_schedules(engine):
    """Yields a list that collects each step's SchedulerOutput, in order, while the block runs."""
    seen, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        seen.append(out)
        return out

    engine.scheduler.schedule = recording
    try:
        yield seen
    finally:
        engine.scheduler.schedule = schedule


def timeline(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[list[StepRecord], float]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", {"prompt_token_ids": p}, params)
    seconds = []
    with recorded_schedules(engine) as schedules:
        sync(engine.config.device)
        start = last = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            now = time.perf_counter()
            seconds.append(now - last)
            last = now
        sync(engine.config.device)
    total = time.perf_counter() - start
    records = []
    for s, sched in zip(seconds, schedules):
        counts, spec = sched.num_scheduled_tokens, sched.scheduled_spec_decode_tokens
        decode = sum(1 for rid, n in counts.items() if n == 1)
        verify = sum(n for rid, n in counts.items() if rid in spec)
        records.append(StepRecord(s, sum(counts.values()) - decode - verify, decode, verify))
    return records, total


def print_timeline(records: list[StepRecord], total: float, produced: int) -> None:
    prefill = [r for r in records if r.prefill_tokens]
    decode = [r for r in records if not r.prefill_tokens]
    print(f"\n== timeline: {len(records)} steps in {total:.2f} s, {produced / total:.1f} output tok/s")
    print(f"steps with prefill: {len(prefill)}, {sum(r.seconds for r in prefill):.2f} s, "
          f"{sum(r.prefill_tokens for r in prefill)} prompt tokens "
          f"({sum(r.prefill_tokens for r in prefill) / max(1e-9, sum(r.seconds for r in prefill)):.0f} tok/s, "
          f"decode rows riding along: {sum(r.decode_rows for r in prefill)})")
    print(f"pure decode steps: {len(decode)}, {sum(r.seconds for r in decode):.2f} s")
    buckets = collections.defaultdict(list)
    for r in decode:
        buckets[1 << max(0, (r.decode_rows - 1).bit_length())].append(r)
    print(f"{'rows <=':>8}{'steps':>8}{'seconds':>10}{'ms/step':>10}{'tok/s':>10}")
    for size in sorted(buckets):
        rs = buckets[size]
        secs = sum(r.seconds for r in rs)
        print(f"{size:>8}{len(rs):>8}{secs:>10.2f}{1e3 * secs / len(rs):>10.2f}"
              f"{sum(r.decode_rows for r in rs) / secs:>10.0f}")


def profiled_steps(engine, steps: int, what: str, rows: int):
    """Runs `steps` engine steps under torch.profiler; prints the time per step and the top operators."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.config.device == "cuda"
    sync(engine.config.device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.config.device)
    print(f"\n== {steps} {what}: {(time.perf_counter() - start) / steps * 1e3:.2f} ms per step (profiled)")
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    return prof


def profile_decode(llm: LLM, prompts: list[list[int]], out: str) -> None:
    """Prefills the prompts, decodes until they are all decoding, then traces a few decode steps."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, params)
    with recorded_schedules(engine) as schedules:
        while len(schedules) < 8 or any(n > 1 for n in schedules[-1].num_scheduled_tokens.values()):
            engine.step()
    prof = profiled_steps(engine, 8, f"decode steps of {len(prompts)} requests at contexts of "
                                     f"~{len(prompts[0]) + 8} tokens", rows=15)
    prof.export_chrome_trace(f"{out}/decode_real_context.json")
    if engine.config.device == "cuda":
        print_steps(f"{out}/decode_real_context.json", engine.hf_config.num_hidden_layers)
    # A step as the throughput run's first phase has them: prompt chunks filling the token budget
    # beside the running decodes.
    for i, p in enumerate(prompts[:64]):
        engine.add_request(f"m{i}", {"prompt_token_ids": p}, params)
    engine.step()  # schedules the new prompts; the profiled steps below are mixed too
    prof = profiled_steps(engine, 2, f"mixed steps (prompt chunks beside {len(prompts)} decodes)", rows=25)
    if engine.config.device == "cuda":  # span against busy: how long the GPU waited inside each step
        prof.export_chrome_trace(f"{out}/mixed_steps.json")
        print_steps(f"{out}/mixed_steps.json", engine.hf_config.num_hidden_layers)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=shape_arg, default="llama-3.1-8b", help=shape_help("the model, dummy weights"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=".")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--profile-batch", type=int, default=512, help="requests decoding in the profiled steps")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None, help="instead of the memory profile")
    args = p.parse_args()
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False,
              device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_gib=args.kv_cache_memory_gib)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.hf_config.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(0, vocab, (n, args.input_len), generator=gen).tolist()

    timeline(llm, prompts(min(64, args.num_prompts)), 8)  # compiles the mixed steps' kernels
    stats = torch.cuda.memory_stats() if args.device == "cuda" else {}
    records, total = timeline(llm, prompts(args.num_prompts), args.output_len)
    print_timeline(records, total, args.num_prompts * args.output_len)
    if stats:  # a retry frees the allocator's cache (a device-wide sync) to fit an allocation
        after = torch.cuda.memory_stats()
        print("during the timeline: " + ", ".join(f"{k} {after.get(k, 0) - stats.get(k, 0)}" for k in
                                                  ("num_alloc_retries", "num_device_alloc", "num_device_free")))
    profile_decode(llm, prompts(args.profile_batch), args.out)


if __name__ == "__main__":
    main()
