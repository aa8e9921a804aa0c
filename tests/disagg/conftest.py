"""Disaggregated serving on loopback: `pressroom serve` engines of the embedded SmolLM2 as NIXL producers and
consumers, and `pressroom router` over them; engines start side by side (a start costs tens of seconds on a loaded
2-core machine)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # disagg_support; a package (__init__.py): its conftest is no "conftest"

pytest.importorskip("nixl", reason="the NixlConnector's transport (pip install nixl, or make install-test)")

from disagg.disagg_support import Disagg, engine_args, router_args, started, transfer_config  # noqa: E402


@pytest.fixture(scope="session")
def disagg(tmp_path_factory, tiny_model_dir):
    """A producer and a consumer (reads time out after 3 s) and a router over them, shared by the default tests."""
    tmp = tmp_path_factory.mktemp("disagg")
    model = engine_args(tiny_model_dir("llama"))
    engines = {"prefill": model + transfer_config("kv_producer", abort_request_timeout_s=8),
               "decode": model + transfer_config("kv_consumer", transfer_timeout_s=3)}
    with started(engines, tmp, clean=True) as servers:
        args = router_args([servers["prefill"].url], [servers["decode"].url])
        with started({"router": args}, tmp, clean=True) as front:
            yield Disagg(servers["prefill"], servers["decode"], front["router"].url)
