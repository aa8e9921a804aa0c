"""The chat page takes an image for a model that accepts one (issue 47, item 6): in headless Chromium against
`pressroom serve` of a tiny Qwen2.5-VL, /v1/models lists "image" among the model's input_modalities, the page offers
its image button, and an image picked from a file or pasted into the message goes out as an `image_url` part holding
the file's bytes as a data URL, answered as the API answers the same messages; a text-only model's page offers no
image button. (Chromium and Playwright as tests/entrypoints/openai/test_chat_page.py uses them.)"""
from __future__ import annotations

import base64
import contextlib
import io
import os

import httpx
import pytest
from serving import serve
from tiny_vl import random_image

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 60_000

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.slow]  # a VL server of its own (~10 s), the shared tiny server and a browser: ~30 s


@pytest.fixture(scope="module")
def vl_server(tiny_vl, tmp_path_factory):
    args = ["serve", tiny_vl[0], "--served-model-name", "tiny-vl", "--dtype", "float32", "--kv-cache-memory-gib",
            "0.05"]
    with serve(args, tmp_path_factory.mktemp("vl-page") / "server.log") as (url, _):
        yield url


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
def _page(browser, url: str):
    """A fresh page at `url`, its chat request bodies as sent and what went wrong on it."""
    page = browser.new_page()
    bodies: list[dict] = []
    problems: list[str] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"{r.status}: {r.request.method} {r.url}"))
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(url)
        yield page, bodies, problems
    finally:
        page.close()


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(seed, (64, 48)).save(buf, format="PNG")
    return buf.getvalue()


def _paste(page, png: bytes) -> None:
    """A paste into the message box of a clipboard holding one PNG file (what a screenshot paste gives)."""
    page.evaluate("""(b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const clipboard = new DataTransfer();
        clipboard.items.add(new File([bytes], "", {type: "image/png"}));
        document.getElementById("prompt").dispatchEvent(
            new ClipboardEvent("paste", {clipboardData: clipboard, bubbles: true, cancelable: true}));
    }""", base64.b64encode(png).decode())


def _answer(page) -> str:
    page.wait_for_selector("#log[aria-busy=false]")
    return page.locator("#log .assistant .content").last.text_content()


def _api_answer(url: str, body: dict) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_page_sends_picked_and_pasted_images(browser, vl_server, tmp_path):
    card = httpx.get(f"{vl_server}/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image", "video"]  # Qwen2.5-VL takes video too
    picked, pasted = _png(1), _png(2)
    (tmp_path / "cat.png").write_bytes(picked)
    with _page(browser, vl_server) as (page, bodies, problems):
        page.wait_for_selector("#model option[value='tiny-vl']", state="attached")
        page.wait_for_selector("#attach", state="visible")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "8")
        page.set_input_files("#image-file", str(tmp_path / "cat.png"))
        page.wait_for_selector("#attachments li:has-text('cat.png')")
        page.fill("#prompt", "Describe it.")
        page.click("#send")
        first = _answer(page)
        assert first.strip()
        url = "data:image/png;base64," + base64.b64encode(picked).decode()
        want = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
        assert bodies[0]["messages"] == [{"role": "user", "content": want}]
        assert page.locator("#log .user .images").text_content() == "cat.png"  # named in the conversation
        assert page.locator("#attachments li").count() == 0  # sent: the next message starts with none
        assert first == _api_answer(vl_server, bodies[0])

        _paste(page, pasted)  # an image alone, no text
        page.wait_for_selector("#attachments li:has-text('pasted image')")
        page.click("#send")
        second = _answer(page)
        image = base64.b64encode(pasted).decode()
        assert bodies[1]["messages"][-1] == {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}
        assert bodies[1]["messages"][:2] == [{"role": "user", "content": want}, {"role": "assistant", "content": first}]
        assert second == _api_answer(vl_server, bodies[1])
        assert page.locator("#status").text_content() == ""
        assert problems == []


def test_text_only_model_offers_no_image(browser, tiny_server):
    assert httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["input_modalities"] == ["text"]
    with _page(browser, tiny_server) as (page, bodies, problems):
        page.wait_for_selector("#model option[value='tiny']", state="attached")
        assert page.is_hidden("#attach")
        page.fill("#prompt", "hi")
        _paste(page, _png(3))  # ignored: no image is attached for a model that takes none
        assert page.locator("#attachments li").count() == 0
        assert problems == []
