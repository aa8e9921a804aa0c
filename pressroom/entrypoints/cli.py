"""`pressroom generate | chat | bench` — every engine argument is a flag with vLLM's spelling."""
from __future__ import annotations

import time

STARTED = time.monotonic()  # before the heavy imports: `pressroom serve` reports time to ready from here

import argparse
import logging
import sys
from dataclasses import MISSING, fields

from pressroom.config import EngineArgs

_BOOL_FLAGS = {"enable_prefix_caching", "enforce_eager", "skip_tokenizer_init", "async_scheduling"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if f.name in _BOOL_FLAGS:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name == "model":
            group.add_argument(flag, default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)")
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_model_len", "num_gpu_blocks_override", "num_threads", "max_num_seqs"):
                kind = int
            if f.name == "kv_cache_memory_gib":
                kind = float
            group.add_argument(flag, type=kind, default=default)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    return {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pressroom", description="An LLM inference and serving engine.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+")
    _sampling_args(gen)
    add_engine_args(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system message")
    _sampling_args(chat)
    chat.set_defaults(max_tokens=512, temperature=0.7)
    add_engine_args(chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: the model)")
    serve.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger bodies get a 413")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds to let in-flight requests finish on SIGTERM before aborting them")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes")
    serve.add_argument("--max-concurrent-requests", type=int, default=None,
                       help="generation requests in flight beyond this get a 429 with Retry-After")
    serve.add_argument("--metrics-prefix", default="pressroom:", help="e.g. vllm: for existing vLLM dashboards")
    serve.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between stats log lines at INFO level (0: off)")
    serve.add_argument("--uvicorn-log-level", default="warning")
    serve.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none"],
                       help="split <think>...</think> into reasoning_content (auto: when the model's chat "
                            "template or vocabulary has the markers)")
    serve.add_argument("--reasoning-start-str", default="<think>", help="the reasoning span's start marker")
    serve.add_argument("--reasoning-end-str", default="</think>", help="the reasoning span's end marker")
    add_engine_args(serve)

    tr = sub.add_parser("train-drafter", help="distil a DFlash2 drafter from the target's own greedy generations")
    tr.add_argument("--dataset-path", required=True, help="prompts: JSONL ({\"prompt\": ...}) or text, one per line")
    tr.add_argument("--output", required=True, help="directory for the drafter (dflash2.json, model.safetensors)")
    tr.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    tr.add_argument("--num-prompts", type=int, default=256)
    tr.add_argument("--max-tokens", type=int, default=128, help="generated tokens per prompt")
    tr.add_argument("--held-out-path", default=None,
                    help="prompts for the acceptance report, never trained on (default: 10%% of the dataset's)")
    tr.add_argument("--ignore-eos", action="store_true", help="generate past EOS (default: stop at it, as serving)")
    tr.add_argument("--record-batch", type=int, default=32, help="prompts generated together while recording")
    tr.add_argument("--draft-block-size", type=int, default=8, help="K: tokens the drafter proposes per pass")
    tr.add_argument("--target-layers", default=None, help="comma-separated (default: three across the depth)")
    tr.add_argument("--num-layers", type=int, default=1)
    tr.add_argument("--num-heads", type=int, default=8)
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--rank", type=int, default=32, help="the selector's transition rank")
    tr.add_argument("--scorer-steps", type=int, default=None, help="CRF steps for the selector (default: steps / 4)")
    tr.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    add_engine_args(tr)

    bench = sub.add_parser("bench", help="benchmarks with vLLM's bench semantics")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in ("throughput", "latency"):
        b = bench_sub.add_parser(name)
        b.add_argument("--backend", default="pressroom", help="comma-separated: pressroom,hf,vllm (run back to back)")
        b.add_argument("--input-len", type=int, default=128 if name == "throughput" else 32)
        b.add_argument("--output-len", type=int, default=128)
        b.add_argument("--num-prompts", type=int, default=32)
        b.add_argument("--batch-size", type=int, default=1)
        b.add_argument("--dataset-path", default=None, help="JSONL ({\"prompt\": ...}) or text file, one per line")
        b.add_argument("--chat", action="store_true", help="send each dataset prompt as a user turn of the chat template")
        b.add_argument("--ignore-eos", action="store_true")
        b.add_argument("--num-iters-warmup", type=int, default=1)
        b.add_argument("--num-iters", type=int, default=3)
        b.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
        b.add_argument("--peer-dtype", default="bfloat16", choices=["float32", "bfloat16"])
        b.add_argument("--output-json", default=None)
        add_engine_args(b)
    from pressroom.benchmarks.serve import add_cli_args as add_serve_bench_args
    add_serve_bench_args(bench_sub.add_parser("serve", help="load an OpenAI-compatible server over HTTP "
                                                            "(vLLM's bench serve)"))
    from pressroom.benchmarks.gpu import add_gpu_bench_args
    add_gpu_bench_args(bench_sub.add_parser("gpu", help="pressroom vs HF transformers vs the GPU's copy and matmul "
                                                        "ceilings, dummy weights at a real model's shapes"))
    from pressroom.benchmarks.spec import add_spec_bench_args
    add_spec_bench_args(bench_sub.add_parser("spec", help="adaptive speculative budget vs no speculation vs fixed K "
                                                          "at several concurrencies (draft model, synthetic acceptance)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            from pressroom.entrypoints.chat import run_chat
            return run_chat(args, engine_kwargs(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "train-drafter":
            from pressroom.spec_decode.train import run_cli
            run_cli(args, engine_kwargs(args))
            return 0
        if args.command == "bench" and args.bench_command == "gpu":
            from pressroom.benchmarks import gpu
            gpu.run(args)
            return 0
        if args.command == "bench" and args.bench_command == "spec":
            from pressroom.benchmarks import spec
            spec.run(args)
            return 0
        if args.command == "bench" and args.bench_command == "serve":
            from pressroom.benchmarks import serve
            return 0 if serve.run(args)["completed"] else 1
        if args.command == "bench":
            from pressroom.benchmarks import bench
            args.command = args.bench_command
            bench.run(args, engine_kwargs(args))
            return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


def _params(args):
    from pressroom import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _generate(args) -> int:
    from pressroom import LLM
    llm = LLM(**engine_kwargs(args))
    for out in llm.generate(args.prompts, _params(args)):
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
    return 0


def _serve(args) -> int:
    from pressroom.entrypoints.openai.server import run_server
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"Two models given: {args.model_tag!r} and --model {args.model!r}; give one.")
    args.model = args.model_tag or args.model
    return run_server(args, engine_kwargs(args), STARTED)


if __name__ == "__main__":
    sys.exit(main())
