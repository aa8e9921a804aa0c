"""A real `pressroom serve` subprocess for tests: free loopback port, wait for /health, clean SIGTERM."""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


@contextlib.contextmanager
def serve(cli_args: list[str], log_path, startup_s: float = 120, shutdown_s: float = 30):
    """Runs `python -m pressroom.entrypoints.cli *cli_args --port P`; yields (base URL, log file).
    On exit the server must still be up, have logged no traceback, and stop cleanly on SIGTERM."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", *cli_args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, log, url, startup_s)
        yield url, log
        assert proc.poll() is None, f"server died: {tail(log)}"
        assert "Traceback" not in tail(log), tail(log)
        proc.terminate()
        assert proc.wait(shutdown_s) in (0, -signal.SIGTERM), f"unclean shutdown: {tail(log)}"  # uvicorn re-raises
        assert "Traceback" not in tail(log), tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _wait_healthy(proc: subprocess.Popen, log, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"server exited: {tail(log)}"
        assert time.monotonic() < deadline, f"server did not come up: {tail(log)}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
