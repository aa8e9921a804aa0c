"""Launch configurations of the paged-attention kernel at the throughput workload's shapes (Llama-3.1-8B
heads): decode batches (KV read rate, TB/s, for a bf16 and an FP8 cache) and a prefill batch (TFLOP/s),
each timed over CUDA-graph replays with the kernel's launch config patched. Picks _launch_config's values.
Run on the GPU machine: python benchmarks/gpu/attention_sweep.py [fp8] (fp8: the FP8-cache decodes only)
"""
import itertools
import sys

import torch
import triton
from gemv_rates import graph_seconds  # this script's neighbour (the script's folder is on sys.path)

from pressroom.attention.triton_backend import num_kv_splits
from pressroom.kernels.triton import attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def batch(specs: list[tuple[int, int]], cache_dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    needed = [-(-ctx // BLOCK) for ctx, _ in specs]
    blocks = sum(needed) + 1
    tables = torch.zeros(len(specs), max(needed), dtype=torch.int32, device="cuda")
    order = torch.randperm(blocks, device="cuda", generator=gen).int()
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[used:used + n]
        used += n
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(cache_dtype)
    lens = torch.tensor([q for _, q in specs])
    loc = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).int().cuda()
    q = torch.randn(int(lens.sum()), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor([c for c, _ in specs], dtype=torch.int32, device="cuda")
    return q, cache, tables, seq, loc, int(lens.max())


def run(specs, cache_dtype, cfg, splits: int) -> float:
    q, cache, tables, seq, loc, qmax = batch(specs, cache_dtype)
    out = torch.empty_like(q)
    original = attention._launch_config
    attention._launch_config = lambda *a: cfg
    try:
        return graph_seconds(lambda: attention.paged_attention(q, cache, tables, seq, loc, qmax, HEAD_DIM ** -0.5,
                                                               out, splits), calls=20, replays=3)
    finally:
        attention._launch_config = original


def main() -> None:
    gen = torch.Generator().manual_seed(1)
    decodes = {
        "1 x 300": [(300, 1)],
        "1 x 4000": [(4000, 1)],
        "512 x 520": [(520, 1)] * 512,
        "1000 x 512-768": [(int(c), 1) for c in torch.randint(512, 769, (1000,), generator=gen)],
    }
    default = attention._launch_config(1, 4, HEAD_DIM)
    only_fp8 = sys.argv[1:] == ["fp8"]
    for name, specs in decodes.items():
        splits = num_kv_splits(len(specs), KV_HEADS, 2048 // BLOCK)
        for dtype in (torch.float8_e4m3fn,) if only_fp8 else (torch.bfloat16, torch.float8_e4m3fn):
            kv_bytes = sum(c for c, _ in specs) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
            results = []
            for tile_n, warps, stages in itertools.product((64, 128), (2, 4, 8), (2, 3)):
                cfg = attention._Launch(16, tile_n, warps, stages)
                try:
                    results.append((run(specs, dtype, cfg, splits), cfg))
                except triton.runtime.errors.OutOfResources:
                    continue
            results.sort(key=lambda r: r[0])
            now = run(specs, dtype, default, splits)
            best = "; ".join(f"tile {c.tile_n} warps {c.num_warps} stages {c.num_stages}: {s * 1e6:.1f} us "
                             f"{kv_bytes / s / 1e12:.2f} TB/s" for s, c in results[:3])
            print(f"decode {name} ({splits} splits) {str(dtype)[6:]}: default {now * 1e6:.1f} us "
                  f"{kv_bytes / now / 1e12:.2f} TB/s; best {best}", flush=True)
    if only_fp8:
        return
    prompts = [(512, 512)] * 32
    flops = 32 * 4 * HEADS * HEAD_DIM * 512 * 512 / 2  # QK and PV, causal half
    results = []
    for block_m, tile_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        cfg = attention._Launch(block_m, tile_n, warps, stages)
        try:
            results.append((run(prompts, torch.bfloat16, cfg, 1), cfg))
        except triton.runtime.errors.OutOfResources:
            continue
    results.sort(key=lambda r: r[0])
    now = run(prompts, torch.bfloat16, attention._launch_config(512, 4, HEAD_DIM), 1)
    print(f"prefill 32 x 512: default {now * 1e6:.0f} us {flops / now / 1e12:.0f} TFLOP/s; best " + "; ".join(
        f"block_m {c.block_m} tile {c.tile_n} warps {c.num_warps} stages {c.num_stages}: {s * 1e6:.0f} us "
        f"{flops / s / 1e12:.0f} TFLOP/s" for s, c in results[:4]))


if __name__ == "__main__":
    main()
