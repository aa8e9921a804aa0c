"""What the disaggregated-serving tests share: engine and router command lines, starting several side by side, and
reading their metrics.

The kv_port race, mended here for every test of the folder: a kv_port is picked free (`free_port`) but bound later,
by NIXL's metadata listener inside an engine, and another process can take it in between (a clean-clone CI run lost
that race: "Failed to bind metadata listener socket: Address already in use"). An engine that fails so is started
again on another port: `with_free_kv_port` for an engine or connector built in this process, `started` for a
`pressroom serve` (its --kv-transfer-config rewritten; a lost HTTP port is picked again the same way). What a lost
port looks like in a log and the rewrite have one home, pressroom/benchmarks/disagg.py, whose `bench disagg` starts
engines the same way."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from serving import STARTUP_S, Server, _die_with_test_run, _wait_healthy, free_port, tail

from pressroom.benchmarks.disagg import KV_PORT_CLASH, lost_a_port, with_new_kv_port

MODEL = "tiny"
KV_PORT_TRIES = 3
T = TypeVar("T")


def with_free_kv_port(build: Callable[[int], T]) -> T:
    """`build(port)` on a free port; when NIXL could not bind it after all (taken since it was picked), on another,
    KV_PORT_TRIES times at most."""
    for attempt in range(KV_PORT_TRIES):
        try:
            return build(free_port())
        except Exception as e:  # noqa: BLE001 - only NIXL's bind failure is retried; the rest is raised
            if KV_PORT_CLASH not in str(e) or attempt == KV_PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def engine_args(model_dir: str) -> list[str]:
    """An engine of the tiny float32 llama (tests/conftest.py's). Not the embedded SmolLM2: its Q4_1 weights take
    the CPU's fused decode stack for short steps after a cached context, whose numerics differ from the prompt
    pass's, so even one SmolLM2 engine gives other greedy tokens when its prompt is split (chunked prefill, a prefix
    hit): the decode engine, which computes the prompt's last token after the received KV, could not be held to
    one engine's tokens. With float weights every step takes the same path and the tokens must be equal."""
    return ["serve", model_dir, "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory-gib", "0.05"]


def transfer_config(role: str, **extra) -> list[str]:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port(),
              "kv_buffer_size": 32 << 20, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


def router_args(prefill: list[str], decode: list[str], *extra: str) -> list[str]:
    return ["router", *(a for url in prefill for a in ("--prefill", url)),
            *(a for url in decode for a in ("--decode", url)), "--health-interval", "0.5", *extra]


@contextlib.contextmanager
def started(specs: dict[str, list[str]], tmp_path, clean: bool = False):
    """Starts every `pressroom` command of `specs` (name -> argv) side by side, from this thread (a child dies with
    the thread that started it); yields name -> Server once each answers /health. `clean`: at the end each must
    still run, have logged no traceback and stop on SIGTERM (as tests/serving.py's `serve`)."""
    servers: dict[str, Server] = {}
    try:
        for name, args in specs.items():
            servers[name] = _launch(name, args, tmp_path)
        for name, args in specs.items():
            for attempt in range(KV_PORT_TRIES):
                try:
                    _wait_healthy(servers[name], STARTUP_S)
                    break
                except AssertionError:
                    log = tail(servers[name].log)
                    if servers[name].proc.poll() is None or not lost_a_port(log) or attempt == KV_PORT_TRIES - 1:
                        raise
                    servers[name].log.close()
                    args = with_new_kv_port(args) if KV_PORT_CLASH in log else args
                    servers[name] = _launch(name, args, tmp_path)  # on another HTTP port too
        yield servers
        if clean:
            for name, server in servers.items():
                assert server.proc.poll() is None, f"{name} died: {tail(server.log)}"
                server.proc.terminate()
                ended = server.proc.wait(30)
                assert ended in (0, -signal.SIGTERM), f"{name}: unclean shutdown: {tail(server.log)}"
                assert "Traceback" not in tail(server.log), tail(server.log)
    finally:
        for server in servers.values():
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
            server.log.close()


def _launch(name: str, args: list[str], tmp_path) -> Server:
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w+")  # noqa: SIM115 — closed by `started`
    proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_test_run)
    return Server(f"http://127.0.0.1:{port}", proc, log, tmp_path / f"{name}.log")


@dataclass(frozen=True)
class Disagg:
    prefill: Server
    decode: Server
    router: str


_LINE = re.compile(r'^(\w+:\w+)\{([^}]*)\} (\S+)$')


def metrics(url: str) -> dict[str, float]:
    """The server's metric samples as "name{labels}" -> value, and each family summed as "name"."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = _LINE.match(line)
        if m:
            name, labels, value = m.groups()
            name = name.split(":", 1)[1]
            samples[f"{name}{{{labels}}}"] = float(value)
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def source(samples: dict[str, float], kind: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith("prompt_tokens_by_source_total{")
               and f'source="{kind}"' in k)
