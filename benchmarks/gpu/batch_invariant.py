"""`--batch-invariant`'s kernels against the default ones on the GPU: the fixed-tile Triton matmul against
F.linear (cuBLAS) at Llama-3.1-8B's projection and LM-head shapes for 1 to 8192 rows, with a small sweep of
tile configurations (the invariance holds for any one kept fixed per weight shape; kernels/triton/matmul.py's
matmul_config picks by N and K), and paged attention in the mode against the default launch (split-KV
decodes, per-step tiles). Timed over CUDA-graph replays (gemv_rates.py's timer).
Run on the GPU machine: python benchmarks/gpu/batch_invariant.py [OUT.json]
"""
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gemv_rates import graph_seconds  # noqa: E402

from pressroom.attention.triton_backend import num_kv_splits  # noqa: E402
from pressroom.kernels.triton.attention import paged_attention  # noqa: E402
from pressroom.kernels.triton.matmul import MatmulConfig, invariant_matmul, matmul_config  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
ROWS = [1, 16, 64, 256, 2048, 8192]
SWEEP = [MatmulConfig(bm, bn, 64, 8, w, 4) for bm, bn, w in itertools.product((64, 128), (64, 128, 256), (4, 8))
         ] + [MatmulConfig(64, 32, 128, 8, 4, 4), MatmulConfig(64, 64, 128, 8, 4, 3)]
SWEPT = ("o", "gate_up")  # a narrow and a wide N, each at 1 and 2048 rows


def us(fn, rows: int) -> float:
    return graph_seconds(fn, 20 if rows <= 64 else 3) * 1e6


def sweep(x: torch.Tensor, w: torch.Tensor) -> tuple[float, list[int] | None]:
    found: tuple[float, list[int] | None] = (float("inf"), None)
    for c in SWEEP:
        try:
            t = us(lambda c=c: invariant_matmul(x, w, config=c), x.shape[0])
        except Exception as e:  # a configuration Triton cannot build (shared memory, registers): skip it
            print(f"  skipped {c}: {type(e).__name__}", flush=True)
            continue
        fields = [c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages]
        found = min(found, (t, fields), key=lambda f: f[0])
    return found


def matmul_row(name: str, n: int, k: int, m: int) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    c = matmul_config(n, k)
    row = {"shape": name, "n": n, "k": k, "rows": m, "cublas_us": us(lambda: F.linear(x, w), m),
           "invariant_us": us(lambda: invariant_matmul(x, w), m),
           "config": [c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages]}
    if name in SWEPT and m in (1, 2048):
        row["best_sweep_us"], row["best_sweep_config"] = sweep(x, w)
    row["invariant_over_cublas"] = row["invariant_us"] / row["cublas_us"]
    return row


def attention_row(kind: str, reqs: int, q_len: int, ctx: int) -> dict:
    """Llama-3.1-8B's heads (32 query, 8 KV, head_dim 128) over 16-token blocks."""
    heads, kv_heads, dim, block = 32, 8, 128, 16
    blocks = reqs * -(-ctx // block)
    cache = torch.randn(2, blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(reqs, -1)
    lens = torch.full((reqs,), ctx, device="cuda", dtype=torch.int32)
    loc = torch.arange(0, reqs + 1, device="cuda", dtype=torch.int32) * q_len
    q = torch.randn(reqs * q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    splits = num_kv_splits(reqs, kv_heads, tables.shape[1]) if q_len == 1 else 1
    default = us(lambda: paged_attention(q, cache, tables, lens, loc, q_len, dim ** -0.5, out, splits), reqs)
    fixed = us(lambda: paged_attention(q, cache, tables, lens, loc, q_len, dim ** -0.5, out, batch_invariant=True),
               reqs)
    return {"kind": kind, "requests": reqs, "query_len": q_len, "context": ctx, "default_splits": splits,
            "default_us": default, "invariant_us": fixed, "invariant_over_default": fixed / default}


ATTENTION = [("decode", 1, 1, 8192), ("decode", 64, 1, 2048), ("decode", 256, 1, 1024), ("prefill", 4, 2048, 2048),
             ("chunk", 8, 512, 4096)]


def printed(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    report = {"gpu": torch.cuda.get_device_name(),
              "matmul": [printed(matmul_row(name, n, k, m)) for (name, (n, k)), m in itertools.product(
                  SHAPES.items(), ROWS)],
              "attention": [printed(attention_row(*spec)) for spec in ATTENTION]}
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
