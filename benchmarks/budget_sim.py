"""Replays the adaptive speculative budget alone, on step costs profiled on the H200, with synthetic acceptance.

No model runs: each step the budget plans drafts for `concurrency` requests (a closed loop: a request
that has emitted --output-len tokens is replaced), drafts are accepted position by position with the
given conditional rates, and the budget observes the outcome. Prints what it learned against the true
rates and the drafts it planned per request, so its estimator can be checked without a GPU.

    python benchmarks/budget_sim.py docs/results/gpu_bench_spec_llama8b.json --concurrency 1,4,16,64,256
"""
from __future__ import annotations

import argparse
import json
import random
import time

from pressroom.core.spec_budget import AdaptiveBudget

RATES = [0.85, 0.75, 0.65, 0.55, 0.45, 0.35, 0.25]


def load_budget(report: dict) -> AdaptiveBudget:
    curves = report["engines"]["adaptive"]["adaptive_budget"]

    def curve(name: str) -> list[tuple[int, float]] | None:
        return [tuple(p) for p in curves[name]] if curves.get(name) else None

    return AdaptiveBudget(len(curves["learned_acceptance"]), curve("verify_costs"), curve("decode_costs"),
                          curves["attention_cost_per_context_token"], curve("draft_costs"), curve("first_draft_costs"))


def simulate(budget: AdaptiveBudget, concurrency: int, steps: int, output_len: int, context: int,
             seed: int) -> tuple[list[float], float]:
    """Drafts planned per request at each step, and the host's mean seconds per `plan` call."""
    rng = random.Random(seed)
    emitted = {f"r{i}": rng.randrange(output_len) for i in range(concurrency)}
    fresh = iter(range(1 << 30))
    depths, planning = [], 0.0
    for _ in range(steps):
        budget.tick()
        start = time.perf_counter()
        plan = budget.plan(dict.fromkeys(emitted, budget.k), base_tokens=concurrency,
                           contexts=dict.fromkeys(emitted, context), base_context=context * concurrency)
        planning += time.perf_counter() - start
        for rid, k in plan.items():
            accepted = 0
            while accepted < k and rng.random() < RATES[min(accepted, len(RATES) - 1)]:
                accepted += 1
            if k:
                budget.observe(rid, k, accepted)
            emitted[rid] += 1 + accepted
            if emitted[rid] >= output_len:
                budget.forget(rid)
                del emitted[rid]
                emitted[f"n{next(fresh)}"] = 0
        depths.append(sum(plan.values()) / concurrency)
    return depths, planning / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report", help="a `pressroom bench spec` JSON with the adaptive engine's profiled curves")
    p.add_argument("--concurrency", default="1,4,16,64,256")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--context", type=int, default=190, help="context tokens per request (the bench's middle)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    print(f"true rates {RATES[:3]}")
    for c in (int(n) for n in args.concurrency.split(",")):
        budget = load_budget(report)
        depths, planning = simulate(budget, c, args.steps, args.output_len, args.context, args.seed)
        late = depths[len(depths) // 2:]
        print(f"concurrency {c:>3}: learned {[round(r, 3) for r in budget.shared.rates[:3]]}, "
              f"drafts per request (second half) {sum(late) / len(late):.2f}, {1e3 * planning:.2f} ms per plan")


if __name__ == "__main__":
    main()
