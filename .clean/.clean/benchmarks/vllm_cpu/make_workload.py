"""Write a peer_bench.py workload of random token-id prompts (stdlib only).

    python make_workload.py --mode throughput --num-prompts 32 --input-len 128 \\
        --output-len 128 --output .cache/vllm_cpu/throughput.json

Token ids are uniform in [--low, --high) from random.Random(--seed), so the same
arguments always give the same prompts.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["throughput", "latency"], required=True)
    ap.add_argument("--num-prompts", type=int, required=True, help="latency mode: the batch size")
    ap.add_argument("--input-len", type=int, required=True)
    ap.add_argument("--output-len", type=int, required=True)
    ap.add_argument("--low", type=int, default=1000)
    ap.add_argument("--high", type=int, default=40000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--num-iters", type=int, default=1)
    ap.add_argument("--output", type=Path, required=True)
    a = ap.parse_args()

    rng = random.Random(a.seed)
    prompts = [[rng.randrange(a.low, a.high) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    workload = {
        "mode": a.mode,
        "prompts": prompts,
        "output_len": a.output_len,
        "ignore_eos": not a.no_ignore_eos,
        "num_iters_warmup": a.num_iters_warmup,
        "num_iters": a.num_iters,
    }
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(workload) + "\n")


if __name__ == "__main__":
    main()
