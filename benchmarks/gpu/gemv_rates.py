"""How fast the GEMMs of one Llama-3.1-8B decode step run on their own: each projection's weight at
each row count, timed over CUDA-graph replays, as achieved read bandwidth (weight bytes / time) and
matmul rate. Shows how much of a step the GEMMs alone take at cuBLAS's rate.
Run on the GPU machine: python benchmarks/gpu/gemv_rates.py [ROWS,...] (default 1,2,4,8,16)
"""
import sys

import torch
import torch.nn.functional as F
from norm_gemv import graph_seconds  # this directory's: fn(i) captured `calls` times, timed over replays

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def seconds_per_call(w: torch.Tensor, rows: int) -> float:
    x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
    return graph_seconds(lambda i: F.linear(x, w), 50 if rows <= 64 else 3)


def main() -> None:
    counts = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16]
    for rows in counts:
        total = 0.0
        parts = []
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            s = seconds_per_call(w, rows)
            total += s * PER_STEP[name]
            parts.append(f"{name} {s * 1e6:.1f} us {w.numel() * 2 / s / 1e12:.2f} TB/s "
                         f"{2 * rows * w.numel() / s / 1e12:.0f} TFLOP/s")
            del w
        print(f"rows {rows}: {'; '.join(parts)}; one step's GEMMs {total * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
