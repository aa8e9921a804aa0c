#!/usr/bin/env bash
# Everything issue 4 measures on the GPU machine, in one go: the GPU tests, `pressroom bench gpu`
# (pressroom vs HF transformers vs the card's copy and matmul ceilings, Llama-3.1-8B shape, dummy
# weights) and `pressroom serve` start-to-ready with CUDA graphs. Results go to $1 (default results/).
# Packages the device image lacks travel as wheels in .whl/ (see docs/BENCHMARKS.md, GPU section).
set -uo pipefail
out=${1:-results}
mkdir -p "$out"
source "$(dirname "$0")/setup.sh"
# One pytest process per file: the tiny-shape kernel tests stalled once when they shared a process
# with the engine tests on the GPU (2026-11-30; each file alone passes in seconds).
for t in tests/gpu/test_engine_gpu.py tests/gpu/test_triton_kernels_gpu.py tests/kernels/test_triton_kernels.py; do
  timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 60 "$t" 2>&1 | tee -a "$out/gpu_tests.log" | tail -3
done

# Time to ready: process start to the first 200 from /health, CUDA graphs captured.
start=$(date +%s%N)
python3 -m pressroom.entrypoints.cli --log-level INFO serve pressroom/benchmarks/configs/llama-3.1-8b --load-format dummy --skip-tokenizer-init --port 8123 \
  --gpu-memory-utilization 0.85 > "$out/serve.log" 2>&1 &
server=$!
until curl -sf localhost:8123/health > /dev/null; do
  sleep 0.2
  kill -0 $server 2> /dev/null || break
done
echo "serve ready after $(( ($(date +%s%N) - start) / 1000000 )) ms (wall, from launch)" | tee "$out/serve_ready.txt"
kill $server; wait $server 2> /dev/null
grep -h "ready in\|captured\|KV cache:" "$out/serve.log" | tee -a "$out/serve_ready.txt"

timeout 420 python3 -m pressroom.entrypoints.cli --log-level INFO bench gpu --output-json "$out/bench_gpu_llama8b.json" \
  2>&1 | tee "$out/bench.log" | grep -v "^INFO" | tail -30
