#!/bin/bash
# Issue 19 item 6 on the GPU machine: --batch-invariant's must-show test (64 requests alone and in random
# batches, bf16, bitwise), its kernels against the default ones, and its cost end to end (Llama-3.1-8B
# shape, dummy weights: batch-1 decode, throughput, prefill; default and invariant engines in one run).
# Usage: bash benchmarks/gpu/h200_batch_invariant.sh OUT [tests|kernels|engine]  (no stage: all three, ~12 min;
# a device call is limited to 10 minutes, so run the stages as two calls: "tests" then "kernels engine")
out=${1:?output directory}
shift
stages=${*:-tests kernels engine}
source benchmarks/gpu/setup.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
for stage in $stages; do
  case $stage in
    tests)
      timeout 290 python3 -m pytest -q -p no:cacheprovider --timeout 280 tests/gpu/test_batch_invariant_gpu.py 2>&1 \
        | tee "$out/gpu_tests.log" | tail -8 ;;
    kernels)
      timeout 170 python3 benchmarks/gpu/batch_invariant.py "$out/kernels.json" 2>&1 | tee "$out/kernels.log" \
        | grep -v skipped | tail -40 ;;
    engine)
      timeout 280 python3 -m pressroom.entrypoints.cli bench gpu --batch-invariant \
        --workloads decode,throughput,prefill --num-prompts 128 --output-len 128 \
        --output-json "$out/engine.json" 2>&1 | tee "$out/engine.log" \
        | grep -E "^(default|batch_invariant) |^\{|Error" | tail -10 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
