"""A tensor-parallel rank killed under load: /health turns 503 within 5 s, every in-flight stream ends with
an error instead of hanging, and no process (engine core, the other rank) outlives the server."""
from __future__ import annotations

import json
from pathlib import Path

from tests.engine.test_core_process import (
    _alive,
    _children,
    _core_pid,
    _start,
    _wait_gone,
    kill_and_wait_for_503,
    streams_in_flight,
)


def _worker_pids(core_pid: int) -> list[int]:
    return [p for p in _children(core_pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_a_killed_rank_fails_the_server_fast_and_leaves_no_process(tiny_model_dir, tmp_path):
    proc, url = _start(tiny_model_dir("llama"), tmp_path / "server.log", "--tensor-parallel-size", "2")
    try:
        core = _core_pid(proc.pid)
        ranks = _worker_pids(core)
        assert len(ranks) == 2, ranks
        threads, results = streams_in_flight(url)
        killed = kill_and_wait_for_503(ranks[1], url, "a rank")
        for t in threads:
            t.join(10)
        for r in results:
            assert r["ended"] - killed < 5, r
            errors = [json.loads(e)["error"] for e in r["events"] if e.startswith('{"error"')]
            assert errors and errors[0]["message"], r["events"][-3:]
        proc.terminate()
        proc.wait(30)
        for pid in (core, *ranks):
            assert _wait_gone(pid, 5), f"process {pid} outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any(_alive(p) for p in (core, *ranks))
