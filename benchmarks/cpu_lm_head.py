"""Milliseconds per call of the Q8_0 LM head kernel (GGUF blocks, the embedded model's 49,152 x 576 head) for a
number of tokens, the threads torch has: `python benchmarks/cpu_lm_head.py [TOKENS,...]`. Random codes, scale 1."""
from __future__ import annotations

import sys
import time

import torch

from pressroom.kernels import cpu

ROWS, COLS = 49152, 576


def main() -> None:
    counts = [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,9,16,64").split(",")]
    blocks = torch.randint(0, 255, (ROWS, COLS // 32 * 34), dtype=torch.uint8)
    view = blocks.view(ROWS, COLS // 32, 34)
    view[:, :, 0], view[:, :, 1] = 0x00, 0x3C  # each block's fp16 scale: 1.0
    for tokens in counts:
        x = torch.randn(tokens, COLS)
        for _ in range(3):
            cpu.ggml_q8_0_blocks_matmul(x, blocks)
        reps = 20
        start = time.perf_counter()
        for _ in range(reps):
            cpu.ggml_q8_0_blocks_matmul(x, blocks)
        print(f"{tokens:>4} tokens: {(time.perf_counter() - start) / reps * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
