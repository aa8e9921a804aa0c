#!/usr/bin/env bash
# Issue 42's GPU figures (dummy weights, bf16): `bench context` for a linear-attention model beside a full-attention
# one of similar active size (default Kimi-Linear-48B-A3B, 98 GB, so an H200, beside Qwen3-30B-A3B): the batch-1
# decode step at 4k-128k of context against the copy-bandwidth bound of the bytes it reads, and the engine's own
# start-up lines on its cache (KV + state bytes per token, the capacity multiplier).
# Qwen3-30B-A3B's checkpoint stops at 40,960 positions (Qwen documents YaRN x4 for 131,072): its limit is raised by
# --hf-overrides so its step is timed at 128k too (rope frequencies do not change a step's work).
# Usage: bash benchmarks/gpu/recurrent_bench.sh OUT_DIR [MODELS] [CONTEXTS]
set -uo pipefail
out=${1:?usage: recurrent_bench.sh OUT_DIR [MODELS] [CONTEXTS]}
models=${2:-kimi-linear-48b-a3b,qwen3-30b-a3b}
contexts=${3:-4096,16384,65536,131072}
mkdir -p "$out"
source benchmarks/gpu/setup.sh
python3 -m pressroom.entrypoints.cli --log-level INFO bench context --models "$models" --contexts "$contexts" \
  --hf-overrides '{"qwen3-30b-a3b": {"max_position_embeddings": 131200}}' --output-json "$out/context.json" 2>&1 | tee "$out/context.log" | grep -vE "^(INFO|DEBUG)|^\S+ INFO" | tail -30
grep -hE "recurrent state|KV cache|capacity|CUDA graph" "$out/context.log" | tee "$out/cache_lines.txt"
