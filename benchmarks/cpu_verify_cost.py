"""What a verification of 1 + K tokens of one request costs on the CPU (the embedded SmolLM2, batch 1): the
target's forward (the fused decode stack over the rows, layers/cpu_decode.py) and the LM head over the rows, ms per
call (best of REPEATS, each row count in turn, ROUNDS times), for 1, 2, 4, 8 and 9 rows after CONTEXT cached tokens.

With --old LIB (a build of the C kernels from another checkout: `python benchmarks/cpu_verify_cost.py --build-old
REV` writes one from a git revision), the two libraries take turns in one process, so a busy machine slows both
alike. Usage: python benchmarks/cpu_verify_cost.py [--context N] [--repeats N] [--rounds N] [--threads N]
[--cpu-time] [--old LIB]. Two libraries in one process each start a workshare pool; with two threads, steps that
use it (attention past the row kernel's count) can wait on the other pool's threads: --threads 1 --cpu-time avoids it.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pressroom import LLM
from pressroom.attention.backend import forward_context
from pressroom.kernels import cpu
from pressroom.worker.profiling import _profile_batch

ROWS = (1, 2, 4, 8, 9)


def build_old(rev: str, out: Path) -> None:
    """The C kernels of git revision `rev`, built with this checkout's flags."""
    with tempfile.TemporaryDirectory() as tmp:
        sources = []
        for path in [*cpu._SOURCES, *cpu._HEADERS]:
            rel = path.relative_to(Path.cwd())
            text = subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True, check=True).stdout
            (Path(tmp) / path.name).write_bytes(text)
            if path in cpu._SOURCES:
                sources.append(str(Path(tmp) / path.name))
        subprocess.run(["gcc", *cpu.compile_flags(), *sources, "-o", str(out), "-lm"], check=True)


def load(path: str) -> ctypes.CDLL:
    """A kernel library typed as kernels/cpu.py types its own."""
    lib = ctypes.CDLL(path)
    for base, argtypes in cpu._SIGNATURES.items():
        for suffix in cpu._SUFFIX.values():
            fn = getattr(lib, f"{base}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    for name, argtypes in cpu._QUANT_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    for name, argtypes in cpu._RECURRENT_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int64
    for name in cpu._COUNTS:
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int64
    return lib


def best_ms(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best * 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--old", default=None)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock (one thread: what other jobs on a shared "
                         "machine cannot inflate by preempting it)")
    ap.add_argument("--build-old", default=None, metavar="REV")
    args = ap.parse_args()
    if args.build_old:
        build_old(args.build_old, Path(f"/tmp/pressroom_ops_{args.build_old}.so"))
        print(f"/tmp/pressroom_ops_{args.build_old}.so")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_model_len=2048)
    runner, model = llm.engine.runner, llm.engine.runner.model
    new = cpu._library()
    libs = {"new": new} if args.old is None else {"old": load(args.old), "new": new}
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"threads {torch.get_num_threads()}, context {args.context}, best of {args.repeats}, "
          f"{'CPU time' if args.cpu_time else 'wall clock'}")
    print("round  lib  rows  forward_ms  lm_head_ms  step_ms")
    for rnd in range(args.rounds):
        for n in ROWS:
            ids, positions, meta = _profile_batch(runner, n, n, args.context)

            def forward(ids=ids, positions=positions, meta=meta):
                with forward_context(meta):
                    return model(ids, positions)
            for name, lib in libs.items():
                cpu._library = lambda lib=lib: lib
                hidden = forward()
                fwd = best_ms(forward, args.repeats, clock)
                head = best_ms(lambda hidden=hidden: model.compute_logits(hidden).float(), args.repeats, clock)
                step = best_ms(lambda forward=forward: model.compute_logits(forward()).float(), args.repeats, clock)
                print(f"{rnd:5d}  {name:>3}  {n:4d}  {fwd:10.2f}  {head:10.2f}  {step:7.2f}", flush=True)
    cpu._library = lambda: new
    for cache in runner.kv_caches:
        cache[:, 0].zero_()


if __name__ == "__main__":
    main()
