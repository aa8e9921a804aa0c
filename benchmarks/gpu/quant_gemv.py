"""The weight-only FP8 and MXFP4 Triton GEMV/GEMM against bf16 F.linear (cuBLAS) and FP8 torch._scaled_mm at
Llama-3.1-8B's projection shapes, timed over CUDA-graph replays (gemv_rates.py's timer); at one token it also
sweeps the kernels' tile configurations and prints the best beside the default. Per-token FP8 quantization:
the Triton kernel against the plain-torch one.
Run on the GPU machine: python benchmarks/gpu/quant_gemv.py [OUT.json] [--no-fp8-sweep] [--no-fp4-sweep] [--no-sweep]
"""
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gemv_rates import graph_seconds  # noqa: E402

from pressroom.kernels import fp8, mxfp4, nvfp4  # noqa: E402
from pressroom.kernels.triton import quant_gemv  # noqa: E402
from pressroom.kernels.triton.quant_gemv import GemvConfig  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DECODE_SWEEP = [GemvConfig(1, n, k, w) for n, k, w in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8))]
FP4_DECODE_SWEEP = [GemvConfig(1, n, k, w, st) for n, k, w, st in
                    itertools.product((2, 4, 8, 16), (1024, 2048, 4096), (4, 8), (2, 3))]
SKINNY_SWEEP = [GemvConfig(16, n, k, 4, 3) for n, k in itertools.product((16, 32, 64), (128, 256))]


def us(fn, rows: int) -> float:
    return graph_seconds(lambda i: fn(), 50 if rows <= 64 else 5) * 1e6


def best(fn_of_config, configs, rows: int) -> tuple[float, GemvConfig | None]:
    found = (float("inf"), None)
    for config in configs:
        try:
            found = min(found, (us(lambda c=config: fn_of_config(c), rows), config), key=lambda t: t[0])
        except Exception as e:  # a configuration Triton cannot build (registers, shared memory): skip it
            print(f"  skipped {config}: {type(e).__name__}", flush=True)
    return found


def _fields(config: GemvConfig | None) -> list[int] | None:
    return config and [config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages]


def shape_figures(name: str, n: int, k: int, rows: int) -> dict:
    w = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w_bf16 = w.to(torch.bfloat16)
    w_q, w_scale = fp8.quantize(w, k)
    packed, scales = mxfp4.quantize(w)
    nv = nvfp4.quantize(w)
    del w
    row = {"shape": name, "out": n, "in": k, "tokens": rows,
           "bf16_us": us(lambda: F.linear(x, w_bf16), rows),
           "fp8_scaled_mm_us": us(lambda: fp8.scaled_mm(x, w_q, w_scale), rows),
           "fp8_gemv_us": us(lambda: quant_gemv.fp8_linear(x, w_q, w_scale, k), rows),
           "mxfp4_gemv_us": us(lambda: quant_gemv.mxfp4_linear(x, packed, scales), rows),
           "nvfp4_gemv_us": us(lambda: quant_gemv.nvfp4_linear(x, *nv), rows)}
    sweep = [] if "--no-sweep" in sys.argv else DECODE_SWEEP if rows == 1 else SKINNY_SWEEP if rows <= 16 else []
    if sweep and "--no-fp8-sweep" not in sys.argv:
        t, c = best(lambda c: quant_gemv.fp8_linear(x, w_q, w_scale, k, config=c), sweep, rows)
        row["fp8_best_us"], row["fp8_best"] = t, _fields(c)
    if sweep and "--no-fp4-sweep" not in sys.argv:
        fp4_sweep = FP4_DECODE_SWEEP if rows == 1 else sweep
        t, c = best(lambda c: quant_gemv.mxfp4_linear(x, packed, scales, config=c), fp4_sweep, rows)
        row["mxfp4_best_us"], row["mxfp4_best"] = t, _fields(c)
    for key in ("fp8_scaled_mm", "fp8_gemv", "mxfp4_gemv", "nvfp4_gemv", "fp8_best", "mxfp4_best"):
        if f"{key}_us" in row:
            row[f"{key}_speedup"] = round(row["bf16_us"] / row[f"{key}_us"], 3)
    row["bf16_TBps"] = round(n * k * 2 / row["bf16_us"] / 1e6, 3)
    row["fp8_gemv_TBps"] = round(n * k / row["fp8_gemv_us"] / 1e6, 3)
    row["mxfp4_gemv_TBps"] = round(n * k * 17 / 32 / row["mxfp4_gemv_us"] / 1e6, 3)
    print(json.dumps(row), flush=True)
    return row


def activation_quantization(rows: int, k: int) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    return {"tokens": rows, "in": k, "triton_us": us(lambda: quant_gemv.quantize_per_token_fp8(x), rows),
            "torch_us": us(lambda: fp8.quantize(x, k), rows)}


def main() -> None:
    rows = [shape_figures(name, n, k, m) for m in (1, 16, 512) for name, (n, k) in SHAPES.items()]
    act = [activation_quantization(m, k) for m, k in ((1, 4096), (16, 14336), (512, 4096))]
    print(json.dumps(act), flush=True)
    for m in (1, 16, 512):
        per_step = {key: sum(r[key] for r in rows if r["tokens"] == m)
                    for key in ("bf16_us", "fp8_scaled_mm_us", "fp8_gemv_us", "mxfp4_gemv_us", "nvfp4_gemv_us")}
        print(f"M={m}: one layer's four projections " + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items())
              + f"; speed-up fp8 gemv {per_step['bf16_us'] / per_step['fp8_gemv_us']:.2f}x, mxfp4 "
              f"{per_step['bf16_us'] / per_step['mxfp4_gemv_us']:.2f}x, fp8 _scaled_mm "
              f"{per_step['bf16_us'] / per_step['fp8_scaled_mm_us']:.2f}x", flush=True)
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):
        Path(sys.argv[1]).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows,
                                                 "activation_quantization": act}, indent=2))


if __name__ == "__main__":
    main()
