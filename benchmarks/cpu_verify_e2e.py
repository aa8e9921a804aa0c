"""Batch-1 speculation against plain decoding on the CPU (the embedded SmolLM2, held-out chat prompts, greedy,
OUTPUT tokens each, one prompt at a time): the two engines take turns ROUNDS times in one process, so a busy
machine slows both alike (bench latency runs one backend, then the other). Prints output tok/s per engine and
round, and the speculative engine's acceptance.
Two builds of the C kernels do not share a process well here: each library starts its own workshare pool, and
one pool's threads slowed the other build's steps up to 10x (measured), so compare builds across processes.
Usage: python benchmarks/cpu_verify_e2e.py [--prompts N] [--output-len N] [--rounds N] [--spec JSON]"""
from __future__ import annotations

import argparse
import json
import os
import time

from pressroom import LLM, SamplingParams
from pressroom.benchmarks.workload import file_prompts
from pressroom.model.loader import load_tokenizer, resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default='{"method": "dflash2", "num_speculative_tokens": 8}')
    args = ap.parse_args()
    prompts = file_prompts("benchmarks/data/chat_heldout.jsonl", load_tokenizer(resolve_model_path(None)),
                           args.prompts, 0, True)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {"plain": LLM(), "spec": LLM(speculative_config=json.loads(args.spec))}
    rates: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(args.rounds):
        for kind, llm in engines.items():
            start = time.perf_counter()
            for p in prompts:
                llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            rates[kind].append(round(len(prompts) * args.output_len / (time.perf_counter() - start), 1))
            print(f"{kind}: {rates[kind][-1]} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    s = engines["spec"].engine.stats().spec
    length = 1 + s.num_accepted_tokens / max(s.num_drafts, 1)
    print(f"spec: {s.num_drafts} drafts verified, acceptance length {length:.2f}")
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
