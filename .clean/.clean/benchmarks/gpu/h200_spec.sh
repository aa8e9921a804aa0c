#!/usr/bin/env bash
# Issue 5's adaptive-budget benchmark on the GPU machine: `pressroom bench spec` (Llama-3.1-8B target,
# Llama-3.2-1B draft model, dummy weights, bf16, synthetic acceptance 0.85, 0.75, ..., 0.25) at concurrency
# 1, 4, 16, 64, 256: no speculation (async and sync scheduling), fixed K = 1..7, adaptive K <= 7.
# About 4 minutes on one H200 (add --no-sync-baseline to skip the synchronous baseline). Results go to $1 (default results/); extra arguments go to the bench.
# Packages the device image lacks travel as wheels in .whl/ (see docs/BENCHMARKS.md, GPU section).
set -uo pipefail
out=${1:-results}
shift || true
mkdir -p "$out"
source "$(dirname "$0")/setup.sh"
# 580 s: one device command may run 600 s. The JSON is rewritten after every configuration, so a run cut
# short keeps what it measured; the log keeps the engine's INFO lines (the budget's profiled step costs).
timeout 580 python3 -m pressroom.entrypoints.cli --log-level INFO bench spec \
  --output-json "$out/bench_spec_llama8b.json" "$@" 2>&1 | tee "$out/bench_spec.log" | grep -v "^INFO" | tail -60
