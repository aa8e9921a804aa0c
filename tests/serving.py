"""The one launcher for tests that start `pressroom serve`: a subprocess on a free loopback port, up once /health
answers, its stdout and stderr in a log file that failures quote, never left running (not even by a test run
that is killed).

`launch` is for tests that end the server themselves (killing its core, signalling it); `serve` is for a server
that must outlive its test: on exit it must still be up, have logged no traceback and stop cleanly on SIGTERM.
`serve_in_thread` serves an app built in the test's own process (build_app over an engine it holds).
Share a server through a module- or session-scoped fixture wherever tests can use the same arguments: a start
costs some 10 s on 2 cores (conftest.py holds the session-wide ones)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

STARTUP_S = 180  # a loaded 2-core machine can take minutes to import torch and load a model
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child must not load libraries


def _die_with_test_run() -> None:
    """Linux: the server gets SIGKILL when the test run goes, however it goes (a killed run would leave it
    running, on a machine others share)."""
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(log: IO[str]) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


@dataclass(frozen=True)
class Server:
    """A running `pressroom serve`: its base URL, its process, and its log (open for reading, and at log_path)."""
    url: str
    proc: subprocess.Popen
    log: IO[str]
    log_path: Path


PORT_TRIES = 3
# What `pressroom serve` logs when its --port was taken (bind_listener's PortUnavailableError; uvicorn's own).
PORT_LOST = ("is in use by another process", "address already in use")


@contextlib.contextmanager
def launch(cli_args: list[str], log_path: Path, startup_s: float = STARTUP_S) -> Iterator[Server]:
    """Runs `python -m pressroom.entrypoints.cli *cli_args --port P` and yields it once /health is 200; on exit
    kills it if it still runs. The port is picked free but bound only by the server, seconds later: another
    process can take it in between, and a start that lost it so is made again on another (PORT_TRIES at most)."""
    for attempt in range(PORT_TRIES):
        port = free_port()
        log = open(log_path, "w+")
        proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", *cli_args, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_test_run)
        server = Server(f"http://127.0.0.1:{port}", proc, log, Path(log_path))
        try:
            _wait_healthy(server, startup_s)
        except BaseException as e:  # noqa: BLE001 - ended and raised again, unless the port was lost
            lost = isinstance(e, AssertionError) and proc.poll() is not None and \
                any(s in tail(log).lower() for s in PORT_LOST)
            _end(proc)
            log.close()
            if lost and attempt < PORT_TRIES - 1:
                continue
            raise
        break
    with log:
        try:
            yield server
        finally:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve(cli_args: list[str], log_path: Path, startup_s: float = STARTUP_S,
          shutdown_s: float = 30) -> Iterator[tuple[str, IO[str]]]:
    """`launch` for a server that outlives its test; yields (base URL, log file). On exit the server must still be
    up, have logged no traceback, and stop cleanly on SIGTERM within `shutdown_s`."""
    with launch(cli_args, log_path, startup_s) as server:
        yield server.url, server.log
        log = server.log
        assert server.proc.poll() is None, f"server died: {tail(log)}"
        assert "Traceback" not in tail(log), tail(log)
        server.proc.terminate()
        ended = server.proc.wait(shutdown_s)
        assert ended in (0, -signal.SIGTERM), f"unclean shutdown: {tail(log)}"  # uvicorn re-raises SIGTERM
        assert "Traceback" not in tail(log), tail(log)


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.proc.poll() is None, f"server exited: {tail(server.log)}"
        assert time.monotonic() < deadline, f"server did not come up: {tail(server.log)}"
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


# ---- a server's processes: its engine core, the core's ranks ----

def children(pid: int) -> list[int]:
    """The live (not zombie) children of `pid`."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def pid_serving(url: str) -> int:
    """The pid of the `pressroom serve` that this test process started on `url`'s port (`serve` yields the URL,
    and session fixtures share only that)."""
    port = url.rsplit(":", 1)[1]
    for pid in children(os.getpid()):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"pressroom.entrypoints.cli" in command and command[-3:-1] == [b"--port", port.encode()]:
            return pid
    raise AssertionError(f"no server of ours on port {port}")


def spawned_children(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned (an engine core, a core's worker ranks)."""
    return [p for p in children(pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def core_pid(server_pid: int) -> int:
    cores = spawned_children(server_pid)
    assert len(cores) == 1, cores
    return cores[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def stream_events(url: str, first_chunk: threading.Event, result: dict, chat: bool = False) -> None:
    """A long streaming completion (or chat completion); records the SSE events it got and when it ended."""
    body = {"max_tokens": 1500, "ignore_eos": True, "stream": True}
    body |= {"messages": [{"role": "user", "content": "Hello"}]} if chat else {"prompt": "Hello"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events = []
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")
    result["events"], result["ended"] = events, time.monotonic()
    first_chunk.set()


def streams_in_flight(url: str, n: int = 3) -> tuple[list[threading.Thread], list[dict]]:
    """`n` long streams, each past its first chunk (still running) when this returns."""
    results = [{} for _ in range(n)]
    started = [threading.Event() for _ in results]
    threads = [threading.Thread(target=stream_events, args=(url, e, r)) for e, r in zip(started, results)]
    for t in threads:
        t.start()
    for e, r in zip(started, results):
        assert e.wait(60) and "ended" not in r, r
    return threads, results


def kill_and_wait_for_503(pid: int, url: str, what: str) -> float:
    """SIGKILLs `pid`; asserts /health turns 503 within 5 s; returns when it was killed."""
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < 5, f"/health still 200 five seconds after {what} died"
        time.sleep(0.05)
    return killed


@contextlib.contextmanager
def serve_in_thread(app, startup_s: float = 60) -> Iterator[str]:
    """An ASGI app (build_app's) under uvicorn in this process, on a loopback port bound before it starts (no port
    race); yields its base URL and stops it on exit."""
    import uvicorn

    from pressroom.entrypoints.openai.server import bind_listener
    sock = bind_listener("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_s
    try:
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the loopback server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
