"""Hostile media through a real `pressroom serve` (issue 47's must-show): every medium the guards refuse is a 4xx
naming its limit within 5 s, with the official openai client, while a concurrent stream keeps its pace and /health
answers (the paced stream and poller of test_hostile_input.py, each a process of its own). The media come as data
URLs, from a loopback HTTP server of the test's own (the only allowed domain: 127.0.0.1), and from file:// URLs
under an allowed folder. The tiny llama takes no media: media that pass every guard are a 400 saying so, which is
how a case shows that the guards let them through.

One server for the module: --allowed-media-domains 127.0.0.1, --allowed-local-media-path (a temporary folder),
--media-fetch-timeout 1, --limit-mm-per-prompt '{"image": 2, "audio": 1}'."""
from __future__ import annotations

import asyncio
import base64
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import tiny_args
from serving import pid_serving, serve
from test_hostile_input import ANSWER_WITHIN_S, KEY, MODEL, Watch

sys.path.insert(0, str(Path(__file__).parents[2] / "multimodal"))
from hostile_media import (  # noqa: E402
    data_url,
    forged_rate_wav,
    gif,
    jpeg,
    media_server,
    mp4_video,
    png,
    png_bomb,
    wav,
)

FETCH_TIMEOUT_S = 1.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(the allowed media folder with a.png in it, a folder beside it with secret.png)."""
    root = tmp_path_factory.mktemp("media")
    allowed, other = root / "allowed", root / "other"
    allowed.mkdir()
    other.mkdir()
    (allowed / "a.png").write_bytes(png())
    (other / "secret.png").write_bytes(png())
    return allowed, other


@pytest.fixture(scope="module")
def media_host():
    with media_server({"/a.png": ("image/png", png()), "/bomb.png": ("image/png", png_bomb())}) as server:
        yield server


@pytest.fixture(scope="module")
def served(tiny_model_dir, folders, tmp_path_factory) -> Iterator[tuple[str, int]]:
    args = tiny_args(tiny_model_dir("llama"), "--api-key", KEY, "--max-concurrent-requests", "16",
                     "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(folders[0]),
                     "--media-fetch-timeout", str(FETCH_TIMEOUT_S),
                     "--limit-mm-per-prompt", '{"image": 2, "audio": 1}', name=MODEL)
    with serve(args, tmp_path_factory.mktemp("hostile-media") / "server.log", shutdown_s=20) as (url, _):
        yield url, pid_serving(url)


@pytest.fixture(scope="module")
def watch(served, tmp_path_factory) -> Iterator[Watch]:
    watch = Watch.start(*served, tmp_path_factory.mktemp("watch"))
    try:
        yield watch
    finally:
        watch.finish()


@pytest.fixture
def client(served, watch, request) -> Iterator[str]:
    """The module's server (its URL) for one case, whose window is held to the paced stream's bars."""
    since = time.monotonic()
    yield served[0]
    watch.check_window(request.node.name, since, time.monotonic())


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


async def refused(url: str, *parts: dict, stream: bool = False) -> tuple[dict, float]:
    """The 400 that the official client's chat request with `parts` (after a text part) gets, and how long it
    took to come."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30) as client:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=stream)
        seconds = time.monotonic() - started
    error = e.value.body
    assert error["message"] and error["param"] in ("messages.0.content", "messages"), error
    assert "/tmp" not in error["message"] and "site-packages" not in error["message"], error
    return error, seconds


def answer(client: str, *parts: dict, match: str, stream: bool = False) -> dict:
    error, seconds = asyncio.run(refused(client, *parts, stream=stream))
    assert match in error["message"], error
    assert seconds < ANSWER_WITHIN_S, f"{seconds:.1f} s to answer"
    return error


# ---- media that pass the guards: the tiny llama takes none ----

def test_a_data_url_image_passes_the_guards_and_the_text_model_says_it_takes_no_images(client):
    error = answer(client, image(data_url("image/png", png())), match="this model takes no images")
    assert error["message"].startswith("messages[0].content[1] (image_url)")
    answer(client, image(data_url("image/jpeg", jpeg())), match="takes no images", stream=True)
    answer(client, audio(wav(0.5)), match="this model takes no audio")
    answer(client, {"type": "video_url", "video_url": {"url": data_url("video/mp4", mp4_video(8))}},
           match="this model takes no video")


def test_media_from_the_allowed_domain_and_folder_pass_the_guards(client, media_host, folders):
    answer(client, image(media_host.url("/a.png")), match="takes no images")
    answer(client, image(f"file://{folders[0]}/a.png"), match="takes no images")


# ---- sources ----

def test_a_url_outside_the_allowed_domains_is_refused(client, media_host):
    answer(client, image(media_host.url("/a.png", host="localhost")), match="--allowed-media-domains")
    answer(client, image("http://169.254.169.254/latest/meta-data/"), match="'169.254.169.254' is not one of them")


def test_a_redirect_from_the_allowed_server_to_another_host_is_refused(client, media_host):
    target = media_host.url("/a.png", host="localhost")
    answer(client, image(media_host.url("/redirect?to=" + target)), match="'localhost' is not one of them")


def test_slow_servers_time_out_within_five_seconds(client, media_host):
    """A server that trickles a byte every 0.2 s and one that never answers, three of each at once: each a 400
    at the fetch limit (1 s), side by side on the media threads."""
    async def both():
        slow = [refused(client, image(media_host.url(path))) for path in ("/slow", "/stall") * 3]
        return await asyncio.gather(*slow)
    for error, seconds in asyncio.run(both()):
        assert "limit of 1 s" in error["message"], error
        assert FETCH_TIMEOUT_S - 0.2 < seconds < ANSWER_WITHIN_S, f"{seconds:.1f} s"


def test_file_urls_outside_the_allowed_path_are_refused(client, folders):
    allowed, other = folders
    for url in (f"file://{other}/secret.png", f"file://{allowed}/../other/secret.png", "file:///etc/passwd"):
        answer(client, image(url), match="outside the server's --allowed-local-media-path")


# ---- bombs and malformed media ----

def test_a_decompression_bomb_is_refused_from_its_header(client, media_host):
    answer(client, image(data_url("image/png", png_bomb())), match="limit of 178956970")
    answer(client, image(media_host.url("/bomb.png")), match="limit of 178956970")


def test_a_gif_of_ten_thousand_frames_is_refused(client):
    answer(client, image(data_url("image/gif", gif(10_000))), match="more than 1000 frames")


def test_audio_whose_header_claims_a_tiny_sample_rate_is_refused_by_its_samples(client):
    """20 s of 16 kHz samples whose header says 1 Hz (an hour's would not fit the request body): 320000 s at the
    rate it would be played and resampled at."""
    answer(client, audio(forged_rate_wav(20, claimed_rate=1)), match="limit of 600 s")


def test_malformed_and_mislabelled_media_are_refused(client):
    answer(client, image(data_url("image/png", png(32, 32, (1, 2, 3))[:60])), match="truncated or malformed")
    answer(client, image(data_url("image/jpeg", png())), match="declared 'image/jpeg' but is 'image/png'")
    answer(client, audio(wav(0.2), fmt="mp3"), match="declared 'mp3' but is 'wav'")
    answer(client, image("data:image/png;base64,%%%"), match="base64")
    answer(client, image("ftp://127.0.0.1/a.png"), match="not 'ftp'")
    answer(client, {"type": "image_url", "image_url": {}}, match="the image_url part needs")
    answer(client, {"type": "input_audio", "input_audio": {"format": "wav"}}, match="input_audio part needs")


def test_too_many_items_are_refused_naming_the_limit(client):
    answer(client, *[image(data_url("image/png", png()))] * 3, match="At most 2 image(s)")
    answer(client, audio(wav(0.1)), audio(wav(0.1)), match="--limit-mm-per-prompt")


def test_a_burst_of_hostile_media_leaves_the_stream_its_pace(client, media_host, folders):
    """Bombs, forged audio and slow fetches all at once: every one a 400 in time (the window's teardown holds the
    paced stream to its bars)."""
    parts = [image(data_url("image/png", png_bomb())), image(data_url("image/gif", gif(10_000))),
             audio(forged_rate_wav(20, claimed_rate=1)), image(media_host.url("/slow")),
             image(media_host.url("/stall")), image(media_host.url("/redirect?to=http://localhost/")),
             image(f"file://{folders[1]}/secret.png")]

    async def burst():
        return await asyncio.gather(*[refused(client, part) for part in parts])
    for error, seconds in asyncio.run(burst()):
        assert "takes no" not in error["message"], error
        assert seconds < ANSWER_WITHIN_S, f"{seconds:.1f} s: {error}"


def test_text_chat_still_works_and_tokenize_counts_text_parts_only(served):
    """(Not a hostile case: outside the paced stream's windows.)"""
    client = served[0]
    chat = openai.OpenAI(base_url=client + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chat.choices[0].finish_reason == "length"
    r = httpx.post(client + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": [image(data_url("image/png", png()))]}]})
    assert r.status_code == 400 and "text content parts only" in r.json()["error"]["message"]


# ---- the flags (no server) ----

def test_the_media_flags_make_the_servers_policy(tmp_path, capsys):
    from pressroom.entrypoints.cli import build_parser, main
    from pressroom.entrypoints.openai.settings import ServerSettings
    args = build_parser().parse_args(["serve", "m", "--allowed-media-domains", "a.example", "B.example.",
                                      "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout", "3",
                                      "--limit-mm-per-prompt", '{"image": 2, "audio": 1}'])
    policy = ServerSettings.from_args(args).media_policy
    assert policy.allowed_media_domains == ("a.example", "b.example")
    assert policy.allowed_local_media_path == str(tmp_path) and policy.fetch_timeout == 3.0
    assert (policy.limit("image"), policy.limit("audio"), policy.limit("video")) == (2, 1, 999)
    default = ServerSettings.from_args(build_parser().parse_args(["serve", "m"])).media_policy
    assert default.allowed_media_domains == () and default.allowed_local_media_path == ""
    assert default.fetch_timeout == 5.0 and default.limit("image") == 999
    for flags, message in ((["--limit-mm-per-prompt", "image=2"], "--limit-mm-per-prompt (counts per modality"),
                           (["--allowed-local-media-path", str(tmp_path / "none")], "is not a folder"),
                           (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be positive")):
        assert main(["serve", "m", *flags]) == 2  # before any model is loaded
        assert message in capsys.readouterr().err


# ---- the media threads (no server) ----

def test_one_request_of_slow_urls_leaves_threads_to_the_next_and_fails_fast(media_host):
    """Eight slow URLs in one request take PARTS_AT_ONCE of the media threads, not all: a request after them
    loads its image at once. A request whose bad part fails first is answered then: neither the slow parts beside it
    nor those not started hold the answer."""
    from pressroom.entrypoints.openai.errors import APIError
    from pressroom.entrypoints.openai.protocol import MediaPart
    from pressroom.entrypoints.openai.serving_chat import PARTS_AT_ONCE, MediaLoader
    from pressroom.multimodal.media import MediaPolicy
    loader = MediaLoader(MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout=1.5))

    def part(url: str, index: int = 0) -> MediaPart:
        return MediaPart(0, index, "image_url", url=url)
    slow = [part(media_host.url("/stall"), i) for i in range(8)]

    async def run():
        hog = asyncio.ensure_future(loader.load(slow))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        loaded = await loader.load([part(data_url("image/png", png()))])
        after = time.monotonic() - started
        with pytest.raises(APIError, match="limit of 1.5 s"):
            await hog
        started = time.monotonic()
        with pytest.raises(APIError, match=r"content\[2\].*malformed"):
            await loader.load(slow[:2] + [part(data_url("image/png", png()[:40]), 2)] + slow[2:])
        return loaded, after, time.monotonic() - started
    loaded, after, failed = asyncio.run(run())
    assert loaded[0].value.size == (8, 6) and after < 0.5  # not queued behind the slow ones
    assert failed < 1.0  # the bad part's answer did not wait for the slow ones' timeout
    assert PARTS_AT_ONCE < 8
    loader.close()
