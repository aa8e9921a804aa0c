"""The host's time per engine step at many requests: a tiny random Llama on the CPU, so the model costs
little and the scheduler, input preparation and output bookkeeping dominate. Steady decode of N requests,
mean ms per step, with Python's cyclic GC at the engine's thresholds or at Python's defaults (700, 10, 10).

    python benchmarks/host_overhead.py [--requests 1000] [--gc engine|python|off]
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
import transformers

from pressroom import LLM, SamplingParams
from pressroom.sampling_params import RequestOutputKind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gc", choices=["engine", "python", "off"], default="engine")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as model:
        transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256,
                                 max_position_embeddings=512).save_pretrained(model)
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False, device="cpu",
                  max_num_seqs=args.requests, kv_cache_memory_gib=2, max_model_len=512)
    if args.gc == "python":
        gc.set_threshold(700, 10, 10)
    elif args.gc == "off":
        gc.disable()
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        engine.add_request(str(i), {"prompt_token_ids": torch.randint(0, 256, (64,), generator=gen).tolist()}, params)
    for _ in range(10):  # prefill, then decodes at full batch
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    seconds = (time.perf_counter() - start) / args.steps
    print(f"{args.requests} requests, gc {args.gc} {gc.get_threshold()}: {seconds * 1e3:.1f} ms per step")


if __name__ == "__main__":
    main()
