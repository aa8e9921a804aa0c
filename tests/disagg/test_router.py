"""`pressroom router` on its own: with no engine reachable it answers 503 at once (no hang), and its command line and
the request it sends a prefill engine are checked."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from serving import free_port

from pressroom.entrypoints.router import RouterSettings, build_app, prefill_body, settings_from_args


def test_no_healthy_engine_is_a_503_at_once():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with TestClient(build_app(RouterSettings((dead[0],), (dead[1],), connect_timeout_s=1.0))) as client:
        assert client.get("/health").status_code == 503
        start = time.monotonic()
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert response.status_code == 503 and "no healthy prefill engine" in response.json()["error"]["message"]
        response = client.post("/v1/chat/completions", json={"model": "m", "messages": [], "stream": True})
        assert response.status_code == 503
        assert time.monotonic() - start < 2
        assert [e["healthy"] for e in client.get("/engines").json()] == [False, False]
        assert client.post("/v1/completions", content=b"not json").status_code == 400


def test_the_prefill_request_is_one_token_not_streamed_and_asks_to_stage():
    body = {"model": "m", "messages": [], "max_tokens": 50, "max_completion_tokens": 60, "stream": True,
            "stream_options": {"include_usage": True}, "n": 1}
    sent = prefill_body(body)
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1 and sent["stream"] is False
    assert "stream_options" not in sent and sent["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's request, as the decode engine gets it


@pytest.mark.parametrize("prefill, decode, error", [
    ([], ["http://d"], "at least one --prefill URL"),
    (["http://p"], [], "one --decode URL"),
    (["p:8000"], ["http://d"], "must start with http://"),
])
def test_bad_router_command_lines_are_refused(prefill, decode, error):
    args = SimpleNamespace(prefill=prefill, decode=decode, health_interval=2.0, request_timeout=60.0, max_retries=2)
    with pytest.raises(ValueError, match=error):
        settings_from_args(args)
