#!/bin/bash
# Issue 19 on the GPU machine: the weight-only GEMV micro-benchmark, batch-1 decode end to end
# (Llama-3.1-8B shape, dummy weights) in bf16, FP8, MXFP4 and NVFP4, then the quantization GPU tests. Usage: bash benchmarks/gpu/h200_quant.sh OUT
out=${1:?output directory}
source benchmarks/gpu/setup.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
timeout 300 python3 benchmarks/gpu/quant_gemv.py "$out/quant_gemv.json" 2>&1 | tee "$out/quant_gemv.log" | grep -v skipped
for q in none fp8 mxfp4 nvfp4; do
  timeout 75 python3 -m pressroom.entrypoints.cli bench gpu --workloads decode --skip-hf --quantization $q \
    --output-json "$out/decode_$q.json" 2>&1 | tee "$out/decode_$q.log" | grep -E "^pressroom decode|Error" | tail -3
done
for t in tests/gpu/test_quant_gemv_gpu.py tests/gpu/test_fp8_gpu.py; do
  timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 "$t" 2>&1 | tee -a "$out/gpu_tests.log" | tail -4
done
