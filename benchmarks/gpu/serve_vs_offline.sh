#!/usr/bin/env bash
# HTTP against offline on the GPU (issue 13): the same N requests (IN random tokens in, OUT out, EOS
# ignored) through `bench throughput` (offline LLM, engine in-process) and through `pressroom serve`
# (engine core in its own process) driven by `bench serve` at concurrency C = max_num_seqs.
# Llama-3.1-8B shape, dummy weights; the tokenizer is any small one (.whl/tok: the embedded SmolLM2's,
# saved as tokenizer.json), needed only to make the random prompts. Results go to $1 (default results/).
set -uo pipefail
out=${1:-results}
mkdir -p "$out"
source "$(dirname "$0")/setup.sh"
MODEL=pressroom/benchmarks/configs/llama-3.1-8b TOK=${TOKENIZER:-.whl/tok}
N=${NUM_PROMPTS:-1024} IN=${INPUT_LEN:-256} OUT=${OUTPUT_LEN:-256} C=${CONCURRENCY:-256}
COMMON=(--load-format dummy --tokenizer "$TOK" --max-num-seqs "$C" --gpu-memory-utilization 0.85)
CLI=(python3 -m pressroom.entrypoints.cli --log-level WARNING)
"${CLI[@]}" bench throughput --model "$MODEL" "${COMMON[@]}" --num-prompts "$N" --input-len "$IN" \
  --output-len "$OUT" --ignore-eos --output-json "$out/gpu_offline_c$C.json" 2>&1 | tail -4
"${CLI[@]}" serve "$MODEL" "${COMMON[@]}" --port 8123 > "$out/gpu_serve.log" 2>&1 &
server=$!
until curl -sf localhost:8123/health > /dev/null; do
  sleep 0.5
  kill -0 $server 2> /dev/null || { tail -20 "$out/gpu_serve.log"; exit 1; }
done
touch "$out/.serving"  # kernels Triton compiles from here on stalled the served run
"${CLI[@]}" bench serve --base-url http://127.0.0.1:8123 --random-input-len "$IN" --random-output-len "$OUT" \
  --ignore-eos --num-prompts "$N" --max-concurrency "$C" --seed 7 --output-json "$out/gpu_serve_c$C.json" 2>&1 | tail -12
echo "Triton kernels compiled while serving: $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.json' \
  ! -name '__grp__*' -newer "$out/.serving" 2> /dev/null | wc -l)"
kill $server
wait $server 2> /dev/null
