"""Where a CPU decode step goes: wall time per token of the engine's step, the model runner's parts, the fused
layer stack and the LM head, over greedy 128-token generations after a 32-token prompt.
Usage: python benchmarks/cpu_step_parts.py [MODEL] [RUNS]   (MODEL: a GGUF path; default the embedded model)."""
from __future__ import annotations

import collections
import sys
import time

from pressroom import LLM, SamplingParams
from pressroom.engine import core
from pressroom.model.layers import cpu_decode, embedding
from pressroom.worker import model_runner

TOKENS = 128
spent: collections.Counter[str] = collections.Counter()


def timed(owner: type, name: str, key: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    setattr(owner, name, wrapper)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    runner = model_runner.ModelRunner
    for owner, name, key in [(core.EngineCore, "step", "engine step"), (runner, "_prepare", "prepare"),
                             (runner, "_forward", "forward"), (runner, "_emit", "emit"),
                             (cpu_decode.Gemma3DecodeStack, "run", "gemma3 stack"),
                             (cpu_decode.CpuDecodeStack, "run", "llama stack"),
                             (embedding.ParallelLMHead, "forward", "lm head")]:
        if hasattr(owner, name):
            timed(owner, name, key)
    llm = LLM(model=model) if model else LLM()
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    llm.generate([prompt], params)  # warm-up
    spent.clear()
    start = time.perf_counter()
    for _ in range(runs):
        llm.generate([prompt], params)
    per_token = 1e3 / (runs * TOKENS)
    print(f"total {(time.perf_counter() - start) * per_token:.3f} ms a token")
    for key, seconds in spent.most_common():
        print(f"  {key:14s} {seconds * per_token:.3f} ms a token")


if __name__ == "__main__":
    main()
