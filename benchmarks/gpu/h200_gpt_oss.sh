#!/bin/bash
# gpt-oss on the GPU machine: its GPU tests (attention with sinks and a window, experts with biases and the clamped
# SwiGLU at gpt-oss-20b's shapes; tiny dense and MXFP4 models on CUDA, graphs and eager, against the CPU) and the FP4
# expert tests, then gpt-oss-20b's shapes with dummy weights: batch-1 decode in bf16 (beside HF transformers' eager
# gpt-oss on the same weights) and with MXFP4 experts. Usage: bash benchmarks/gpu/h200_gpt_oss.sh OUT
out=${1:?output directory}
source benchmarks/gpu/setup.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
for t in tests/gpu/test_gpt_oss_gpu.py tests/gpu/test_fp4_gpu.py; do
  timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 200 "$t" 2>&1 | tee -a "$out/gpu_tests.log" | tail -4
done
timeout 300 python3 -m pressroom.entrypoints.cli bench gpu --model gpt-oss-20b --workloads decode \
  --output-json "$out/gpt_oss_20b_bf16.json" 2>&1 | tee "$out/gpt_oss_20b_bf16.log" | grep -E "decode|Error" | tail -4
timeout 200 python3 -m pressroom.entrypoints.cli bench gpu --model gpt-oss-20b --workloads decode --skip-hf \
  --quantization mxfp4 --output-json "$out/gpt_oss_20b_mxfp4.json" 2>&1 | tee "$out/gpt_oss_20b_mxfp4.log" \
  | grep -E "decode|Error" | tail -4
