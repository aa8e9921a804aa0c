"""A server SIGKILLed leaves no temporary folder behind: its engine core notices (PR_SET_PDEATHSIG sends it
SIGTERM), removes the folder of the server's sockets, shuts its executor down (which removes the workers'
folder), and exits; its worker ranks go with it."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import tiny_args
from serving import alive, core_pid, launch, spawned_children

_OURS = ("pressroom-core-*", "pressroom-workers-*")


def _left(tmp: Path) -> list[str]:
    return sorted(p.name for pattern in _OURS for p in tmp.glob(pattern))


@pytest.mark.slow  # a server started and SIGKILLed: 6 s
def test_a_sigkilled_server_leaves_no_temporary_folder_and_no_process(tiny_model_dir, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the server's, its core's and its workers' tempfile folder
    args = tiny_args(tiny_model_dir("llama"), "--distributed-executor-backend", "mp")
    with launch(args, tmp_path / "server.log") as server:
        core = core_pid(server.proc.pid)
        processes = [core, *spawned_children(core)]
        assert len(processes) == 2, processes  # the core and its one worker rank
        assert len(_left(tmp)) == 2, _left(tmp)  # the sockets' folder and the workers'
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        killed = time.monotonic()
        while _left(tmp) or any(alive(p) for p in processes):
            assert time.monotonic() - killed < 10, (_left(tmp), [p for p in processes if alive(p)])
            time.sleep(0.05)
