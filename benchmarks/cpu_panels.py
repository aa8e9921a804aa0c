"""The byte-panel products (kernels/csrc/vnni_gemm.c) against what they replace, in one process, interleaved: each
4-bit panel at the embedded SmolLM2's projection shapes against oneDNN's prepacked GEMM on the same weights (bf16
where the CPU multiplies bf16, else fp32), and the Q8_0 LM head's panel against its row kernel. Milliseconds per
call, the mean of 20 interleaved calls after 3 warm-up ones. Usage: python benchmarks/cpu_panels.py [TOKENS ...]
(default 16 32 64 128 512); docs/BENCHMARKS.md, "the batch path on byte panels"."""
from __future__ import annotations

import sys
import time

import torch

from pressroom.kernels import cpu
from pressroom.model.layers.quant import NibbleMatrix, Q4Weight, Q8Blocks, Q8Weight, q8_panels
from pressroom.platforms.cpu import cpu_info

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # rows x cols
LM_HEAD = (49152, 576)
CALLS, WARMUP = 20, 3


def interleaved(fns: list) -> list[float]:
    """Mean milliseconds per call of each function, calls taking turns."""
    for fn in fns:
        for _ in range(WARMUP):
            fn()
    totals = [0.0] * len(fns)
    for _ in range(CALLS):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            totals[i] += time.perf_counter() - start
    return [t / CALLS * 1e3 for t in totals]


def projections(tokens: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    cells = []
    for name, (rows, cols) in SHAPES.items():
        blocks = cols // 32
        q4 = Q4Weight(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
                      torch.rand(rows, blocks, generator=gen) * 0.01, torch.rand(rows, blocks, generator=gen) * -0.08)
        panel = NibbleMatrix.pack(q4).panel
        dense = torch.ops.mkldnn._reorder_linear_weight(q4.dequantize().to(dtype), tokens)
        x = torch.randn(tokens, cols, generator=gen)
        xd = x.to(dtype)
        ours, onednn = interleaved([
            lambda p=panel, x=x: p.matmul(x),
            lambda w=dense, x=xd: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")])
        cells.append(f"{name} {ours:.3f} vs {onednn:.3f} ms ({onednn / ours:.2f}x)")
    print(f"{tokens} tokens, panel vs oneDNN {str(dtype).removeprefix('torch.')}: " + "; ".join(cells))


def lm_head(tokens: int, gen: torch.Generator) -> None:
    rows, cols = LM_HEAD
    q8 = Q8Weight(torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8),
                  (torch.rand(rows, cols // 32, generator=gen) * 0.01).half().float())
    head = Q8Blocks.pack(q8)
    x = torch.randn(tokens, cols, generator=gen)
    ours, rows_kernel = interleaved([lambda: head.panel.matmul(x),
                                     lambda: cpu.ggml_q8_0_blocks_matmul(x, head.blocks)])
    print(f"{tokens} tokens, LM head {rows} x {cols}: panel {ours:.2f} vs row kernel {rows_kernel:.2f} ms "
          f"({rows_kernel / ours:.2f}x)")


def main() -> None:
    if not cpu.panel_products()[0]:
        sys.exit("no panel products here (the C kernels did not build)")
    tokens = [int(a) for a in sys.argv[1:]] or [16, 32, 64, 128, 512]
    dtype = torch.bfloat16 if cpu_info().isa.name in ("AVX512_BF16", "AMX") else torch.float32
    gen = torch.Generator().manual_seed(0)
    for n in tokens:
        projections(n, dtype, gen)
        if q8_panels() and n <= 128:
            lm_head(n, gen)


if __name__ == "__main__":
    main()
