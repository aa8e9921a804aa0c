"""The compatibility suite's fixture: both servers (peers.py starts them)."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from serving import launch

from compat.peers import MODEL_DIR, SERVE_ARGS, STARTUP_S, Peers, peer_missing, vllm_serve


@pytest.fixture(scope="session")
def peers(tmp_path_factory) -> Iterator[Peers]:
    """Both servers; COMPAT_VLLM_URL and COMPAT_PRESSROOM_URL point the suite at two already running instead
    (started with SERVE_ARGS), for working on the suite without restarting vLLM each time."""
    running = os.environ.get("COMPAT_VLLM_URL"), os.environ.get("COMPAT_PRESSROOM_URL")
    if all(running):
        yield Peers(vllm=running[0], pressroom=running[1])
        return
    reason = peer_missing()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("peers")
    # vLLM first and alone: two model loads at once on 2 cores only slow both.
    with vllm_serve(logs / "vllm.log") as vllm_url, \
            launch(["serve", str(MODEL_DIR), *SERVE_ARGS], logs / "pressroom.log", STARTUP_S) as pressroom:
        yield Peers(vllm=vllm_url, pressroom=pressroom.url)
