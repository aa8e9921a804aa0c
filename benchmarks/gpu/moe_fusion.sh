#!/usr/bin/env bash
# Issue 44 item 1 on the GPU machine (dummy weights), in one go: the folded-MoE tests, the launch sweeps with the
# GEMVs and folded shared experts as candidates (tables written to pressroom/kernels/triton/moe_configs/: commit
# them), batch-1 decode of Qwen3-30B-A3B and DeepSeek-V2-Lite with `bench gpu`, and a batch-1 profile of each (kernels
# per step). Results go to $1.
set -uo pipefail
out=${1:-results}
mkdir -p "$out"
source "$(dirname "$0")/setup.sh"

timeout 900 python3 -m pytest -q -s tests/gpu/test_moe_fusion_gpu.py 2>&1 | tee "$out/test_moe_fusion_gpu.txt" | tail -15
timeout 900 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "moe or deepseek" tests/gpu/test_fp8_moe_gpu.py \
  tests/gpu/test_fp4_gpu.py tests/gpu/test_gpt_oss_gpu.py tests/gpu/test_triton_kernels_gpu.py 2>&1 | tail -15
# bf16 tables: the committed ones re-swept at the decode buckets (their other entries kept), DeepSeek-V2-Lite's (none
# yet, folded shared experts: _S2) at every token count
for model in qwen3-30b-a3b mixtral-8x7b; do
  timeout 900 python3 benchmarks/gpu/sweep_fused_moe.py "$model" --max-tokens 64 --output-dir "$out" 2>&1 | tail -10
done
timeout 1800 python3 benchmarks/gpu/sweep_fused_moe.py deepseek-v2-lite --output-dir "$out" 2>&1 | tail -20
timeout 1800 python3 -c "from pressroom.kernels.triton.fused_moe_fp8 import sweep; print(sweep(256, 2048, 7168, 8, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)))" 2>&1 | tail -12
for model in qwen3-30b-a3b deepseek-v2-lite; do
  timeout 400 python3 -m pressroom.entrypoints.cli --log-level INFO bench gpu --model "$model" --workloads decode \
    --output-json "$out/bench_gpu_decode_$model.json" 2>&1 | grep -v "^INFO" | tail -12
  timeout 600 python3 benchmarks/gpu/profile_decode.py "$model" "$out/profile_$model" b1 2>&1 | tail -40
done
