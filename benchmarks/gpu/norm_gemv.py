"""The fused decode GEMVs (pressroom/kernels/triton/gemv.py) against the unfused kernels they replace, at
Llama-3.1-8B's shapes and 1 to 8 tokens: qkv with the RMSNorm and residual add (6144 x 4096), o (4096 x 4096),
gate_up with the RMSNorm and residual add (28672 x 4096), down with SwiGLU (4096 x 14336). One token takes the
one-token kernel, 2 to gemv.MAX_ROWS tokens the rows kernel (each weight tile loaded once for every row): both timed
here whatever gemv.GEMV_MAX_TOKENS says, the figures that decide it. Past MAX_ROWS only the baselines are timed.

Each variant is timed over CUDA-graph replays of many calls (as gemv_rates.py), cycling over enough copies of the
weight that no call finds its weight in L2 (50 MB), and reported as weight bytes / time in TB/s, beside the
device's copy rate (read + write bytes / time of a 1 GiB copy, measured here). Variants: `unfused` (the RMSNorm
kernel + F.linear, SwiGLU kernel + F.linear, F.linear: today's layer), `cublas` (F.linear alone: the GEMM without
what comes before it), and the fused kernels at each launch of gemv.sweep_launches(tokens) (the JSON records each
as run, with its fp32 accumulators a thread), each checked against the unfused result first (each row's error
relative to its largest output).
The baselines and the default launch (gemv.default_launch) of every shape and token count come first, then the
other launches round-robin over the cases until --budget-s (mostly Triton compiles, about a second each), so a
short budget still covers every case. Prints each case's launches, the best per shape and token count, and each
token count's layer (the four projections' sum) fused against unfused; writes JSON: per (shape, tokens) every
variant and the best launch with its us and TB/s of weight reads.

Run on the GPU machine: python benchmarks/gpu/norm_gemv.py [--out norm_gemv.json] [--tokens 1,2,4,8]
[--budget-s 150] (about the budget plus 20 s on an H100).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

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


class Weights:
    """One shape's weight copies (shared by its token counts) and how many calls a graph makes."""

    def __init__(self, name: str) -> None:
        n, k, _ = SHAPES[name]
        self.bytes = n * k * 2
        copies = max(2, math.ceil(L2_CLEAR_BYTES / self.bytes))
        self.copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.calls = max(copies, round(GRAPH_SECONDS * 4e12 / self.bytes))

    def __call__(self, i: int) -> torch.Tensor:
        return self.copies[i % len(self.copies)]


class Case:
    """One shape at one token count: inputs, and the variants as callables of the call index."""

    def __init__(self, name: str, tokens: int, weights: Weights) -> None:
        n, k, self.prologue = SHAPES[name]
        self.name, self.tokens, self.n, self.k, self.w = name, tokens, n, k, weights
        width = 2 * k if self.prologue == "silu" else k
        self.x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        self.residual = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        self.norm_weight = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        self.row = {"shape": name, "n": n, "k": k, "tokens": tokens, "variants": [], "skipped_launches": 0}
        self.want: torch.Tensor | None = None
        self.pending = gemv.sweep_launches(tokens) if tokens <= gemv.MAX_ROWS else []

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
        seconds = graph_seconds(fn, self.w.calls)
        return seconds * 1e6, self.w.bytes / seconds / 1e12

    def time_baselines(self) -> None:
        for label, fn in (("unfused", self.unfused), ("cublas", self.cublas)):
            us, tbs = self.rate(fn)
            self.row["variants"].append({"variant": label, "us": round(us, 2), "tb_s": round(tbs, 3)})
        self.want = self.reference()  # after the unfused runs, which move x and the residual in place

    def time_launch(self, launch: gemv.GemvLaunch) -> None:
        """One fused launch: checked against the unfused result (each row's error relative to its row's largest
        output), then timed unless wrong."""
        self.pending.remove(launch)
        fn = self.fused(launch)
        entry = {"variant": "fused", "launch": launch_dict(launch, self.tokens)}
        try:
            got = fn(0).float()
        except OutOfResources as e:  # more registers or shared memory than an SM has: a launch the GPU refuses
            self.row["variants"].append(entry | {"refused": str(e)})
            return
        error = ((got - self.want).abs().amax(1) / self.want.abs().amax(1)).max().item()
        entry["rel_error"] = error
        if error > 2 ** -7:
            entry["wrong"] = True
        else:
            us, tbs = self.rate(fn)
            entry.update(us=round(us, 2), tb_s=round(tbs, 3))
        self.row["variants"].append(entry)


def sweep(cases: list[Case], deadline: float) -> None:
    """Baselines and the default launch of every case, then the rest round-robin until the deadline."""
    for case in cases:
        case.time_baselines()
        default = gemv.default_launch(case.n, case.k, case.tokens)
        if default in case.pending:
            case.time_launch(default)
    while any(case.pending for case in cases) and time.monotonic() < deadline:
        for case in cases:
            if case.pending and time.monotonic() < deadline:
                case.time_launch(case.pending[0])
    for case in cases:
        case.row["skipped_launches"] = len(case.pending)


def launch_dict(launch: gemv.GemvLaunch, tokens: int) -> dict:
    """The launch's fields and the fp32 accumulators a thread (gemv.ACC_PER_THREAD bounds the defaults')."""
    fields = {f: getattr(launch, f) for f in ("block_n", "block_k", "num_warps", "num_stages")}
    return fields | {"acc_per_thread": gemv.acc_per_thread(launch, tokens)}


def variant(row: dict, name: str) -> dict:
    return next(v for v in row["variants"] if v["variant"] == name)


def report(row: dict, copy_tbs: float) -> None:
    """Prints the case and puts its best fused launch (if any was timed) in row["best"]."""
    unfused, cublas = variant(row, "unfused"), variant(row, "cublas")
    fused = [v for v in row["variants"] if v["variant"] == "fused" and "tb_s" in v]
    head = (f"{row['shape']:>7} M={row['tokens']}: unfused {unfused['us']:7.1f} us {unfused['tb_s']:.2f} TB/s; "
            f"cuBLAS alone {cublas['us']:7.1f} us {cublas['tb_s']:.2f} TB/s")
    if not fused:
        print(head + "; no fused launch timed")
    else:
        best = min(fused, key=lambda v: v["us"])
        row["best"] = {"launch": best["launch"], "us": best["us"], "tb_s": best["tb_s"],
                       "of_copy": round(best["tb_s"] / copy_tbs, 3), "x_unfused": round(unfused["us"] / best["us"], 3)}
        default = launch_dict(gemv.default_launch(row["n"], row["k"], row["tokens"]), row["tokens"])
        at_default = next((v for v in fused if v["launch"] == default), None)
        print(f"{head}; best fused {best['us']:7.1f} us {best['tb_s']:.2f} TB/s ({best['tb_s'] / copy_tbs:.0%} of "
              f"copy, {unfused['us'] / best['us']:.2f}x unfused) at {best['launch']}; the default "
              + (f"{at_default['us']:.1f} us" if at_default else "not timed"))
        for v in sorted(fused, key=lambda v: v["us"]):
            print(f"          {v['us']:7.1f} us {v['tb_s']:.2f} TB/s  {v['launch']}")
    for v in row["variants"]:
        if v.get("wrong"):
            print(f"          WRONG (relative error {v['rel_error']:.2e}) at {v['launch']}")
        if "refused" in v:
            print(f"          refused ({v['refused']}) at {v['launch']}")


def layers(rows: list[dict]) -> list[dict]:
    """Each token count's layer, the four projections' sum, at the best fused launches against unfused: the
    figure that says whether steps of that many tokens should take the fused path (gemv.GEMV_MAX_TOKENS)."""
    out = []
    for tokens in sorted({r["tokens"] for r in rows}):
        case_rows = [r for r in rows if r["tokens"] == tokens]
        if len(case_rows) != len(SHAPES) or not all("best" in r for r in case_rows):
            continue
        unfused = sum(variant(r, "unfused")["us"] for r in case_rows)
        fused = sum(r["best"]["us"] for r in case_rows)
        wins = [r["shape"] for r in case_rows if r["best"]["us"] < variant(r, "unfused")["us"]]
        out.append({"tokens": tokens, "unfused_us": round(unfused, 2), "fused_us": round(fused, 2),
                    "x_unfused": round(unfused / fused, 3), "fused_wins": wins})
        print(f"layer M={tokens}: unfused {unfused:6.1f} us, fused {fused:6.1f} us ({unfused / fused:.2f}x); fused "
              f"faster at {', '.join(wins) or 'none'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="norm_gemv.json")
    parser.add_argument("--tokens", default="1,2,4,8", help="token counts, comma-separated; past gemv.MAX_ROWS "
                        "only the unfused kernels and cuBLAS are timed")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping launches after this long")
    args = parser.parse_args()
    start = time.monotonic()
    copy_tbs = copy_rate() / 1e12
    device = torch.cuda.get_device_name()
    print(f"{device}: device copy {copy_tbs:.2f} TB/s (read + write)")
    token_counts = [int(t) for t in args.tokens.split(",")]
    weights = {name: Weights(name) for name in SHAPES}
    cases = [Case(name, tokens, weights[name]) for tokens in token_counts for name in SHAPES]
    sweep(cases, start + args.budget_s)
    rows = [case.row for case in cases]
    for row in rows:
        report(row, copy_tbs)
    layer_rows = layers(rows)
    skipped = sum(r["skipped_launches"] for r in rows)
    if skipped:
        print(f"budget of {args.budget_s:.0f} s spent: {skipped} launches not timed (raise --budget-s)")
    with open(args.out, "w") as f:
        json.dump({"device": device, "copy_tb_s": copy_tbs, "seconds": time.monotonic() - start,
                   "gemv_max_tokens": gemv.GEMV_MAX_TOKENS, "layers": layer_rows, "rows": rows}, f, indent=1)
    print(f"wrote {args.out} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
