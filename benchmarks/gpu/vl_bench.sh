#!/usr/bin/env bash
# Issue 47's GPU figures and test in one H200 call of under 500 s: tests/gpu/test_vl_gpu.py (tiny Qwen2.5-VL against
# HF on CUDA: encoder graphs on, chunked prefill splitting image runs, eager), then bench gpu's image workload at the
# Qwen2.5-VL-7B shape on dummy bf16 weights: 128 requests of one 1024x1024 image + 128 text tokens in / 128 out on
# pressroom, HF transformers' batched generate (batches of 16 and 32, 32 requests) on the same weights, and the vision
# tower's ms per image with and without its CUDA graph. Each step under its own timeout, so one hang leaves the other.
# Carry [".whl", ".whl-hf"] (benchmarks/gpu/wheels.sh builds them; .whl/ holds Pillow for the image processor).
# Usage: bash benchmarks/gpu/vl_bench.sh OUT_DIR [test|bench|all]
set -uo pipefail
out=${1:?usage: vl_bench.sh OUT_DIR [test|bench|all]}
part=${2:-all}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site-hf .whl-hf/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site-hf${PYTHONPATH:+:$PYTHONPATH}
source benchmarks/gpu/setup.sh > /dev/null
step() { local seconds=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$seconds" "$@" > "$out/$name.log" 2>&1;
         echo "rc $?"; grep -E "passed|failed|^E |tok/s|encoder ms|pressroom_over_hf|Error" "$out/$name.log" | tail -12; }
if [[ $part == test || $part == all ]]; then
  step 180 vl_test python3 -m pytest -q tests/gpu/test_vl_gpu.py --tb=short
fi
if [[ $part == bench || $part == all ]]; then
  step 300 vl_bench python3 -m pressroom.entrypoints.cli bench gpu --model qwen2.5-vl-7b --workloads image \
    --image-size 1024 --num-prompts 128 --input-len 128 --output-len 128 --warmup-requests 4 --max-num-seqs 128 \
    --hf-batch-sizes 16,32 --hf-max-requests 32 --gpu-memory-utilization 0.85 --output-json "$out/vl_bench.json"
fi
