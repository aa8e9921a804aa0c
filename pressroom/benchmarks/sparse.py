"""`pressroom bench sparse-attention`: DeepSeek Sparse Attention (DSA) against dense MLA, the decode attention of
one layer timed at growing context lengths, dummy weights at a real config's shapes.

For each context length, a batch of decodes whose caches hold that many tokens (random latents and indexer
keys; no prefill is run, so 128k contexts cost nothing to set up) goes through one attention layer: DSA (the
lightning indexer over every past token, the top-k, sparse MLA over the k chosen) and dense MLA (the same
projections, MLA over the whole context), each replayed from a CUDA graph as the engine's decode steps are.
A step's attention time is the layer's time times the model's layers; the rest of a decode step (the
experts, the LM head) does not depend on the context. On the CPU it runs a tiny config, to check the plumbing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.benchmarks.gpu import mean_seconds, positive_ints, resolve_device
from pressroom.benchmarks.shapes import shape_arg, shape_help
from pressroom.benchmarks.workload import machine, report_from_args

DEFAULT_MODEL = "deepseek-v2-lite-dsa"  # a shape shipped in the package (pressroom/benchmarks/configs/)
BLOCK_SIZE = 16
NOTE = ("one attention layer's decode (projections, cache write, attention; DSA: the indexer's scores over the "
        "whole context, the top-k and sparse MLA over the chosen tokens), mean of CUDA-graph replays; per step = "
        "per layer x num_hidden_layers; cache contents random, weights N(0, 0.02)")


def load_config(model: Path):
    import transformers
    return transformers.AutoConfig.from_pretrained(model)


def build_layers(config, device: torch.device, dtype: torch.dtype, seed: int):
    """The config's DSA layer and a dense MLA layer with the same projections' shapes, dummy weights."""
    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.attention.triton_backend import TritonAttentionBackend
    from pressroom.model.models.deepseek import MLAAttention, SparseMLAAttention
    from pressroom.model.models.llama import rotary_from_config
    torch.manual_seed(seed)
    layers = {"dense": MLAAttention(config), "dsa": SparseMLAAttention(config)}
    backend = TritonAttentionBackend() if device.type == "cuda" else TorchAttentionBackend()
    for layer in layers.values():
        for name, param in layer.named_parameters():
            if "norm" in name:  # RMSNorm and the indexer's LayerNorm: unit weights, zero bias
                param.data.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.data.normal_(0.0, 0.02)
        layer.to(device=device, dtype=dtype)
        layer.attn.backend = backend
    rotary = rotary_from_config(config, config.qk_rope_head_dim).to(device)
    return layers, rotary


def decode_metadata(batch: int, context: int, device: torch.device, splits: int) -> AttentionMetadata:
    """`batch` decodes, each over `context` tokens (its new one last) in its own scattered blocks."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    order = torch.randperm(batch * blocks_per_req, generator=torch.Generator().manual_seed(0))
    tables = order.view(batch, blocks_per_req).to(torch.int32 if device.type == "cuda" else torch.int64)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    lens = torch.full((batch,), context, dtype=tables.dtype)
    return AttentionMetadata(num_decodes=batch, num_decode_tokens=batch, slot_mapping=slots.to(device),
                             block_tables=tables.to(device), seq_lens=lens.to(device),
                             query_start_loc=list(range(batch + 1)), seq_lens_host=[context] * batch,
                             query_start_loc_device=torch.arange(batch + 1, dtype=torch.int32, device=device),
                             max_query_len=1, num_kv_splits=splits)


def time_layer(layer, rotary, meta: AttentionMetadata, hidden: int, context: int, device: torch.device,
               dtype: torch.dtype) -> float:
    from pressroom.model.models.llama import RopeTables
    batch = meta.num_decodes
    num_blocks = batch * (-(-context // BLOCK_SIZE))
    layer.attn.kv_cache = torch.randn(layer.attn.cache_shape(num_blocks, BLOCK_SIZE), device=device).to(dtype)
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    rope = RopeTables(rotary, *rotary.cos_sin(torch.full((batch,), context - 1, device=device)))

    def step():
        with forward_context(meta):
            return layer(rope, x)

    run = step
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    seconds = mean_seconds(run, device)
    layer.attn.kv_cache = None
    return seconds


def run(args) -> dict:
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = load_config(Path(args.model))
    layers, rotary = build_layers(config, device, dtype, args.seed)
    splits = 1
    if device.type == "cuda":
        from pressroom.attention.triton_backend import TritonMetadataBuilder
        splits_for = TritonMetadataBuilder(device, 1, 1 << 20)
    rows = []
    with torch.inference_mode():
        for context in args.contexts:
            if device.type == "cuda":
                splits_for.max_blocks_per_seq = -(-context // BLOCK_SIZE)
                splits = splits_for.num_kv_splits(args.batch_size)
            meta = decode_metadata(args.batch_size, context, device, splits)
            row = {"context": context}
            for name, layer in layers.items():
                row[f"{name}_layer_us"] = 1e6 * time_layer(layer, rotary, meta, config.hidden_size, context, device,
                                                           dtype)
                row[f"{name}_step_ms"] = row[f"{name}_layer_us"] * config.num_hidden_layers / 1e3
            rows.append(row)
            print(f"context {context:>7}: dense MLA {row['dense_layer_us']:8.1f} us/layer, "
                  f"DSA {row['dsa_layer_us']:8.1f} us/layer", flush=True)
    return {"model": str(args.model), "device": device_name(device), "machine": machine(), "dtype": str(dtype),
            "batch_size": args.batch_size, "index_topk": config.index_topk, "layers": config.num_hidden_layers,
            "note": NOTE, "rows": rows, "dsa_growth": growth(rows, "dsa"), "dense_growth": growth(rows, "dense")}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def growth(rows: list[dict], name: str) -> dict[str, float]:
    """Each context's layer time over the shortest context's."""
    base = rows[0][f"{name}_layer_us"]
    return {str(r["context"]): r[f"{name}_layer_us"] / base for r in rows}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report["rows"]
    contexts = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, label in (("dense", "dense MLA"), ("dsa", f"DSA (index_topk {report['index_topk']})")):
        ax.plot(contexts, [r[f"{name}_step_ms"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"attention per decode step, ms ({report['layers']} layers)")
    ax.set_title(f"{Path(report['model']).name}, batch {report['batch_size']}, {report['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    report = report_from_args(args, run, plot)
    print(json.dumps({"dsa_growth": report["dsa_growth"], "dense_growth": report["dense_growth"]}))
    return 0


def add_sparse_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=shape_arg, default=DEFAULT_MODEL, help=shape_help("a DeepSeek-V3.2 config"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda, or cpu to test the plumbing with a tiny config")
    parser.add_argument("--contexts", type=positive_ints, default=[4096, 16384, 65536, 131072],
                        help="comma-separated context lengths")
    parser.add_argument("--batch-size", type=int, default=1, help="decodes per step")
    parser.add_argument("--seed", type=int, default=0, help="seeds the dummy weights")
    parser.add_argument("--output-json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="write a PNG of step time against context (needs matplotlib)")
    parser.add_argument("--from-json", default=None, help="plot a saved report instead of running")
