#!/usr/bin/env bash
# Issue 43's GPU figures on one H200 (dummy weights, bf16), DeepSeek-V4-Flash at 5 of its 43 layers (68 GB):
# the decode step against context at batch 1 (4k-128k) and at batch 32 (4k and 64k: the 2x bar), and
# bench gpu's batch-1 decode and throughput beside HF transformers on the same weights.
# Usage: bash benchmarks/gpu/v4_bench.sh OUT_DIR [PART: context|batch|hf|all]
set -uo pipefail
out=${1:?usage: v4_bench.sh OUT_DIR [context|batch|hf|all]}
part=${2:-all}
mkdir -p "$out"
source benchmarks/gpu/setup.sh
cli() { python3 -m pressroom.entrypoints.cli "$@" 2>&1 | grep -vE "^(INFO|DEBUG)|^\S+ INFO" | tail -20; }
model=deepseek-v4-flash-reduced
if [[ $part == context || $part == all ]]; then
  cli bench context --models $model --contexts 4096,16384,65536,131072 --decode-steps 16 \
    --gpu-memory-utilization 0.97 --output-json "$out/v4_context.json"
fi
if [[ $part == batch || $part == all ]]; then
  cli bench context --models $model --contexts 4096,65536 --batch-sizes 32 --decode-steps 16 \
    --gpu-memory-utilization 0.97 --output-json "$out/v4_context_batch32.json"
fi
if [[ $part == hf || $part == all ]]; then
  cli bench gpu --model $model --workloads decode,throughput --num-prompts 128 --input-len 256 --output-len 128 \
    --hf-batch-sizes 16,64 --hf-max-requests 64 --output-json "$out/v4_bench_gpu.json"
fi
