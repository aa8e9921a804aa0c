#!/usr/bin/env bash
# Issue 42's GPU figures (dummy weights, bf16): `bench context` for a linear-attention model beside a full-attention
# one of similar active size (default Kimi-Linear-48B-A3B, 98 GB, so an H200, beside Qwen3-30B-A3B): the batch-1
# decode step at 4k-128k of context against the copy-bandwidth bound of the bytes it reads, and the engine's own
# start-up lines on its cache (KV + state bytes per token, the capacity multiplier).
# GRAPHS=force: decode replays from CUDA graphs for the recurrent families in this process even where the model
# class does not claim them yet (its GPU parity test with graphs must have passed on the same machine first).
# Usage: bash benchmarks/gpu/recurrent_bench.sh OUT_DIR [MODELS] [CONTEXTS]
set -uo pipefail
out=${1:?usage: recurrent_bench.sh OUT_DIR [MODELS] [CONTEXTS]}
models=${2:-kimi-linear-48b-a3b,qwen3-30b-a3b}
contexts=${3:-4096,16384,65536,131072}
mkdir -p "$out"
source benchmarks/gpu/setup.sh
python3 - "$out" "$models" "$contexts" <<'PY' 2>&1 | tee "$out/context.log" | grep -vE "^(INFO|DEBUG)|^\S+ INFO" | tail -30
import os
import sys

out, models, contexts = sys.argv[1:4]
if os.environ.get("GRAPHS") == "force":
    from pressroom.model.models import falcon_h1, kimi_linear, mamba, nemotron_h, qwen3_next
    for cls in (kimi_linear.KimiLinearForCausalLM, qwen3_next.Qwen3NextForCausalLM, mamba.MambaForCausalLM,
                mamba.Mamba2ForCausalLM, nemotron_h.NemotronHForCausalLM, falcon_h1.FalconH1ForCausalLM):
        cls.cuda_graphs_supported = True
from pressroom.entrypoints.cli import main

sys.exit(main(["--log-level", "INFO", "bench", "context", "--models", models, "--contexts", contexts,
               "--output-json", f"{out}/context.json"]))
PY
grep -hE "recurrent state|KV cache|capacity|CUDA graph" "$out/context.log" | tee "$out/cache_lines.txt"
