#!/usr/bin/env bash
# Issue 49's GPU figure: disaggregated prefill/decode (a prefill engine + a decode engine on one GPU, the KV budget
# split in halves, behind `pressroom router`) against one engine alone, the same mixed workload: 64 streams decoding
# 1024 tokens while 32 prompts of 4096 tokens arrive at 2/s. Llama-3.1-8B's shape, dummy weights, a synthetic
# tokenizer (bench disagg writes it). Reports P50/P99 ITL of the streams, the long prompts' TTFT, output tok/s and
# the disagg/colocated ratios (the bar: P99 ITL at most 0.5x) to OUT/disagg.json, OUT/disagg.png and
# OUT/disagg.logs/ (each process's log).
#
# The device image lacks NIXL (the KV transfer's transport) and pressroom's server packages. Prepare both here, on the
# CPU machine, from the repo root, once:
#   bash benchmarks/gpu/wheels.sh                  # .whl/: fastapi, uvicorn, msgspec, pyzmq, ...
#   bash benchmarks/gpu/disagg_bench.sh --wheels   # .whl-nixl/: nixl 1.5.1 + nixl-cu13 1.5.1 slimmed to UCX (16 MiB)
# then, in one device call (carry [".whl", ".whl-nixl"]; expected 3-5 minutes, under 400 s by the steps' timeouts):
#   bash benchmarks/gpu/disagg_bench.sh $OUT
# Sizes on 2026-12-07: tree 24.9 MiB + .whl 18.0 (pillow 6.8 of it, not needed here) + .whl-nixl 15.9 = 58.8 of the
# call's 64 MiB; if the tree has grown past that, carry .whl without pillow (owed.sh's .whl-owed: carry
# [".whl-owed", ".whl-nixl"] and start with `rm -rf .whl && mv .whl-owed .whl && bash benchmarks/gpu/disagg_bench.sh`).
# Environment: STREAMS, OUTPUT_LEN, LONG_PROMPTS, LONG_LEN, LONG_RATE, KV_GIB override the workload and KV budget;
# MODEL and DEVICE=cpu run the same command on the CPU (how its flags were checked: a tiny config, small numbers).
set -uo pipefail

if [[ ${1:-} == --wheels ]]; then
  # NIXL's CUDA-13 wheel is 56 MiB, past a device call's 64 MiB with the tree: keep what an agent with the UCX backend
  # loads (the Python bindings, libnixl and the shared libraries they need, the UCX plugin and UCX's transports) and
  # drop the rest (nixl_ep's torch extensions, the other backends' plugins and their cloud SDKs, tools, headers).
  set -e
  grep -qxF ".whl-nixl/" .git/info/exclude 2>/dev/null || echo ".whl-nixl/" >> .git/info/exclude
  rm -rf .whl-nixl && mkdir -p .whl-nixl
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl-nixl nixl==1.5.1 nixl-cu13==1.5.1
  python3 - .whl-nixl/nixl_cu13-*.whl <<'EOF'
import base64, hashlib, os, re, shutil, subprocess, sys, tempfile, zipfile
from pathlib import Path
wheel = Path(sys.argv[1])
tmp = Path(tempfile.mkdtemp())
with zipfile.ZipFile(wheel) as z:
    z.extractall(tmp)
libs, meson = tmp / "nixl_cu13.libs", tmp / ".nixl_cu13.mesonpy.libs"
for gone in ["nixl_ep_cu13", "nixl_cu13.scripts", *(p.name for p in tmp.glob("nixl_cu13-*.data"))]:
    shutil.rmtree(tmp / gone, ignore_errors=True)
for plugins in (libs / "nixl", meson / "plugins"):
    for so in plugins.glob("*.so"):
        if so.name != "libplugin_UCX.so":
            so.unlink()
for f in (libs / "ucx").glob("libucx_perftest*"):
    f.unlink()
roots = [*tmp.glob("nixl_cu13/*.so"), *meson.glob("*.so*"), *meson.glob("plugins/*.so"), *(libs / "ucx").glob("*.so*"),
         *(libs / "nixl").glob("*.so")]
where = {p.name: p for d in (libs, meson) for p in d.iterdir() if p.is_file()}
needed, todo = set(), list(roots)
while todo:
    elf = todo.pop()
    out = subprocess.run(["readelf", "-d", str(elf)], capture_output=True, text=True, check=True).stdout
    for name in re.findall(r"\(NEEDED\).*\[(.+)\]", out):
        if name in where and name not in needed:
            needed.add(name)
            todo.append(where[name])
for p in libs.iterdir():
    if p.is_file() and p.name not in needed:
        p.unlink()
dist = next(tmp.glob("nixl_cu13-*.dist-info"))
rows = []
for p in sorted(tmp.rglob("*")):
    if p.is_file() and p.name != "RECORD":
        digest = base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=").decode()
        rows.append(f"{p.relative_to(tmp)},sha256={digest},{p.stat().st_size}")
rows.append(f"{dist.name}/RECORD,,")
(dist / "RECORD").write_text("\n".join(rows) + "\n")
wheel.unlink()
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            z.write(p, p.relative_to(tmp))
shutil.rmtree(tmp)
print(f"{wheel}: {wheel.stat().st_size / 2**20:.1f} MiB, {len(needed)} shared libraries kept")
EOF
  du -sh .whl-nixl
  exit 0
fi

out=${1:?usage: disagg_bench.sh OUT_DIR   (or --wheels, on the CPU machine first)}
mkdir -p "$out"
if compgen -G ".whl-nixl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-nixl \
    .whl-nixl/*.whl
  export PYTHONPATH=/tmp/site-nixl${PYTHONPATH:+:$PYTHONPATH}
fi
source benchmarks/gpu/setup.sh > /dev/null  # .whl/ into /tmp/site, the checkout on PYTHONPATH, OUT/gpu.txt
cat "$out/gpu.txt"
# NIXL's agent with UCX in host memory, as the connector makes it, before four minutes go to the engines
timeout 30 python3 -c "
import torch  # first: NIXL's meta package picks its CUDA-13 build from torch's CUDA
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent('probe', nixl_agent_config(enable_prog_thread=False, enable_listen_thread=True, listen_port=5799,
                                          backends=['UCX']))
print('nixl ok, backends', a.backends)" 2>&1 | tail -3 || { echo "NIXL does not start here: no disaggregated run"; }
# the KV budget: two 8B engines (16 GiB of weights each) and half of it each must fit one card; an H100's 80 GB
# takes 32 GiB (16 each, room for 64 streams of 1152 tokens and the long prompts in flight), an H200's 48
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -1 | tr -cd 0-9)
kv_default=$(( ${mib:-0} > 100000 ? 48 : 32 ))
time timeout 360 python3 -m pressroom.entrypoints.cli bench disagg \
  --model "${MODEL:-pressroom/benchmarks/configs/llama-3.1-8b}" --load-format dummy --dtype bfloat16 \
  --device "${DEVICE:-cuda}" --streams "${STREAMS:-64}" --stream-output-len "${OUTPUT_LEN:-1024}" \
  --long-prompts "${LONG_PROMPTS:-32}" --long-input-len "${LONG_LEN:-4096}" --long-rate "${LONG_RATE:-2}" \
  --kv-cache-gib "${KV_GIB:-$kv_default}" --startup-timeout 150 --request-timeout 200 \
  --output-json "$out/disagg.json" --plot "$out/disagg.png"
echo "rc $?"
for f in "$out"/disagg.logs/*.log; do
  grep -q -E "Traceback|Error" "$f" && { echo "== $f"; grep -E -B2 -A12 "Traceback|Error" "$f" | tail -40; }
done
exit 0
