"""Microseconds per call of the 4-bit CPU kernel (quant_ops.c through NibbleMatrix) at the embedded SmolLM2's
projection shapes, for 1 to 9 tokens a step: best of 7 runs of 100 calls. Usage: python benchmarks/cpu_q4_kernel.py
[THREADS]. Run it once per checkout to compare two kernels (docs/BENCHMARKS.md, "4-bit kernel in 8-row tiles")."""
from __future__ import annotations

import sys
import time

import torch

from pressroom.model.layers.quant import NibbleMatrix, Q4Weight

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # qkv, gate_up, down (rows x cols)
TOKENS = (1, 2, 4, 9)


def time_call(fn, runs: int = 7, calls: int = 100) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    gen = torch.Generator().manual_seed(0)
    for rows, cols in SHAPES:
        blocks = cols // 32
        w = NibbleMatrix.pack(Q4Weight(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
                                       torch.rand(rows, blocks, generator=gen) * 0.01,
                                       torch.rand(rows, blocks, generator=gen) * -0.08))
        cells = []
        for tokens in TOKENS:
            x = torch.randn(tokens, cols, generator=gen)
            cells.append(f"{tokens} tok {time_call(lambda w=w, x=x: w.matmul(x)):.1f} us")
        print(f"{rows} x {cols}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
