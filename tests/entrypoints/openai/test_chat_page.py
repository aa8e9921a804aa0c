"""The built-in chat page at / (issue 17, item 4), against a real `pressroom serve` on loopback.

The page and its assets load without the API key (the page asks for it) and stay out of /openapi.json. In headless
Chromium (Debian's package: Playwright's own browser download is not reachable; `make install-test` installs it)
the page lists the models, streams an answer that grows chunk by chunk, sends the conversation back on the next
turn with the system prompt and settings, and stops an answer on request, with no console error and no failed
request.
"""
from __future__ import annotations

import contextlib
import os
import re
import time

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
KEY = "sesame"
TIMEOUT_MS = 60_000  # one CPU answer on 2 busy cores

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(smol_server):
    """The embedded SmolLM2, no API key (shared: conftest.py)."""
    return smol_server


@pytest.fixture(scope="module")
def keyed_server(keyed_tiny_server):
    return keyed_tiny_server  # the tiny llama behind the key KEY (shared: conftest.py)


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM}: `apt-get install chromium` (make install-test does) to run the browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extras")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@contextlib.contextmanager
def _open(browser, url: str):
    """A fresh page at `url`; yields it and the list of what went wrong on it (console errors, uncaught
    exceptions, requests that failed or got an error status), which the test checks."""
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.method} {r.url} {r.failure}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"{r.status}: {r.request.method} {r.url}"))
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(url)
        yield page, problems
    finally:
        page.close()


def _chat_bodies(page) -> list[dict]:
    """The JSON bodies of the page's chat requests, as they are sent."""
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    return bodies


def _watch_answers(page) -> None:
    """Records in window.answerLengths the length of the last answer's text after every change in the log."""
    page.evaluate("""() => {
        window.answerLengths = [];
        new MutationObserver(() => {
            const answer = document.querySelector('#log .assistant:last-child .content');
            if (answer) window.answerLengths.push(answer.textContent.length);
        }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
    }""")


def _ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def _wait_answered(page) -> None:
    page.wait_for_selector("#log[aria-busy=false]")


def test_page_is_served_open_and_kept_out_of_the_schema(keyed_server):
    page = httpx.get(f"{keyed_server}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="static/chat.js"' in page.text
    for asset, kind in [("chat.js", "javascript"), ("chat.css", "text/css"), ("favicon.svg", "image/svg+xml")]:
        response = httpx.get(f"{keyed_server}/static/{asset}")
        assert response.status_code == 200 and kind in response.headers["content-type"], asset
    assert httpx.get(f"{keyed_server}/v1/models").status_code == 401  # the API still needs the key
    assert httpx.get(f"{keyed_server}/static/missing.js").status_code == 401  # only the shipped files are open
    paths = httpx.get(f"{keyed_server}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    assert not [path for path in paths if path == "/" or path.startswith("/static")], sorted(paths)


def test_page_streams_an_answer_and_keeps_the_conversation(browser, server):
    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    with _open(browser, server) as (page, problems):
        bodies = _chat_bodies(page)
        page.wait_for_selector(f"#model option[value='{model}']", state="attached")
        page.fill("#system", "You are a helpful assistant.")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "24")
        _watch_answers(page)
        _ask(page, "Name three colours.")
        _wait_answered(page)
        lengths = page.evaluate("window.answerLengths")
        first = page.locator("#log .assistant .content").last.text_content()
        assert first.strip(), "no answer"
        shown = sorted({n for n in lengths if 0 < n < len(first)})
        assert shown, f"the answer appeared all at once, not streamed: {lengths}"
        assert lengths == sorted(lengths), lengths  # it only grew

        _ask(page, "And one more?")
        _wait_answered(page)
        second = page.locator("#log .assistant .content").last.text_content()
        assert second.strip()
        assert page.locator("#log .message").count() == 4
        assert bodies[1]["model"] == model and bodies[1]["stream"] is True
        assert (bodies[1]["temperature"], bodies[1]["max_tokens"]) == (0, 24)
        assert bodies[1]["messages"] == [{"role": "system", "content": "You are a helpful assistant."},
                                         {"role": "user", "content": "Name three colours."},
                                         {"role": "assistant", "content": first},
                                         {"role": "user", "content": "And one more?"}]
        assert page.locator("#status").text_content() == ""
        assert problems == []


def test_stop_ends_the_answer_on_the_server(browser, server):
    with _open(browser, server) as (page, problems):
        page.wait_for_selector("#model option", state="attached")
        page.fill("#max-tokens", "2000")
        page.fill("#temperature", "0")
        _ask(page, "Write a long story about a lighthouse.")
        page.wait_for_selector("#log .assistant .content:not(:empty)")
        page.click("#stop")
        _wait_answered(page)
        assert page.locator("#log .assistant.stopped").count() == 1  # the partial answer stays, marked
        assert page.is_enabled("#send") and not page.is_enabled("#stop")
        _wait_idle(server, 10)  # the dropped stream aborted its request
        # the one thing that failed is the request the button aborted
        assert [p for p in problems if not re.search(r"failed: POST \S+/v1/chat/completions net::ERR_ABORTED", p)] == []


def test_page_asks_for_the_key(browser, keyed_server):
    with _open(browser, keyed_server) as (page, problems):
        page.wait_for_selector("#status.error")
        assert "API key" in page.locator("#status").text_content()
        # without the key, the model list is refused, and the browser logs that
        assert sorted(problems) == [f"401: GET {keyed_server}/v1/models", "console: Failed to load resource: the "
                                    "server responded with a status of 401 (Unauthorized)"]
        problems.clear()
        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")  # Enter leaves the field's value committed: `change` fires
        page.wait_for_selector("#model option[value='tiny']", state="attached")
        page.fill("#max-tokens", "4")
        _ask(page, "hi")
        _wait_answered(page)
        assert page.locator("#log .message").count() == 2  # kept: the request was accepted
        assert page.locator("#status").text_content() == ""
        assert problems == []


def _wait_idle(url: str, seconds: float) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    deadline = time.monotonic() + seconds
    while True:
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        if not any(s.value for f in families if f.name == "vllm:num_requests_running" for s in f.samples):
            return
        assert time.monotonic() < deadline, "the stopped request still runs"
        time.sleep(0.2)
