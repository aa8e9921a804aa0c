"""multimodal/media.py: media loaded under a MediaPolicy, each guard against the hostile file it exists for (built
here), each refusal a MediaError (a ValueError) whose message names the limit; and the sources: data URLs,
http(s) from the allowed domains only (redirects too, within a size and time limit, against a loopback server),
file:// under the allowed path only."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hostile_media import (
    apng,
    data_url,
    forged_rate_wav,
    gif,
    jpeg,
    m4a_tone,
    media_server,
    mp4_video,
    png,
    png_bomb,
    wav,
)

from pressroom.config import limits_of
from pressroom.multimodal import media
from pressroom.multimodal.media import (
    DurationLimitError,
    FrameLimitError,
    MalformedMediaError,
    MediaError,
    MediaFetchError,
    MediaPolicy,
    MediaSizeError,
    MediaSourceError,
    MediaTimeoutError,
    MimeMismatchError,
    PixelLimitError,
    TooManyMediaError,
)

POLICY = MediaPolicy()


# ---- images ----

def test_a_data_url_png_loads_as_rgb_with_its_transparency_over_white():
    image = media.load_image(data_url("image/png", png(8, 6, (255, 0, 0, 128))), POLICY)
    assert image.size == (8, 6) and image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 127, 127)  # half red over white
    assert media.load_image(data_url("image/jpeg", jpeg()), POLICY).size == (8, 6)
    assert media.load_image(data_url("image/jpg", jpeg()), POLICY).mode == "RGB"  # a common alias
    assert media.load_image(data_url("application/octet-stream", png()), POLICY).size == (8, 6)


@pytest.mark.parametrize("cap", [None, 10**12])
def test_a_decompression_bomb_is_refused_from_its_header(cap):
    """10^10 pixels claimed: refused before any pixel is decoded (30 GB), with our cap or Pillow's own above it."""
    policy = POLICY if cap is None else MediaPolicy(max_image_pixels=cap)
    started = time.monotonic()
    with pytest.raises(PixelLimitError, match="178956970"):
        media.load_image(data_url("image/png", png_bomb()), policy)
    assert time.monotonic() - started < 0.5


def test_the_pixel_cap_is_the_policys_and_names_its_limit():
    with pytest.raises(PixelLimitError, match=r"4800 pixels \(80x60\).*limit is 1000"):
        media.decode_image(png(80, 60), MediaPolicy(max_image_pixels=1000))
    assert media.decode_image(png(80, 60), MediaPolicy(max_image_pixels=4800)).size == (80, 60)


def test_a_gif_of_ten_thousand_frames_is_refused_at_the_frame_cap():
    bomb = gif(10_000)
    started = time.monotonic()
    with pytest.raises(FrameLimitError, match="more than 1000 frames"):
        media.decode_image(bomb, POLICY)
    assert time.monotonic() - started < 1.0
    assert media.decode_image(gif(3), POLICY).size == (1, 1)  # an animation within the cap: its first frame
    with pytest.raises(FrameLimitError, match="more than 2 frames"):
        media.decode_image(gif(3), MediaPolicy(max_frames=2))


def test_an_apng_past_the_frame_cap_is_refused():
    with pytest.raises(FrameLimitError, match="more than 1000 frames"):
        media.decode_image(apng(2000), POLICY)
    assert media.load_image(data_url("image/png", apng(3)), POLICY).getpixel((0, 0)) == (0, 0, 0)


def test_an_animations_pixels_count_over_its_frames():
    with pytest.raises(PixelLimitError, match="1x1x3 frames"):
        media.decode_image(gif(5), MediaPolicy(max_image_pixels=2))


@pytest.mark.parametrize("cut", [10, 40, 100])
def test_a_truncated_image_is_malformed(cut):
    whole = png(64, 64, (10, 200, 30))
    with pytest.raises(MalformedMediaError):
        media.decode_image(whole[:cut], POLICY)


def test_bytes_that_are_no_image_or_an_unaccepted_format_are_malformed():
    with pytest.raises(MalformedMediaError, match="accepted formats"):
        media.decode_image(b"hello, world" * 10, POLICY)
    with pytest.raises(MalformedMediaError, match="accepted formats"):
        media.decode_image(wav(0.1), POLICY)


def test_a_declared_type_that_is_not_what_the_bytes_are_is_a_mismatch():
    with pytest.raises(MimeMismatchError, match="declared 'image/jpeg' but is 'image/png'"):
        media.load_image(data_url("image/jpeg", png()), POLICY)
    with pytest.raises(MimeMismatchError, match="image was expected.*'text/html'"):
        media.load_image(data_url("text/html", png()), POLICY)


def test_data_urls_over_the_byte_cap_or_with_bad_base64_are_refused():
    with pytest.raises(MediaSizeError, match="limit of 100 bytes"):
        media.load_image(data_url("image/png", png(64, 64, (1, 2, 3))), MediaPolicy(max_bytes=100))
    with pytest.raises(MalformedMediaError, match="base64"):
        media.load_image("data:image/png;base64,iVBOR!!!", POLICY)
    wrapped = data_url("image/png", png())
    head, body = wrapped.split(",", 1)
    wrapped = head + "," + "\n".join(body[i:i + 76] for i in range(0, len(body), 76))  # as MIME wraps it
    assert media.load_image(wrapped, POLICY).size == (8, 6)
    with pytest.raises(MalformedMediaError, match="comma"):
        media.load_image("data:image/png;base64", POLICY)


def test_unknown_schemes_are_refused():
    for url in ("ftp://example.com/a.png", "gopher://x/", "a.png", "javascript:alert(1)"):
        with pytest.raises(MediaSourceError):
            media.load_image(url, POLICY)


# ---- audio ----

@pytest.mark.parametrize("fmt,declared", [("WAV", "wav"), ("FLAC", "flac"), ("OGG", "ogg")])
def test_audio_decodes_to_mono_float32_at_its_rate(fmt, declared):
    samples, rate = media.load_audio_base64(_b64(wav(0.5, 16_000, fmt)), declared, POLICY)
    assert rate == 16_000 and samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 8000) <= 64
    assert 0.25 < float(np.abs(samples).max()) < 0.35  # the tone's amplitude, scaled to [-1, 1]


def test_what_soundfile_cannot_read_is_decoded_by_pyav():
    samples, rate = media.decode_audio(m4a_tone(1.0), POLICY)
    assert rate == 16_000 and samples.dtype == np.float32
    assert 15_000 < len(samples) < 18_000 and 0.25 < float(np.abs(samples).max()) < 0.35


def test_a_forged_tiny_sample_rate_fails_the_duration_cap_from_the_samples():
    """An hour of 16 kHz audio whose header says 1 Hz: its samples at the rate they would be played (and
    resampled) at last 57.6 million seconds. Refused after decoding 600 samples, not 57.6 million."""
    forged = forged_rate_wav(3600, claimed_rate=1)
    started = time.monotonic()
    with pytest.raises(DurationLimitError, match="limit of 600 s.*at its 1 Hz"):
        media.decode_audio(forged, POLICY, "wav")
    assert time.monotonic() - started < 0.5


def test_an_hour_of_audio_at_its_real_rate_fails_the_duration_cap():
    with pytest.raises(DurationLimitError, match="limit of 600 s"):
        media.decode_audio(forged_rate_wav(3600, claimed_rate=16_000), POLICY)
    with pytest.raises(DurationLimitError, match="limit of 0.25 s"):
        media.decode_audio(wav(0.5), MediaPolicy(max_audio_seconds=0.25))


def test_a_sample_rate_of_zero_is_malformed():
    with pytest.raises(MalformedMediaError):
        media.decode_audio(forged_rate_wav(1, claimed_rate=0), POLICY)


def test_truncated_or_garbage_audio_is_malformed():
    whole = wav(0.5)
    for bad in (whole[:20], whole[:43], b"RIFF\xff\xff\xff\xffWAVEjunk" * 4, os.urandom(256)):
        with pytest.raises(MalformedMediaError):
            media.decode_audio(bad, POLICY)


def test_audio_declared_as_another_format_is_a_mismatch():
    with pytest.raises(MimeMismatchError, match="declared 'mp3' but is 'wav'"):
        media.load_audio_base64(_b64(wav(0.1)), "mp3", POLICY)
    with pytest.raises(MimeMismatchError, match="'image/png'"):
        media.load_audio(data_url("image/png", wav(0.1)), POLICY)
    with pytest.raises(MimeMismatchError, match="declared 'mp3' but is 'm4a'"):  # what PyAV would have read
        media.load_audio_base64(_b64(m4a_tone(0.1)), "mp3", POLICY)
    assert media.load_audio(data_url("audio/mp4", m4a_tone(0.1)), POLICY)[1] == 16_000
    with pytest.raises(MalformedMediaError, match="format must be one of"):
        media.load_audio_base64(_b64(wav(0.1)), "exe", POLICY)


def _b64(data: bytes) -> str:
    return data_url("x/y", data).split(",", 1)[1]


# ---- video ----

def test_a_video_gives_its_sampled_frames():
    frames = media.load_video(data_url("video/mp4", mp4_video(40)), POLICY)
    assert frames.shape == (32, 24, 32, 3) and frames.dtype == np.uint8
    first, last = int(frames[0].mean()), int(frames[-1].mean())
    assert first < 20 and last > 200  # evenly from the first frame to the last


def test_a_video_past_the_frame_or_pixel_cap_is_refused():
    video = mp4_video(40)
    with pytest.raises(FrameLimitError, match="more than 10 frames"):
        media.decode_video(video, MediaPolicy(max_frames=10))
    with pytest.raises(PixelLimitError, match="32x24x32 frames"):
        media.decode_video(video, MediaPolicy(max_image_pixels=32 * 24 * 10))
    with pytest.raises(MalformedMediaError):
        media.decode_video(video[: len(video) // 3], POLICY)


# ---- the per-prompt limit ----

def test_the_limit_per_prompt_parses_as_vllm_spells_it_and_names_itself():
    policy = MediaPolicy(limit_per_prompt=limits_of(
        '{"image": 2, "audio": 0, "video": {"count": 1, "num_frames": 8}}'))
    assert (policy.limit("image"), policy.limit("audio"), policy.limit("video")) == (2, 0, 1)
    assert MediaPolicy().limit("image") == 999  # vLLM's default
    media.check_counts({"image": 2, "video": 1}, policy)
    with pytest.raises(TooManyMediaError, match=r"At most 2 image\(s\).*--limit-mm-per-prompt.*has 3"):
        media.check_counts({"image": 3}, policy)
    with pytest.raises(TooManyMediaError, match=r"At most 0 audio"):
        media.check_counts({"audio": 1}, policy)
    for bad in ("image=2", '{"image": -1}', '["image"]', '{"image": true}', '{"image": 1.5}'):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            limits_of(bad)


def test_every_refusal_is_a_value_error():
    for error in (MediaSourceError, MediaFetchError, MediaTimeoutError, MediaSizeError, PixelLimitError,
                  FrameLimitError, DurationLimitError, MalformedMediaError, MimeMismatchError, TooManyMediaError):
        assert issubclass(error, MediaError) and issubclass(error, ValueError)


# ---- file:// ----

def test_file_urls_only_under_the_allowed_path(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_media_path=str(root))
    assert media.load_image(f"file://{root}/a.png", policy).size == (8, 6)
    for url in (f"file://{tmp_path}/secret.png", f"file://{root}/../secret.png", f"file://{root}/escape.png",
                "file:///etc/passwd"):
        with pytest.raises(MediaSourceError, match="outside the server's --allowed-local-media-path") as e:
            media.load_image(url, policy)
        assert str(tmp_path) not in str(e.value)  # the server's paths are not told
    with pytest.raises(MediaSourceError, match="without --allowed-local-media-path"):
        media.load_image(f"file://{root}/a.png", POLICY)
    with pytest.raises(MediaSourceError, match="only this machine"):
        media.load_image(f"file://other-host{root}/a.png", policy)
    with pytest.raises(MediaFetchError, match="no readable file"):
        media.load_image(f"file://{root}/missing.png", policy)
    with pytest.raises(MediaSourceError, match="regular file"):
        media.load_image(f"file://{root}", policy)
    with pytest.raises(MediaSizeError):
        media.load_image(f"file://{root}/a.png", MediaPolicy(allowed_local_media_path=str(root), max_bytes=10))
    with pytest.raises(ValueError, match="not a folder"):
        MediaPolicy(allowed_local_media_path=str(root / "a.png"))


# ---- http(s) ----

@pytest.fixture(scope="module")
def server():
    files = {"/a.png": ("image/png", png()), "/a.wav": ("audio/wav", wav(0.2)), "/big.png": ("image/png", png_bomb()),
             "/mislabelled.png": ("image/jpeg", png()), "/page": ("text/html", b"<html></html>")}
    with media_server(files) as s:
        yield s


def _allowing(*domains: str, **fields) -> MediaPolicy:
    return MediaPolicy(allowed_media_domains=domains, **fields)


def test_http_from_an_allowed_domain_loads(server):
    policy = _allowing("127.0.0.1")
    assert media.load_image(server.url("/a.png"), policy).size == (8, 6)
    samples, rate = media.load_audio(server.url("/a.wav"), policy)
    assert rate == 16_000 and len(samples) == 3200
    assert media.load_image(server.url("/a.png"), _allowing("*")).size == (8, 6)


def test_http_outside_the_allowed_domains_is_refused_without_a_connection(server):
    with pytest.raises(MediaSourceError, match="'localhost' is not one of them"):
        media.load_image(server.url("/a.png", host="localhost"), _allowing("127.0.0.1"))
    with pytest.raises(MediaSourceError, match="none are allowed"):
        media.load_image(server.url("/a.png"), POLICY)


def test_a_redirect_is_checked_against_the_allowed_domains(server):
    policy = _allowing("127.0.0.1")
    allowed = server.url("/redirect?to=" + server.url("/a.png"))
    assert media.load_image(allowed, policy).size == (8, 6)
    relative = server.url("/redirect?to=/a.png")
    assert media.load_image(relative, policy).size == (8, 6)
    for target in (server.url("/a.png", host="localhost"), "http://169.254.169.254/latest/meta-data/"):
        with pytest.raises(MediaSourceError, match="is not one of them"):
            media.load_image(server.url("/redirect?to=" + target), policy)
    with pytest.raises(MediaSourceError, match="another http"):
        media.load_image(server.url("/redirect?to=file:///etc/passwd"), policy)
    chain = lambda hops: server.url("/redirect?to=" * hops + "/a.png")  # noqa: E731
    assert media.load_image(chain(5), policy).size == (8, 6)
    with pytest.raises(MediaSourceError, match="more than 5 times"):
        media.load_image(chain(6), policy)


@pytest.mark.parametrize("path", ["/slow", "/stall"])
def test_a_slow_server_times_out_at_the_policys_limit(server, path):
    """/slow trickles a byte every 0.2 s (each read within any per-read timeout), /stall never answers: both end
    at the one limit for the whole fetch."""
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError, match="limit of 0.6 s"):
        media.load_image(server.url(path), _allowing("127.0.0.1", fetch_timeout=0.6))
    assert 0.5 < time.monotonic() - started < 1.5


def test_http_errors_sizes_and_types(server):
    policy = _allowing("127.0.0.1")
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        media.load_image(server.url("/missing.png"), policy)
    with pytest.raises(MediaSizeError, match="limit of 50 bytes"):  # from Content-Length, before the body
        media.load_image(server.url("/a.png"), _allowing("127.0.0.1", max_bytes=50))
    with pytest.raises(PixelLimitError):
        media.load_image(server.url("/big.png"), policy)
    with pytest.raises(MimeMismatchError):
        media.load_image(server.url("/mislabelled.png"), policy)
    with pytest.raises(MimeMismatchError):
        media.load_image(server.url("/page"), policy)
    with pytest.raises(MediaFetchError, match="could not be fetched"):
        media.load_image("http://127.0.0.1:1/a.png", policy)  # nothing listens on port 1


# ---- mutated files: whatever the decoders make of them, a MediaError or a result ----

def _mutated(data: bytes, rng) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(len(out))
        roll = rng.random()
        if roll < 0.6:
            out[at] = rng.randrange(256)
        elif roll < 0.8:
            del out[at:at + rng.randint(1, 64)]
        else:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(out)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns of an invalid APNG before refusing it
def test_mutated_media_give_media_errors_only():
    """A decoder's own exceptions (struct.error, AttributeError, ...) on broken bytes would be a 500 or, offline,
    an unexpected type: each becomes a MalformedMediaError. 40 mutations of each format, a fixed seed."""
    import random
    rng = random.Random(47)
    seeds = [(png(16, 16, (1, 2, 3)), media.decode_image), (jpeg(16, 16), media.decode_image),
             (gif(3), media.decode_image), (apng(3), media.decode_image), (wav(0.1), media.decode_audio),
             (wav(0.1, fmt="FLAC"), media.decode_audio), (wav(0.1, fmt="OGG"), media.decode_audio),
             (m4a_tone(0.1), media.decode_audio), (mp4_video(4), media.decode_video)]
    refused = 0
    for data, decode in seeds:
        for _ in range(40):
            try:
                decode(_mutated(data, rng), POLICY)
            except MediaError:
                refused += 1
    assert refused > 100  # most mutations break the file
