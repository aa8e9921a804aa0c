"""Browsers (issue 41, item 6): a page on another site, or on a name that an attacker's DNS points at this machine
(DNS rebinding), cannot drive a server without an API key. A state-changing request from a foreign origin is a 403
(CORS headers only for --allowed-origins), a Host header that names no host of a loopback server is a 400, and a
JSON route takes only `Content-Type: application/json` (a 415 otherwise). A real `pressroom serve` on loopback
with one allowed origin, and the flags' parsing in process.
"""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import FRIEND

from pressroom.entrypoints.cli import build_parser
from pressroom.entrypoints.openai.settings import ServerSettings

ATTACKER = "http://attacker.example"
TOKENIZE = {"prompt": "hi"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the tiny llama, FRIEND its one allowed origin (shared: conftest.py)


@pytest.fixture(scope="module")
def port(server) -> int:
    return int(server.rsplit(":", 1)[1])


def _assert_error(r: httpx.Response, status: int, type_: str, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == type_ and error["code"] == code, error


# ---- origins ----

@pytest.mark.parametrize("origin", [ATTACKER, "null", "http://127.0.0.1:1"])
def test_a_post_from_a_foreign_origin_is_a_403_without_cors_headers(server, origin):
    r = httpx.post(f"{server}/tokenize", json=TOKENIZE, headers={"Origin": origin})
    _assert_error(r, 403, "permission_error", "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers


def test_the_servers_own_origin_and_clients_without_one_are_served(server):
    assert httpx.post(f"{server}/tokenize", json=TOKENIZE, headers={"Origin": server}).status_code == 200
    assert httpx.post(f"{server}/tokenize", json=TOKENIZE).status_code == 200


def test_an_allowed_origin_gets_cors_headers_on_its_preflight_and_its_post(server):
    preflight = httpx.options(f"{server}/v1/completions", headers={
        "Origin": FRIEND, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == FRIEND
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"Origin": FRIEND})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == FRIEND
    foreign = httpx.get(f"{server}/v1/models", headers={"Origin": ATTACKER})  # a read: answered, but not to the page
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers


# ---- hosts ----

@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.attacker.example", ""])
def test_a_host_that_is_not_a_localhost_name_is_refused(server, port, host):
    host = host.format(port=port)
    for r in (httpx.get(f"{server}/v1/models", headers={"Host": host}),
              # DNS rebinding: the page's origin is its own name, so only the Host check stops it
              httpx.post(f"{server}/tokenize", json=TOKENIZE, headers={"Host": host, "Origin": f"http://{host}"})):
        _assert_error(r, 400, "invalid_request_error", "invalid_host")


@pytest.mark.parametrize("host", ["localhost:{port}", "LOCALHOST", "127.0.0.1:{port}", "[::1]:{port}"])
def test_localhost_names_are_served_and_health_answers_any_host(server, port, host):
    host = host.format(port=port)
    r = httpx.post(f"{server}/tokenize", json=TOKENIZE, headers={"Host": host, "Origin": f"http://{host}"})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server}/health", headers={"Host": "attacker.example"}).status_code == 200


# ---- the body's type ----

def _json_routes(server: str) -> list[str]:
    """Every POST route but those whose body is a form (the audio API's uploads, as OpenAI's)."""
    paths = httpx.get(f"{server}/openapi.json").json()["paths"]
    return sorted(path for path, operations in paths.items() if "post" in operations
                  and "multipart/form-data" not in operations["post"].get("requestBody", {}).get("content", {}))


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_json_body_under_another_content_type_is_a_415_on_every_route(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    routes = _json_routes(server)
    assert "/v1/chat/completions" in routes and "/v1/embeddings" in routes
    for path in routes:
        r = httpx.post(f"{server}{path}", content=json.dumps(TOKENIZE).encode(), headers=headers)
        _assert_error(r, 415, "invalid_request_error", "unsupported_media_type")
        assert "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_application_json_with_parameters_is_accepted(server, content_type):
    r = httpx.post(f"{server}/tokenize", content=json.dumps(TOKENIZE).encode(), headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text


# ---- the flags (in process) ----

def _settings(*flags: str) -> ServerSettings:
    return ServerSettings.from_args(build_parser().parse_args(["serve", "m", *flags]))


def test_the_flags_take_json_lists_as_vllm_does_or_comma_lists():
    settings = _settings("--allowed-origins", '["http://a.example", "https://b.example:8443"]',
                         "--allowed-methods", "GET,POST", "--allowed-headers", '["Authorization"]',
                         "--allow-credentials", "--allowed-hosts", "A.example, b.example.")
    assert settings.allowed_origins == ("http://a.example", "https://b.example:8443")
    assert settings.allowed_methods == ("GET", "POST") and settings.allowed_headers == ("Authorization",)
    assert settings.allow_credentials and settings.host_names() == {"a.example", "b.example"}
    default = _settings()
    assert default.allowed_origins == () and default.allowed_methods == ("*",) and not default.allow_credentials
    with pytest.raises(ValueError, match="not an origin"):
        _settings("--allowed-origins", '["http://a.example/"]')
    with pytest.raises(SystemExit):  # argparse: a JSON list of strings
        _settings("--allowed-origins", "[1]")


@pytest.mark.parametrize("host, names", [
    ("127.0.0.1", {"localhost", "127.0.0.1", "[::1]"}), ("::1", {"localhost", "127.0.0.1", "[::1]"}),
    ("localhost", {"localhost", "127.0.0.1", "[::1]"}), ("127.0.0.2", {"localhost", "127.0.0.1", "[::1]", "127.0.0.2"}),
    ("0.0.0.0", None), ("::", None), ("192.168.1.5", None), ("example.com", None),
])
def test_hosts_default_to_localhost_names_on_loopback_and_any_elsewhere(host, names):
    assert ServerSettings(host=host).host_names() == names
    assert ServerSettings(host=host, allowed_hosts=("*",)).host_names() is None
    assert ServerSettings(host=host, allowed_hosts=("a.example:80",)).host_names() == {"a.example"}
