#!/usr/bin/env bash
# What earlier sessions owe the GPU (issues 43-49, 2026-12-07), in one H200 call of under 600 s, each step under its
# own timeout so one hang does not take the rest: the GPU tests of code written without a GPU (weight offload after
# its two fixes, sleep mode, DSpark over Llama/DeepSeek targets), then the figures (Kimi-Linear's 4k/128k decode
# after split-KV's cap went 16 -> 64, DeepSeek-V4 against HF, 16 LoRA adapters against the base, decode with 8 GiB
# of weights offloaded). Needs more than an H100's memory for Kimi-Linear-48B: run with needs_h200.
# Carry [".whl", ".whl-hf"] (benchmarks/gpu/wheels.sh builds them).
# Usage: bash benchmarks/gpu/owed.sh OUT_DIR [tests|figures|all]
set -uo pipefail
out=${1:?usage: owed.sh OUT_DIR [tests|figures|all]}
part=${2:-all}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site-hf .whl-hf/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site-hf${PYTHONPATH:+:$PYTHONPATH}
source benchmarks/gpu/setup.sh > /dev/null
step() { local seconds=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$seconds" "$@" > "$out/$name.log" 2>&1;
         echo "rc $?"; grep -E "passed|failed|^E |decode step|tok/s|error" "$out/$name.log" | tail -8; }
cli() { python3 -m pressroom.entrypoints.cli "$@"; }
if [[ $part == tests || $part == all ]]; then
  step 70 offload python3 -m pytest -q tests/gpu/test_weight_offload_gpu.py --tb=short
  step 110 sleep_dspark python3 -m pytest -q tests/gpu/test_sleep_mode_gpu.py tests/gpu/test_dspark_gpu.py --tb=short
fi
if [[ $part == figures || $part == all ]]; then
  step 150 kimi bash benchmarks/gpu/recurrent_bench.sh "$out/rb" kimi-linear-48b-a3b 4096,131072
  step 140 v4_hf bash benchmarks/gpu/v4_bench.sh "$out/v4h" hf
  # random-token prompts: the tokenizer is never read, one entry serves
  python3 -c "from tokenizers import Tokenizer; from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast as F
F(tokenizer_object=Tokenizer(WordLevel({'<unk>': 0}, unk_token='<unk>')), unk_token='<unk>').save_pretrained('/tmp/tok')"
  shape=(--model pressroom/benchmarks/configs/llama-3.1-8b --load-format dummy --tokenizer /tmp/tok --skip-tokenizer-init
         --ignore-eos)
  step 120 lora_throughput cli bench throughput "${shape[@]}" --backend pressroom,pressroom-lora --num-loras 16 \
    --lora-rank 16 --num-prompts 512 --input-len 256 --output-len 128
  step 60 offload_latency cli bench latency "${shape[@]}" --backend pressroom --cpu-offload-gb 8 --batch-size 1 \
    --input-len 32 --output-len 128 --num-iters 3
fi
rm -f "$out"/*/gpu.txt "$out"/rb/context.log
