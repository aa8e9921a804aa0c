#!/usr/bin/env bash
# What earlier sessions owe the GPU (issues 42-49, 2026-12-07), on one H200 in two calls (A, B) each well under the
# 600 s a call may run, each step under its own timeout so one hang does not take the rest, most valuable first.
# A: weight offload's GPU test (after its two fixes), the pinned host->device copy bandwidth and batch-1 decode with
#    8 GiB of weights offloaded (the decode against the transfer bound), DeepSeek-V4 against HF transformers, 16
#    rank-16 LoRA adapters against the base model (throughput and batch-1 decode: issue 48's 0.8x / 0.85x bars).
# B: sleep mode's and DSpark's GPU tests, Kimi-Linear-48B's 4k/128k decode after split-KV's cap went 16 -> 64.
# Needs more than an H100's memory (Kimi-Linear-48B, V4 beside HF): run with needs_h200.
# Carry [".whl", ".whl-hf"] (benchmarks/gpu/wheels.sh builds them). The tree travels under 64 MiB only without
# .whl/'s pillow (added 2026-12-07 08:04, not needed here): carry a copy without it, e.g. [".whl-owed", ".whl-hf"]
# with the command `rm -rf .whl && mv .whl-owed .whl && bash benchmarks/gpu/owed.sh $OUT A` (.whl-owed ignored in
# .git/info/exclude). Everything written ends in OUT_DIR/owed_PART.tgz
# (a device call brings back 8 files at most).
# Then serve_vs_offline.sh (the step-time bound: P99 ITL at most 4x the median), moe_fusion.sh's sweeps (commit the
# tables) and disagg_bench.sh (issue 49), each a call of its own.
# Usage: bash benchmarks/gpu/owed.sh OUT_DIR [A|B|C|D|E|F|G|H|I|J|K|L|Q|all]
set -uo pipefail
out=${1:?usage: owed.sh OUT_DIR [A|B|C|D|E|F|G|H|I|J|K|L|Q|all]}
part=${2:-all}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site-hf .whl-hf/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site-hf${PYTHONPATH:+:$PYTHONPATH}
source benchmarks/gpu/setup.sh > /dev/null
step() { local seconds=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$seconds" "$@" > "$out/$name.log" 2>&1;
         echo "rc $? ($(date -u +%T))"; grep -E "passed|failed|^E |decode step|ms per token|tok/s|GB/s|time to ready|ITL|cpu-offload-gb|error|Error" \
         "$out/$name.log" | grep -v "^INFO" | tail -10; }
cli=(python3 -m pressroom.entrypoints.cli)  # an array: timeout runs programs, not shell functions

# pinned host -> device, 1 GiB a copy: the bound of a step streaming the offloaded layers
cat > /tmp/h2d_bandwidth.py <<'EOF'
import json, sys, torch
n = 1 << 30
host = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(3):
    dev.copy_(host, non_blocking=True)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
reps = 10
start.record()
for _ in range(reps):
    dev.copy_(host, non_blocking=True)
end.record()
end.synchronize()
gbps = reps * n / (start.elapsed_time(end) / 1e3) / 1e9
report = {"bytes_per_copy": n, "copies": reps, "pinned_h2d_GB_per_s": round(gbps, 2),
          "device": torch.cuda.get_device_name(), "bound_s_per_8GiB": round(8 * n / (gbps * 1e9), 4)}
print(f"pinned h2d {gbps:.2f} GB/s; 8 GiB a step -> {report['bound_s_per_8GiB'] * 1e3:.1f} ms "
      f"({1 / report['bound_s_per_8GiB']:.2f} tok/s at batch 1)")
json.dump(report, open(sys.argv[1], "w"), indent=2)
EOF

# random-token prompts: the tokenizer is never read, one entry serves
python3 -c "from tokenizers import Tokenizer; from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast as F
F(tokenizer_object=Tokenizer(WordLevel({'<unk>': 0}, unk_token='<unk>')), unk_token='<unk>').save_pretrained('/tmp/tok')"
shape=(--model pressroom/benchmarks/configs/llama-3.1-8b --load-format dummy --tokenizer /tmp/tok --skip-tokenizer-init
       --ignore-eos)
if [[ $part == A || $part == all ]]; then
  step 80 offload_test python3 -m pytest -q tests/gpu/test_weight_offload_gpu.py --tb=short
  step 20 h2d_bandwidth python3 /tmp/h2d_bandwidth.py "$out/h2d_bandwidth.json"
  # batch 1: every step streams the offloaded layers (>= 8 GiB), so a short output suffices
  step 75 offload_latency "${cli[@]}" bench latency "${shape[@]}" --backend pressroom --cpu-offload-gb 8 --batch-size 1 \
    --input-len 32 --output-len 32 --num-iters 2 --output-json "$out/offload_latency.json"
  # v4_bench.sh's hf part at HF's batch 64 alone (its batch 16 doubled HF's time for a lower figure)
  step 165 v4_hf "${cli[@]}" bench gpu --model deepseek-v4-flash-reduced --workloads decode,throughput --num-prompts 128 \
    --input-len 256 --output-len 128 --hf-batch-sizes 64 --hf-max-requests 64 --output-json "$out/v4_bench_gpu.json"
  step 120 lora_throughput "${cli[@]}" bench throughput "${shape[@]}" --backend pressroom,pressroom-lora --num-loras 16 \
    --lora-rank 16 --num-prompts 512 --input-len 256 --output-len 128 --output-json "$out/lora_throughput.json"
  step 80 lora_latency "${cli[@]}" bench latency "${shape[@]}" --backend pressroom,pressroom-lora --num-loras 16 \
    --lora-rank 16 --batch-size 1 --input-len 32 --output-len 128 --output-json "$out/lora_latency.json"
fi
if [[ $part == L ]]; then  # LoRA again after its steps replay CUDA graphs and gather their slots (0e01141, ca32d61)
  step 90 lora_test python3 -m pytest -q tests/gpu/test_lora_gpu.py tests/kernels/test_triton_lora.py --tb=short
  step 80 lora_latency "${cli[@]}" bench latency "${shape[@]}" --backend pressroom,pressroom-lora --num-loras 16 \
    --lora-rank 16 --batch-size 1 --input-len 32 --output-len 128 --output-json "$out/lora_latency.json"
  step 120 lora_throughput "${cli[@]}" bench throughput "${shape[@]}" --backend pressroom,pressroom-lora --num-loras 16 \
    --lora-rank 16 --num-prompts 512 --input-len 256 --output-len 128 --output-json "$out/lora_throughput.json"
  # the profile's engine is V2-Lite's first (cold) start: its parts; bench gpu's then finds Triton's cache warm
  step 130 profile_v2lite python3 benchmarks/gpu/profile_decode.py deepseek-v2-lite "$out" b1
  step 90 decode_v2lite_second "${cli[@]}" bench gpu --model deepseek-v2-lite --workloads decode --skip-hf \
    --output-json "$out/bench_gpu_decode_v2lite_second.json"
fi
# C and D: what the 2026-12-07 (c) session built without a GPU (issue 44 items 1, 2, 6; issue 48's kernels; the audio
# encoder graphs), on an H100 or H200: C its GPU tests, D the regressions around them and the decode figures.
if [[ $part == C ]]; then
  step 150 moe_fusion python3 -m pytest -q -s tests/gpu/test_moe_fusion_gpu.py --tb=short
  step 120 mla_fusion python3 -m pytest -q -s tests/gpu/test_mla_fusion_gpu.py tests/kernels/test_triton_mla_prepare.py \
    tests/kernels/test_triton_dsa.py tests/kernels/test_triton_mla.py --tb=short
  step 90 lora_test python3 -m pytest -q tests/gpu/test_lora_gpu.py tests/kernels/test_triton_lora.py --tb=short
  step 120 step_time python3 -m pytest -q -s tests/gpu/test_step_time_gpu.py --tb=short
  step 70 audio_graphs python3 -m pytest -q tests/gpu/test_audio_graphs_gpu.py --tb=short
fi
if [[ $part == D ]]; then
  step 240 regressions python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "moe or deepseek" tests/gpu/test_fp8_moe_gpu.py \
    tests/gpu/test_fp4_gpu.py tests/gpu/test_triton_kernels_gpu.py tests/gpu/test_deepseek_v4_gpu.py --tb=short
  for model in deepseek-v2-lite qwen3-30b-a3b; do  # batch-1 decode against the bound (0.344 / 0.361 before)
    step 150 "decode_$model" "${cli[@]}" bench gpu --model "$model" --workloads decode --skip-hf \
      --output-json "$out/bench_gpu_decode_$model.json"
  done
fi
# E and F: C and D again, tighter, for a session with 25 minutes of device time (2026-12-07 d): E the fused MoE and
# MLA kernels' tests and the two MoE models' decode and time to ready (its parts); F the serving tail and the rest.
if [[ $part == E ]]; then
  step 130 moe_fusion python3 -m pytest -q -s tests/gpu/test_moe_fusion_gpu.py --tb=short
  step 110 mla_fusion python3 -m pytest -q -s tests/gpu/test_mla_fusion_gpu.py tests/kernels/test_triton_mla_prepare.py \
    tests/kernels/test_triton_dsa.py tests/kernels/test_triton_mla.py --tb=short
  for model in deepseek-v2-lite qwen3-30b-a3b; do
    step 150 "decode_$model" "${cli[@]}" bench gpu --model "$model" --workloads decode --skip-hf \
      --output-json "$out/bench_gpu_decode_$model.json"
  done
fi
if [[ $part == F ]]; then
  step 330 serve_vs_offline bash benchmarks/gpu/serve_vs_offline.sh "$out/serve"
  step 90 step_time python3 -m pytest -q -s tests/gpu/test_step_time_gpu.py --tb=short
  step 90 lora_test python3 -m pytest -q tests/gpu/test_lora_gpu.py tests/kernels/test_triton_lora.py --tb=short
fi
# G: issue 44 item 3 (2026-12-07 d): the fused decode GEMVs' sweep and tests, the decode graphs' LM head and argmax,
# and Llama-3.1-8B's batch-1 decode with both (as shipped) against both off, in one call.
if [[ $part == G ]]; then
  step 200 norm_gemv python3 benchmarks/gpu/norm_gemv.py --budget-s 110 --out "$out/norm_gemv.json"
  step 200 gemv_head_tests python3 -m pytest -q tests/gpu/test_gemv_gpu.py tests/gpu/test_decode_graph_head_gpu.py \
    --tb=short -x
  for variant in on off; do  # off: today's layer (norm + cuBLAS) and the LM head outside the graph
    step 110 "decode_8b_$variant" python3 -c "import sys
import pressroom.model.models.llama as llama, pressroom.worker.cuda_graphs as graphs
if sys.argv[1] == 'off': llama.SMALL_STEP_GEMV, graphs.DECODE_HEAD_MAX_BYTES = False, 0
from pressroom.entrypoints.cli import main
sys.exit(main(sys.argv[2:]))" "$variant" bench gpu --model llama-3.1-8b --workloads decode --skip-hf \
      --output-json "$out/bench_gpu_decode_8b_$variant.json"
  done
fi
# H and I: what the 2026-12-07 (d, e) sessions changed without a GPU: H the tests (the graph's LM head, never run; the
# GEMVs; DSA's launches; the MoE GEMVs on CUDA; the kernel precompile); I the serving tail with the fitted bound, the
# 2-8 token GEMVs' sweep, 8B decode. L: LoRA's bars, then V2-Lite's batch-1 profile (a cold start, its parts) and a warm
# second start (Triton's cache), in one call.
if [[ $part == H ]]; then  # the new defaults first: every CUDA start precompiles, MoE decode takes the new GEMVs
  step 100 precompile python3 -m pytest -q -s tests/gpu/test_kernel_precompile_gpu.py --tb=short
  step 60 moe_kernels python3 -m pytest -q tests/kernels/test_moe_fusion.py --tb=short
  step 150 head_gemv_tests python3 -m pytest -q tests/gpu/test_decode_graph_head_gpu.py tests/gpu/test_gemv_gpu.py \
    --tb=short
  step 110 dsa_launches python3 -m pytest -q -s tests/gpu/test_mla_fusion_gpu.py tests/kernels/test_triton_dsa.py \
    tests/kernels/test_triton_v4_attention.py --tb=short
fi
if [[ $part == I ]]; then
  step 300 serve_vs_offline bash benchmarks/gpu/serve_vs_offline.sh "$out/serve"
  step 110 norm_gemv_rows python3 benchmarks/gpu/norm_gemv.py --tokens 2,4,8 --budget-s 80 \
    --out "$out/norm_gemv_rows.json"
  step 110 decode_8b "${cli[@]}" bench gpu --model llama-3.1-8b --workloads decode --skip-hf \
    --output-json "$out/bench_gpu_decode_8b.json"
fi
# J (2026-12-07 f): the MoE decode GEMVs end to end (V2-Lite, Qwen3-30B batch-1 decode against the bound; 0.344 /
# 0.361 before, bar 0.65), their kernel tests on CUDA, then the kernel precompile's GPU test.
if [[ $part == J ]]; then
  step 60 moe_kernels python3 -m pytest -q tests/kernels/test_moe_fusion.py --tb=short
  for model in deepseek-v2-lite qwen3-30b-a3b; do
    step 150 "decode_$model" "${cli[@]}" bench gpu --model "$model" --workloads decode --skip-hf \
      --output-json "$out/bench_gpu_decode_$model.json"
  done
  step 100 precompile python3 -m pytest -q -s tests/gpu/test_kernel_precompile_gpu.py --tb=short
fi
# K (on an H200, needs_h200): issue 43's DeepSeek-V4 against HF (A's step), then J's two MoE decodes.
if [[ $part == K ]]; then
  step 165 v4_hf "${cli[@]}" bench gpu --model deepseek-v4-flash-reduced --workloads decode,throughput --num-prompts 128 \
    --input-len 256 --output-len 128 --hf-batch-sizes 64 --hf-max-requests 64 --output-json "$out/v4_bench_gpu.json"
  for model in deepseek-v2-lite qwen3-30b-a3b; do
    step 150 "decode_$model" "${cli[@]}" bench gpu --model "$model" --workloads decode --skip-hf \
      --output-json "$out/bench_gpu_decode_$model.json"
  done
fi
# Q (2026-12-07 f, after its H100 run): FP8 Llama's one-token steps through gemv.py's fused kernels (issue 44 item
# 3's 1.7x bar): the GEMV tests with the FP8 engine's, then 8B batch-1 decode in bf16 and FP8, in one call.
if [[ $part == Q ]]; then
  step 200 gemv_tests python3 -m pytest -q tests/gpu/test_gemv_gpu.py --tb=short
  for q in none fp8; do
    step 110 "decode_8b_$q" "${cli[@]}" bench gpu --model llama-3.1-8b --workloads decode --skip-hf --quantization $q \
      --output-json "$out/bench_gpu_decode_8b_$q.json"
  done
fi
if [[ $part == B || $part == all ]]; then
  step 110 sleep_dspark python3 -m pytest -q tests/gpu/test_sleep_mode_gpu.py tests/gpu/test_dspark_gpu.py --tb=short
  step 150 kimi bash benchmarks/gpu/recurrent_bench.sh "$out/rb" kimi-linear-48b-a3b 4096,131072
fi
rm -f "$out"/*/gpu.txt "$out"/rb/context.log "$out"/decode_b*.json  # the traces: their summaries are in the logs
(cd "$out" && tar czf "owed_$part.tgz" --exclude='*.tgz' . && find . -mindepth 1 ! -name '*.tgz' -delete)
