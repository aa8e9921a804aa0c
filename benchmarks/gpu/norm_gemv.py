"""The fused decode GEMVs (pressroom/kernels/triton/gemv.py) against the unfused kernels they replace, at
Llama-3.1-8B's shapes and one token: qkv with the RMSNorm and residual add (6144 x 4096), o (4096 x 4096),
gate_up with the RMSNorm and residual add (28672 x 4096), down with SwiGLU (4096 x 14336). Token counts past
gemv.GEMV_MAX_TOKENS (--tokens 1,2,4,8) time only the unfused kernels and cuBLAS, the baseline a multi-token
variant must beat.

Each variant is timed over CUDA-graph replays of many calls (as gemv_rates.py), cycling over enough copies of the
weight that no call finds its weight in L2 (50 MB), and reported as weight bytes / time in TB/s, beside the
device's copy rate (read + write bytes / time of a 1 GiB copy, measured here). Variants: `unfused` (the RMSNorm
kernel + F.linear, SwiGLU kernel + F.linear, F.linear: today's layer), `cublas` (F.linear alone: the GEMM without
what comes before it), and the fused kernels at each launch of gemv.sweep_launches, each checked against the
unfused result before it is timed. Prints the best launch per shape and token count (and the default's,
gemv.DEFAULT_LAUNCHES) and writes JSON.

Run on the GPU machine: python benchmarks/gpu/norm_gemv.py [--out norm_gemv.json] [--tokens 1]
(under a minute on an H100, mostly Triton compiles; it stops sweeping at --budget-s and says so).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from pressroom.kernels.triton import gemv, norm
from pressroom.kernels.triton.activation import silu_and_mul

SHAPES = {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "none"), "gate_up": (28672, 4096, "norm"),
          "down": (4096, 14336, "silu")}
EPS = 1e-5
L2_CLEAR_BYTES = 256 << 20  # the weight copies a graph cycles through: several L2s' worth
GRAPH_SECONDS = 1.5e-3  # calls per graph: about this long at 4 TB/s


def graph_seconds(fn, calls: int, replays: int = 5) -> float:
    """Seconds per call of fn(i), captured for i in range(calls) in one CUDA graph, over `replays` replays."""
    for i in range(min(calls, 4)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def copy_rate() -> float:
    """Device copy, read + write bytes per second (DESIGN.md's ceiling)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / graph_seconds(lambda i: dst.copy_(src), 4)


class Case:
    """One shape at one token count: weight copies, inputs, and the variants as callables of the call index."""

    def __init__(self, name: str, tokens: int) -> None:
        n, k, self.prologue = SHAPES[name]
        self.name, self.tokens, self.n, self.k = name, tokens, n, k
        self.weight_bytes = n * k * 2
        copies = max(2, math.ceil(L2_CLEAR_BYTES / self.weight_bytes))
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.calls = max(copies, round(GRAPH_SECONDS * 4e12 / self.weight_bytes))
        width = 2 * k if self.prologue == "silu" else k
        self.x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        self.residual = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        self.norm_weight = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)

    def w(self, i: int) -> torch.Tensor:
        return self.weights[i % len(self.weights)]

    def unfused(self, i: int) -> torch.Tensor:
        if self.prologue == "norm":  # in place, as the layer's: x normalised, residual += x
            x, _ = norm.fused_add_rms_norm(self.x, self.residual, self.norm_weight, EPS)
            return F.linear(x, self.w(i))
        if self.prologue == "silu":
            return F.linear(silu_and_mul(self.x), self.w(i))
        return F.linear(self.x, self.w(i))

    def cublas(self, i: int) -> torch.Tensor:
        return F.linear(self.x[:, :self.k], self.w(i))

    def fused(self, launch: gemv.GemvLaunch):
        def call(i: int) -> torch.Tensor:
            if self.prologue == "norm":
                return gemv.norm_gemv(self.x, self.norm_weight, EPS, self.w(i), self.residual, launch=launch)[0]
            if self.prologue == "silu":
                return gemv.silu_mul_gemv(self.x, self.w(i), launch=launch)
            return gemv.gemv(self.x, self.w(i), launch=launch)
        return call

    def reference(self) -> torch.Tensor:
        """The unfused result on fresh copies of the inputs, in fp32 over the rounded activation."""
        if self.prologue == "norm":
            a, _ = norm.fused_add_rms_norm(self.x.clone(), self.residual.clone(), self.norm_weight, EPS)
        elif self.prologue == "silu":
            a = silu_and_mul(self.x)
        else:
            a = self.x
        return F.linear(a.float(), self.w(0).float())

    def rate(self, fn) -> tuple[float, float]:
        seconds = graph_seconds(fn, self.calls)
        return seconds * 1e6, self.weight_bytes / seconds / 1e12


def run_case(case: Case, deadline: float) -> dict:
    row = {"shape": case.name, "n": case.n, "k": case.k, "tokens": case.tokens, "variants": []}
    for label, fn in (("unfused", case.unfused), ("cublas", case.cublas)):
        us, tbs = case.rate(fn)
        row["variants"].append({"variant": label, "us": round(us, 2), "tb_s": round(tbs, 3)})
    want = case.reference()
    skipped = 0
    for launch in gemv.sweep_launches() if case.tokens <= gemv.GEMV_MAX_TOKENS else []:
        if time.monotonic() > deadline:
            skipped += 1
            continue
        fn = case.fused(launch)
        got = fn(0).float()
        error = ((got - want).abs().max() / want.abs().max()).item()
        entry = {"variant": "fused", "launch": launch_dict(launch), "rel_error": error}
        if error > 2 ** -7:
            entry["wrong"] = True
        else:
            us, tbs = case.rate(fn)
            entry.update(us=round(us, 2), tb_s=round(tbs, 3))
        row["variants"].append(entry)
    row["skipped_launches"] = skipped
    return row


def launch_dict(launch: gemv.GemvLaunch) -> dict:
    return {f: getattr(launch, f) for f in ("block_n", "block_k", "num_warps", "num_stages")}


def report(row: dict, copy_tbs: float) -> None:
    unfused = next(v for v in row["variants"] if v["variant"] == "unfused")
    cublas = next(v for v in row["variants"] if v["variant"] == "cublas")
    fused = [v for v in row["variants"] if v["variant"] == "fused" and "tb_s" in v]
    wrong = [v for v in row["variants"] if v.get("wrong")]
    head = (f"{row['shape']:>7} M={row['tokens']}: unfused {unfused['us']:7.1f} us {unfused['tb_s']:.2f} TB/s; "
            f"cuBLAS alone {cublas['us']:7.1f} us {cublas['tb_s']:.2f} TB/s")
    if not fused:
        print(head + ("; no fused launch timed" if row["tokens"] <= gemv.GEMV_MAX_TOKENS else ""))
        return
    best = max(fused, key=lambda v: v["tb_s"])
    row["best"] = best
    default = launch_dict(gemv.default_launch(row["n"], row["k"]))
    at_default = next((v for v in fused if v["launch"] == default), None)
    print(f"{head}; best fused {best['us']:7.1f} us {best['tb_s']:.2f} TB/s ({best['tb_s'] / copy_tbs:.0%} of copy, "
          f"{unfused['us'] / best['us']:.2f}x unfused) at {best['launch']}; the default "
          + (f"{at_default['us']:.1f} us" if at_default else "not timed"))
    for v in sorted(fused, key=lambda v: -v["tb_s"]):
        print(f"          {v['us']:7.1f} us {v['tb_s']:.2f} TB/s  {v['launch']}")
    for v in wrong:
        print(f"          WRONG (relative error {v['rel_error']:.2e}) at {v['launch']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="norm_gemv.json")
    parser.add_argument("--tokens", default="1", help="token counts, comma-separated; past gemv.GEMV_MAX_TOKENS "
                        "only the unfused kernels and cuBLAS are timed")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping launches after this long")
    args = parser.parse_args()
    start = time.monotonic()
    deadline = start + args.budget_s
    copy_tbs = copy_rate() / 1e12
    device = torch.cuda.get_device_name()
    print(f"{device}: device copy {copy_tbs:.2f} TB/s (read + write)")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name in SHAPES:
            case = Case(name, tokens)
            row = run_case(case, deadline)
            report(row, copy_tbs)
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    skipped = sum(r["skipped_launches"] for r in rows)
    if skipped:
        print(f"budget of {args.budget_s:.0f} s spent: {skipped} launches not timed (raise --budget-s)")
    with open(args.out, "w") as f:
        json.dump({"device": device, "copy_tb_s": copy_tbs, "seconds": time.monotonic() - start, "rows": rows}, f,
                  indent=1)
    print(f"wrote {args.out} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
