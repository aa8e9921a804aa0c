#!/usr/bin/env bash
# Issue 15's H200 figures in one go (dummy weights): `bench gpu` on DeepSeek-V2-Lite with HF transformers
# beside it, the KV capacity of V2-Lite with the latent cache and with per-head keys and values (the
# engine's own log line), and `bench sparse-attention` (DSA vs dense MLA by context). Results go to $1.
set -uo pipefail
out=${1:-results}
mkdir -p "$out"
source "$(dirname "$0")/setup.sh"

for mode in 0 1; do  # 0: the latent cache (MLA); 1: per-head keys and values (PRESSROOM_MLA_DISABLE=1)
  PRESSROOM_MLA_DISABLE=$mode timeout 150 python3 - <<'PY' 2>&1 | grep "KV cache:" | sed "s/^/mla_disable=$mode: /" | tee -a "$out/kv_capacity.txt"
from pressroom import LLM
LLM("pressroom/benchmarks/configs/deepseek-v2-lite", load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
    gpu_memory_utilization=0.9, max_model_len=32768)
PY
done
timeout 120 python3 -m pressroom.entrypoints.cli bench sparse-attention --output-json "$out/sparse_attention_b1.json" 2>&1 | tail -6
timeout 120 python3 -m pressroom.entrypoints.cli bench sparse-attention --batch-size 32 --contexts 4096,16384,65536 \
  --output-json "$out/sparse_attention_b32.json" 2>&1 | tail -5
timeout 400 python3 -m pressroom.entrypoints.cli --log-level INFO bench gpu --model deepseek-v2-lite --workloads decode,throughput \
  --hf-batch-sizes 128,256 --output-json "$out/bench_gpu_deepseek_v2_lite.json" 2>&1 | tee "$out/bench.log" \
  | grep -v "^INFO" | tail -30
