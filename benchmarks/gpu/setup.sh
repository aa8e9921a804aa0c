# Sourced by the GPU scripts (bash): installs the packages the device image lacks from wheels in .whl/
# (see docs/BENCHMARKS.md, GPU section), puts the checkout on PYTHONPATH, and records the GPU in $out.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}  # a path set before (carried wheels) stays on it
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
