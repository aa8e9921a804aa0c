#!/usr/bin/env bash
# Sets up llama.cpp (llama-cpp-python, built from source) as a peer for `pressroom bench latency
# --backend llamacpp`. Idempotent. LLAMA_ISA=avx2 (default) builds llama.cpp for AVX2 + FMA + F16C
# only, so an AVX-512 machine measures the AVX2 path; LLAMA_ISA=native builds for this CPU.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ISA="${LLAMA_ISA:-avx2}"
VENV="$ROOT/.llama-venv-$ISA"
SPEC="${LLAMA_SPEC:-llama-cpp-python==0.3.16}"
STAMP="$VENV/.installed"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SPEC" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
case "$ISA" in
  avx2) FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" ;;
  native) FLAGS="-DGGML_NATIVE=ON" ;;
  *) echo "LLAMA_ISA must be avx2 or native" >&2; exit 2 ;;
esac
echo "[llama_cpp/setup] building $SPEC for $ISA (several minutes on 2 cores)" >&2
CMAKE_ARGS="$FLAGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install -q --no-cache-dir "$SPEC"
echo "$SPEC" > "$STAMP"
