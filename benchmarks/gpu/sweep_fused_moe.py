"""Sweep the fused-MoE kernel's launch configurations for one model's MoE shape on this GPU and write the
fastest per token count to pressroom/kernels/triton/moe_configs/, the table fused_moe.choose_launch reads.

Each candidate times the whole fused_moe call replayed from a CUDA graph, as the engine's decode steps run it, on
uniform random routing: the grouped path (alignment, both grouped GEMMs, the top-k sum) and, up to GEMV_TOKENS
tokens, the token-major GEMVs (two launches), so each token count's table entry says which path wins there. A model
with shared experts (DeepSeek, Qwen2-MoE) is swept with them folded in, as the engine runs it on CUDA; its table's
name carries the count (_S<n>). Run on the GPU machine:
    python benchmarks/gpu/sweep_fused_moe.py qwen3-30b-a3b [--max-tokens 16384] [--dtype bfloat16]
    python benchmarks/gpu/sweep_fused_moe.py deepseek-v2-lite
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.kernels.triton.fused_moe import (
    GEMV_MAX_TOKENS,
    MoeLaunch,
    SharedExperts,
    default_launch,
    fused_moe,
    gemv_launch,
    sweep_path,
)
from pressroom.model.layers.fused_moe import with_shared

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GEMV_TOKENS = 16  # the GEMVs are candidates up to here (they re-read an expert's weights for each of its pairs)
SHARED_MEMORY_BUDGET = 200 * 1024  # bytes a launch's pipelined tiles may take (the H200 has 227 KiB per block)


def moe_shape(config_dir: Path) -> dict[str, int]:
    """The routed experts' shape and the shared experts folded beside them (FusedMoE.shared_experts_of's count:
    DeepSeek's n_shared_experts, Qwen2-MoE's shared expert in routed experts' widths; 0 where none fold)."""
    c = json.loads((config_dir / "config.json").read_text())
    experts = c.get("num_local_experts") or c.get("n_routed_experts") or c["num_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    width = (c.get("n_shared_experts") or 0) * inter or c.get("shared_expert_intermediate_size") or 0
    return {"experts": experts, "inter": inter, "hidden": c["hidden_size"], "top_k": c["num_experts_per_tok"],
            "shared": width // inter if width % inter == 0 else 0}


def gemv_candidates(tokens: int) -> list[MoeLaunch]:
    """The token-major GEMVs' column blocks, input tiles, warps and tiles in flight (1: no pipelining)."""
    if tokens > GEMV_TOKENS:
        return []
    return [MoeLaunch(1, n, k, w, s, gemv=True)
            for n, k, w, s in itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8), (1, 2))]


def candidates(tokens: int, top_k: int, experts: int, itemsize: int) -> list[MoeLaunch]:
    """The GEMVs' (gemv_candidates), then the grouped GEMMs': rows per block no larger than twice the pairs an
    expert gets on average (16 always); the tiles' pipelined copies within the shared-memory budget."""
    per_expert = tokens * top_k / experts
    space = {16: ((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)),
             32: ((64, 128), (64, 128), (4, 8), (3, 4)),
             64: ((64, 128, 256), (64, 128), (4, 8), (3, 4)),
             128: ((64, 128, 256), (64, 128), (4, 8), (3, 4))}
    out = gemv_candidates(tokens)
    for block_m, (ns, ks, warps, stages) in space.items():
        if block_m > 16 and block_m > 2 * per_expert:
            continue
        for n, k, w, s in itertools.product(ns, ks, warps, stages):
            if s * (block_m * k + 2 * k * n) * itemsize <= SHARED_MEMORY_BUDGET:
                out.append(MoeLaunch(block_m, n, k, w, s))
    return out


def time_launch(args: tuple, launch: MoeLaunch) -> float | None:
    """Microseconds per call replayed from a CUDA graph; None where the launch does not fit the GPU."""
    *args, shared = args
    try:
        fused_moe(*args, launch=launch, all_local=True, shared=shared)  # compile outside the graph
        return do_bench_cudagraph(lambda: fused_moe(*args, launch=launch, all_local=True, shared=shared),
                                  rep=20) * 1e3
    except (triton.runtime.errors.OutOfResources, RuntimeError) as e:
        print(f"  skip {launch}: {type(e).__name__}")
        return None


def routed_inputs(tokens: int, shape: dict[str, int], w13: torch.Tensor, w2: torch.Tensor,
                  shared: SharedExperts | None) -> tuple:
    """(x, w13, w2, weights, ids, shared): uniform random top-k, the shared experts (if any) appended."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, shape["hidden"], device="cuda", generator=gen).to(w13.dtype)
    logits = torch.randn(tokens, shape["experts"], device="cuda", generator=gen)
    top = torch.softmax(logits, dim=-1).topk(shape["top_k"], dim=-1)
    weights = top.values / top.values.sum(dim=-1, keepdim=True)
    weights, ids = with_shared(weights, top.indices, shape["experts"], shape["shared"])
    return x, w13, w2, weights, ids, shared


def fallback_launch(tokens: int, shape: dict[str, int]) -> MoeLaunch:
    """What fused_moe.choose_launch runs without a table."""
    if tokens <= GEMV_MAX_TOKENS:
        return gemv_launch()
    return default_launch(tokens, shape["top_k"] + shape["shared"], shape["experts"] + shape["shared"])


def table_so_far(path: Path, shape: dict[str, int]) -> tuple[dict, dict, dict]:
    """(best, best_us, default_us) an earlier sweep of this shape wrote to `path`, else empty: a sweep of some token
    counts (--max-tokens 64: the decode buckets) keeps the others' entries."""
    earlier = json.loads(path.read_text()) if path.exists() else {}
    if {**earlier.get("shape", {}), "shared": earlier.get("shape", {}).get("shared", 0)} != shape:
        return {}, {}, {}
    return earlier["best"], earlier["best_us"], earlier["default_us"]


def sweep(shape: dict[str, int], dtype: torch.dtype, token_counts: list[int],
          save: Callable[[dict], None], earlier: tuple[dict, dict, dict] = ({}, {}, {})) -> None:
    e, i, h, count = shape["experts"], shape["inter"], shape["hidden"], shape["shared"]
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * 0.02).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda") * 0.02).to(dtype)
    shared = None
    if count:
        shared = SharedExperts((torch.randn(2 * count * i, h, device="cuda") * 0.02).to(dtype),
                               (torch.randn(h, count * i, device="cuda") * 0.02).to(dtype), count)
    best, best_us, default_us = (dict(d) for d in earlier)
    for tokens in token_counts:
        args = routed_inputs(tokens, shape, w13, w2, shared)
        start = time.perf_counter()
        timed = {c: time_launch(args, c) for c in candidates(tokens, shape["top_k"] + count, e + count,
                                                             dtype.itemsize)}
        timed = {c: t for c, t in timed.items() if t is not None}
        winner = min(timed, key=timed.get)
        fallback = fallback_launch(tokens, shape)
        base = timed.get(fallback) or time_launch(args, fallback)
        best[str(tokens)], best_us[str(tokens)] = asdict(winner), round(timed[winner], 2)
        default_us[str(tokens)] = round(base, 2)
        print(f"tokens {tokens:>6}: best {timed[winner]:9.1f} us {winner}; default {base:9.1f} us; "
              f"{len(timed)} launches in {time.perf_counter() - start:.0f} s", flush=True)
        save({"best": best, "best_us": best_us, "default_us": default_us})  # a cut-short sweep keeps what it has


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=shape_arg, help=shape_help("the MoE model"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=TOKENS[-1], help="sweep token counts up to this")
    p.add_argument("--output-dir", type=Path, default=None, help="also copy the table here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    args.config = Path(args.config)
    shape = moe_shape(args.config)
    gpu = torch.cuda.get_device_name()
    path = sweep_path(shape["experts"], shape["inter"], shape["hidden"], shape["top_k"], dtype, gpu, shape["shared"])
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"model": args.config.name, "shape": shape, "dtype": args.dtype, "gpu": gpu,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "timing": "do_bench_cudagraph(rep=20 ms) of fused_moe: alignment + both GEMMs + top-k sum, or the two "
                        "GEMVs (gemv: true); shared experts folded in; uniform random routing"}

    def save(result: dict) -> None:
        text = json.dumps({**header, **result}, indent=1) + "\n"
        path.write_text(text)
        if args.output_dir:
            (args.output_dir / path.name).write_text(text)

    sweep(shape, dtype, [t for t in TOKENS if t <= args.max_tokens], save, table_so_far(path, shape))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
