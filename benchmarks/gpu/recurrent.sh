#!/usr/bin/env bash
# The recurrent families on a lent GPU (issue 42): the Triton kernels at real shapes against their torch references,
# then every family through the engine against HF transformers. The engine tests need transformers >= 5.25 (the
# image's 5.17 lacks some of these configs): its wheels come from .whl-hf/ (transformers, huggingface_hub, httpx2,
# httpcore2, truststore, tokenizers, hf-xet, kernels, tomlkit), installed beside the image's packages for those
# tests only.
# Usage: bash benchmarks/gpu/recurrent.sh OUT_DIR
set -uo pipefail
out=${1:?usage: recurrent.sh OUT_DIR}
mkdir -p "$out"
source benchmarks/gpu/setup.sh
python3 -m pytest -q tests/gpu/test_recurrent_prefill_gpu.py tests/gpu/test_delta_rule_gpu.py \
  tests/gpu/test_ssm_gpu.py 2>&1 | tee "$out/recurrent_kernels.txt" | tail -25
if compgen -G ".whl-hf/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-hf .whl-hf/*.whl
  export PYTHONPATH=/tmp/site-hf:$PYTHONPATH
fi
python3 -m pytest -q tests/gpu/test_recurrent_models_gpu.py 2>&1 | tee "$out/recurrent_models.txt" | tail -40
