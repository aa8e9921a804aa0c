"""A tensor-parallel rank killed under load: /health turns 503 within 5 s, every in-flight stream ends with
an error instead of hanging, and no process (engine core, the other rank) outlives the server."""
from __future__ import annotations

import json

import pytest
from conftest import tiny_args
from serving import alive, core_pid, kill_and_wait_for_503, launch, spawned_children, streams_in_flight, wait_gone


@pytest.mark.slow  # a server over two ranks, one killed: 16 s
def test_a_killed_rank_fails_the_server_fast_and_leaves_no_process(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir("llama"), "--tensor-parallel-size", "2")
    with launch(args, tmp_path / "server.log") as server:
        proc, url = server.proc, server.url
        core = core_pid(proc.pid)
        ranks = spawned_children(core)
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
            assert wait_gone(pid, 5), f"process {pid} outlived the server"
    assert not any(alive(p) for p in (core, *ranks))
