#!/usr/bin/env bash
# Rebuilds the wheel folders the GPU scripts carry (run here, on the CPU machine, from the repo root; the device
# image has Python 3.12, torch, Triton 3.6, transformers 5.17, huggingface-hub 1.33, tokenizers 0.23.2 and no
# registry). .whl/: what pressroom imports and the image lacks (setup.sh installs it into /tmp/site). .whl-hf/:
# transformers 5.25 for the deepseek_v4 and kimi_linear oracles, with huggingface-hub 2.4 and the packages those two
# need that the image lacks (hub 2.4 imports httpx2). Pinned to the set that imported together on Python 3.12
# (2026-12-07); about 43 MiB together, counted against the device call's 64 MiB with the tracked tree.
# Use on the device: carry [".whl", ".whl-hf"] and start the command with
#   out=$OUT; python3 -m pip install -q --no-index --no-deps --target /tmp/site-hf .whl-hf/*.whl;
#   export PYTHONPATH=/tmp/site-hf; source benchmarks/gpu/setup.sh;
set -euo pipefail
grep -qxF ".whl-hf/" .git/info/exclude 2>/dev/null || echo ".whl-hf/" >> .git/info/exclude  # .whl/ is in .gitignore
get() {
  local dir=$1; shift
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}
get .whl gguf==0.19.0 fastapi==0.165.0 fastapi-offline==1.7.7 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 h11==0.16.0 anyio==4.16.0 idna==3.21 sniffio==1.3.1 click==8.5.1 msgspec==0.23.0 \
  pyzmq==27.3.0 xxhash==4.1.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 opentelemetry-api==1.45.3 \
  importlib-metadata==10.2.0 lazy-importer==0.1.0 zipp==4.1.2 prometheus-client==0.26.0 peft==0.21.2 \
  pillow==13.0.0  # images (issue 47's GPU test and bench: the processors decode with Pillow)
get .whl-hf transformers==5.25.0 huggingface-hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 \
  hf-xet==1.8.0 kernels==0.19.1 tomlkit==0.15.3 regex==2026.12.2 typer==0.29.2 shellingham==1.5.4 rich==15.0.0 \
  markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
du -sh .whl .whl-hf
