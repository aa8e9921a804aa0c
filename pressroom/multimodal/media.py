"""Media from clients: images, audio and video frames fetched and decoded under a MediaPolicy, with every guard
checked before the costly step it guards (a bomb's pixels from its header before decoding, a download's size and
time while it arrives, an audio clip's duration from the samples as they are decoded).

Where media may come from: data URLs; http(s) only from the policy's allowed domains (each redirect checked
against them too), within a size cap and one time limit for the whole fetch; file:// only under the allowed local
path. Every refusal is a MediaError (a ValueError) whose message names the limit or flag: the server answers it
with a 400. Decoding is blocking work: callers run these loaders off the event loop (the server's media threads).
Pillow, soundfile and PyAV are imported on first use, so that the CLI can read MediaPolicy cheaply."""
from __future__ import annotations

import base64
import binascii
import http.client
import io
import mimetypes
import os
import socket
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes, urljoin, urlsplit
from urllib.request import url2pathname

from pressroom.config import limits_of

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

MODALITIES = ("image", "audio", "video")
ANY_DOMAIN = "*"
DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's for a modality --limit-mm-per-prompt leaves out
MAX_REDIRECTS = 5
# The image containers accepted (Pillow identifies the rest too, but each plugin is attack surface)
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
MAX_SAMPLE_RATE = 768_000  # Hz; past the highest rate any audio format is recorded at
_CHUNK = 1 << 16
_GENERIC_MIMES = ("", "application/octet-stream", "binary/octet-stream")


# ---- errors: each a 400 at the server, its message naming the limit ----

class MediaError(ValueError):
    """Media the server will not use; the message says why, naming the limit or flag."""


class MediaSourceError(MediaError):
    """A URL the policy does not allow: its scheme, domain (or a redirect's), or a path outside the local root."""


class MediaFetchError(MediaError):
    """The media could not be fetched: an HTTP error status, a refused connection, a missing file."""


class MediaTimeoutError(MediaFetchError):
    """The fetch ran past the policy's time limit."""


class MediaSizeError(MediaError):
    """More bytes than the policy's max_bytes (fetched, or decoded audio)."""


class PixelLimitError(MediaError):
    """An image (or video) with more pixels than the cap, found from its header before decoding."""


class FrameLimitError(MediaError):
    """An animated image or video with more frames than the cap."""


class DurationLimitError(MediaError):
    """Audio longer than the cap, counted from the decoded samples and their rate."""


class MalformedMediaError(MediaError):
    """Bytes that are not a whole image, clip or video of an accepted format."""


class MimeMismatchError(MediaError):
    """The declared type (a data URL's, Content-Type, input_audio's format) is not what the bytes are."""


class TooManyMediaError(MediaError):
    """More items of one modality in a prompt than --limit-mm-per-prompt allows."""


# ---- the policy ----

@dataclass(frozen=True, slots=True, kw_only=True)
class MediaPolicy:
    """What the server accepts as media. Flags and defaults are vLLM 0.32's where vLLM has them (its limits that
    are environment variables give the defaults: VLLM_MAX_IMAGE_PIXELS, VLLM_IMAGE_FETCH_TIMEOUT,
    VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB, VLLM_MAX_AUDIO_DECODE_DURATION_S). Unlike vLLM, no --allowed-media-domains
    means no http(s) fetches at all (vLLM fetches from anywhere): a server that fetches any URL a client names
    reaches whatever its network reaches; "*" allows every domain."""
    allowed_media_domains: tuple[str, ...] = ()  # --allowed-media-domains: host names http(s) media may come from
    allowed_local_media_path: str = ""  # --allowed-local-media-path: the folder file:// URLs may read under
    max_image_pixels: int = 178_956_970  # width x height of one image (of all frames kept, for a video)
    max_frames: int = 1000  # frames in an animated image or a video (pressroom's: vLLM has no such cap)
    video_frames: int = 32  # frames sampled from a video, evenly (vLLM's num_frames)
    max_audio_seconds: float = 600.0
    max_bytes: int = 256 << 20  # fetched bytes of one item; decoded audio samples as float32, too
    fetch_timeout: float = 5.0  # seconds for a whole http(s) fetch, redirects included (--media-fetch-timeout)
    limit_per_prompt: Mapping[str, int] = field(default_factory=dict)  # --limit-mm-per-prompt

    def __post_init__(self) -> None:
        for name in ("max_image_pixels", "max_frames", "video_frames", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaPolicy.{name} must be at least 1.")
        if not self.fetch_timeout > 0:
            raise ValueError(f"--media-fetch-timeout must be positive; got {self.fetch_timeout}.")
        if not self.max_audio_seconds > 0:
            raise ValueError("MediaPolicy.max_audio_seconds must be positive.")
        object.__setattr__(self, "limit_per_prompt", limits_of(self.limit_per_prompt))
        object.__setattr__(self, "allowed_media_domains",
                           tuple(_host(d) if d != ANY_DOMAIN else d for d in self.allowed_media_domains))
        root = self.allowed_local_media_path
        if root and not Path(root).is_dir():
            raise ValueError(f"--allowed-local-media-path {root!r} is not a folder.")

    def limit(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)

    def allows_domain(self, host: str) -> bool:
        return ANY_DOMAIN in self.allowed_media_domains or _host(host) in self.allowed_media_domains


def check_counts(counts: Mapping[str, int], policy: MediaPolicy) -> None:
    """TooManyMediaError for a modality with more items in one prompt than the policy's limit."""
    for modality, count in counts.items():
        limit = policy.limit(modality)
        if count > limit:
            raise TooManyMediaError(f"At most {limit} {modality}(s) may be provided in one prompt "
                                    f"(--limit-mm-per-prompt); this one has {count}.")


# ---- fetching: bytes and their declared type ----

@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    mime: str  # the declared type, lower case, no parameters ("" when none was declared)


def fetch(url: str, policy: MediaPolicy) -> Fetched:
    """The bytes a media URL names: data:, http(s): (allowed domains only) or file: (under the allowed path)."""
    if not isinstance(url, str) or not url:
        raise MalformedMediaError("A media URL must be a non-empty string.")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, policy)
    if scheme in ("http", "https"):
        return _fetch_http(url, policy)
    if scheme == "file":
        return _read_local(url, policy)
    raise MediaSourceError("Media URLs may be data:, http(s): (from --allowed-media-domains) or file: (under "
                           f"--allowed-local-media-path); not {scheme or 'a relative URL'!r}.")


def _mime(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def _data_url(url: str, policy: MediaPolicy) -> Fetched:
    head, comma, payload = url[5:].partition(",")
    if not comma:
        raise MalformedMediaError("A data URL needs a comma before its data (data:<type>;base64,<data>).")
    params = [p.strip().lower() for p in head.split(";")]
    if "base64" in params[1:]:
        return Fetched(decode_base64(payload, policy), _mime(params[0]))
    data = unquote_to_bytes(payload)
    _check_bytes(len(data), policy)
    return Fetched(data, _mime(params[0]))


def decode_base64(payload: str, policy: MediaPolicy) -> bytes:
    """Base64 text as bytes, its size checked before it is decoded (line breaks, as MIME encoders wrap it, are
    allowed; any other character outside the alphabet is malformed)."""
    _check_bytes(len(payload) * 3 // 4, policy)
    if any(c in payload for c in "\r\n \t"):
        payload = "".join(payload.split())
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedMediaError("The media's base64 data is malformed.") from None


def _check_bytes(size: int, policy: MediaPolicy) -> None:
    if size > policy.max_bytes:
        raise MediaSizeError(f"The media is larger than the server's limit of {policy.max_bytes} bytes.")


def _host(name: str) -> str:
    return name.strip().lower().strip("[]").removesuffix(".")


def _fetch_http(url: str, policy: MediaPolicy) -> Fetched:
    """GET `url`, following redirects whose targets are allowed too, all within policy.fetch_timeout."""
    deadline = time.monotonic() + policy.fetch_timeout
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise MediaSourceError("A media redirect may lead only to another http(s) URL.")
        if not policy.allows_domain(parts.hostname):
            raise MediaSourceError(f"Media URLs must come from the server's --allowed-media-domains; "
                                   f"{parts.hostname!r} is not one of them"
                                   + ("" if policy.allowed_media_domains else " (none are allowed)") + ".")
        status, location, fetched = _get(url, deadline, policy)
        if location is None:
            if status != 200:
                raise MediaFetchError(f"The media URL answered HTTP {status}.")
            return fetched
        url = urljoin(url, location)
    raise MediaSourceError(f"The media URL redirected more than {MAX_REDIRECTS} times.")


class _Watchdog:
    """Shuts a connection's socket at the deadline, so that a server that trickles bytes (each read within the
    socket's timeout) still cannot hold a fetch past it. It holds the socket itself: http.client hands it to the
    response (and forgets it) when the server will close the connection."""

    def __init__(self, seconds: float) -> None:
        self.sock: socket.socket | None = None
        self.fired = False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def watch(self, sock: socket.socket) -> None:
        self.sock = sock
        if self.fired:
            self._fire()

    def _fire(self) -> None:
        self.fired = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self.timer.cancel()


def _get(url: str, deadline: float, policy: MediaPolicy) -> tuple[int, str | None, Fetched]:
    """One GET: (status, the redirect's Location or None, the body when there is no redirect)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timeout(policy)
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    try:
        conn = kind(parts.hostname, parts.port, timeout=remaining)
    except ValueError:
        raise MediaSourceError("The media URL's port is malformed.") from None
    watchdog = _Watchdog(remaining)
    try:
        conn.connect()
        watchdog.watch(conn.sock)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"User-Agent": "pressroom", "Accept-Encoding": "identity"})
        response = conn.getresponse()
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            if not location:
                raise MediaFetchError(f"The media URL answered HTTP {response.status} without a Location.")
            return response.status, location, Fetched(b"", "")
        declared = response.getheader("Content-Length")
        if declared and declared.isdigit():
            _check_bytes(int(declared), policy)
        body = bytearray()
        while chunk := response.read1(_CHUNK):
            body += chunk
            _check_bytes(len(body), policy)
        if watchdog.fired or time.monotonic() > deadline:
            raise _timeout(policy)
        return response.status, None, Fetched(bytes(body), _mime(response.getheader("Content-Type")))
    except MediaError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if watchdog.fired or isinstance(e, TimeoutError):
            raise _timeout(policy) from None
        raise MediaFetchError(f"The media URL could not be fetched ({type(e).__name__}).") from None
    finally:
        watchdog.cancel()
        conn.close()


def _timeout(policy: MediaPolicy) -> MediaTimeoutError:
    return MediaTimeoutError(f"Fetching the media took longer than the server's limit of {policy.fetch_timeout:g} s.")


def _read_local(url: str, policy: MediaPolicy) -> Fetched:
    """A file:// URL's bytes, when the file lies under the allowed path (symbolic links resolved first). The
    messages never name the server's paths."""
    if not policy.allowed_local_media_path:
        raise MediaSourceError("file:// media URLs are refused: the server runs without --allowed-local-media-path.")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaSourceError("A file:// media URL may name only this machine (file:///path).")
    root = Path(policy.allowed_local_media_path).resolve()
    path = Path(url2pathname(parts.path)).resolve()
    if path != root and root not in path.parents:
        raise MediaSourceError("The file:// media URL is outside the server's --allowed-local-media-path.")
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block or never end
            raise MediaSourceError("A file:// media URL must name a regular file.")
        _check_bytes(info.st_size, policy)
        with open(path, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError:
        raise MediaFetchError("The file:// media URL names no readable file.") from None
    _check_bytes(len(data), policy)
    return Fetched(data, _mime(mimetypes.guess_type(path.name)[0]))


# ---- images ----

def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """An image_url's image, as RGB (the first frame of an animated one)."""
    fetched = fetch(url, policy)
    return decode_image(fetched.data, policy, fetched.mime)


_IMAGE_MIME_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-ms-bmp": "image/bmp",
                       "image/x-bmp": "image/bmp", "image/tif": "image/tiff"}


def decode_image(data: bytes, policy: MediaPolicy, mime: str = "") -> Image.Image:
    """Bytes as an RGB image: the format identified, the declared type matched against it, the pixel and frame
    caps checked from the header, and only then the pixels decoded."""
    from PIL import Image, UnidentifiedImageError
    if mime not in _GENERIC_MIMES and not mime.startswith("image/"):
        raise MimeMismatchError(f"An image was expected; the media was declared {mime!r}.")
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise MalformedMediaError(f"The image is not one of the accepted formats ({', '.join(IMAGE_FORMATS)}) "
                                  "or is malformed.") from None
    except Image.DecompressionBombError:  # Pillow's own cap, past twice Image.MAX_IMAGE_PIXELS, came first
        limit = min(policy.max_image_pixels, 2 * (Image.MAX_IMAGE_PIXELS or policy.max_image_pixels))
        raise PixelLimitError(f"The image has more pixels than the server's limit of {limit}.") from None
    except Exception:  # a decoder's failure on a client's bytes, whatever its type
        raise MalformedMediaError("The image's header is malformed.") from None
    actual = Image.MIME.get(image.format or "", "")
    if mime not in _GENERIC_MIMES and _IMAGE_MIME_ALIASES.get(mime, mime) != actual:
        raise MimeMismatchError(f"The image was declared {mime!r} but is {actual or image.format!r}.")
    width, height = image.size
    _check_pixels(width, height, 1, policy, "image")
    try:
        _check_frames(image, policy)
        image.seek(0)
        image.load()
        return _rgb(image)
    except MediaError:
        raise
    except Exception:  # a decoder's failure on a client's bytes, whatever its type
        raise MalformedMediaError("The image is truncated or malformed.") from None


def _check_pixels(width: int, height: int, frames: int, policy: MediaPolicy, what: str) -> None:
    if width * height * frames > policy.max_image_pixels:
        shape = f"{width}x{height}" + (f"x{frames} frames" if frames > 1 else "")
        raise PixelLimitError(f"The {what} has {width * height * frames} pixels ({shape}); the server's limit is "
                              f"{policy.max_image_pixels}.")


def _check_frames(image: Image.Image, policy: MediaPolicy) -> None:
    """Walks an animated image's frames up to the cap (never past it: a GIF of 10^4 frames costs max_frames
    seeks), each seek within the pixel cap over all frames walked."""
    if not getattr(image, "is_animated", False):
        return
    width, height = image.size
    frame = 1
    while True:
        try:
            image.seek(frame)
        except EOFError:
            return
        frame += 1
        if frame > policy.max_frames:
            raise FrameLimitError(f"The image has more than {policy.max_frames} frames, the server's limit.")
        _check_pixels(width, height, frame, policy, "animated image")


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency laid over white (as vLLM converts RGBA)."""
    from PIL import Image
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# ---- audio ----

_AUDIO_MIMES = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
                "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
                "audio/ogg": "ogg", "application/ogg": "ogg", "audio/vorbis": "ogg", "audio/opus": "ogg",
                "audio/mp4": "m4a", "audio/x-m4a": "m4a", "audio/m4a": "m4a", "audio/aac": "aac",
                "audio/webm": "webm"}


def load_audio(url: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """An audio URL's clip (an audio_url part): (mono float32 samples, sample rate)."""
    fetched = fetch(url, policy)
    declared = None
    if fetched.mime not in _GENERIC_MIMES:
        declared = _AUDIO_MIMES.get(fetched.mime)
        if declared is None:
            raise MimeMismatchError(f"Audio was expected; the URL's type is {fetched.mime!r}.")
    return decode_audio(fetched.data, policy, declared)


def load_audio_base64(data: str, audio_format: str | None, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """An input_audio part's clip: base64 data in `audio_format` (wav, mp3, flac or ogg)."""
    if audio_format is not None and audio_format.lower() not in AUDIO_FORMATS:
        raise MalformedMediaError(f"input_audio's format must be one of {', '.join(AUDIO_FORMATS)}; "
                                  f"got {audio_format!r}.")
    return decode_audio(decode_base64(data, policy), policy, audio_format.lower() if audio_format else None)


def sniff_audio(data: bytes) -> str | None:
    """The container of audio bytes from their magic numbers: wav, flac, ogg, mp3, aac (ADTS), m4a (MP4) or webm
    (Matroska); None for anything else."""
    if data[:4] in (b"RIFF", b"RIFX", b"RF64") and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[4:8] == b"ftyp":
        return "m4a"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if len(data) > 1 and data[0] == 0xFF and data[1] & 0xF0 == 0xF0 and data[1] & 0x06 == 0:
        return "aac"  # ADTS: MPEG's frame sync with layer bits 00
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def decode_audio(data: bytes, policy: MediaPolicy, declared: str | None = None) -> tuple[np.ndarray, int]:
    """Audio bytes as (mono float32 samples, sample rate): soundfile first, PyAV for what it cannot read. The
    duration cap is counted from the samples as they are decoded, at the rate the samples are played at, never
    from the header's length: decoding stops at the cap. A header's rate that is absurd (0, or a forged tiny rate
    that would make a model's resampling of the clip enormous) fails the same count: a clip at 1 Hz has its
    max_audio_seconds after that many samples."""
    sniffed = sniff_audio(data)
    if declared is not None and sniffed is not None and sniffed != declared:
        raise MimeMismatchError(f"The audio was declared {declared!r} but is {sniffed!r}.")
    try:
        return _decode_soundfile(data, policy)
    except _Unreadable:
        return _decode_av(data, policy)


class _Unreadable(Exception):
    """soundfile cannot read these bytes (PyAV may)."""


def _decode_soundfile(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    import numpy as np
    import soundfile
    try:
        clip = soundfile.SoundFile(io.BytesIO(data))
    except Exception:  # not a format libsndfile reads (or not audio at all): PyAV's turn
        raise _Unreadable from None
    with clip:
        rate = _check_rate(clip.samplerate)
        cap = _SampleCap(rate, policy)
        chunks = []
        try:
            while len(block := clip.read(_CHUNK, dtype="float32", always_2d=True)):
                chunks.append(cap.add(block.mean(axis=1, dtype=np.float32)))
        except MediaError:
            raise
        except Exception:  # a decoder's failure on a client's bytes, whatever its type
            raise MalformedMediaError("The audio is truncated or malformed.") from None
    return cap.samples(chunks), rate


def _decode_av(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """What soundfile cannot read, through FFmpeg: each decoded frame mixed to mono float32 at its own rate."""
    import av
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # a decoder's failure on a client's bytes, whatever its type
        raise MalformedMediaError(f"The audio is not one of the accepted formats ({', '.join(AUDIO_FORMATS)}) "
                                  "or is malformed.") from None
    with container:
        if not container.streams.audio:
            raise MalformedMediaError("The audio has no audio stream.")
        cap, chunks = None, []
        try:
            for frame in container.decode(container.streams.audio[0]):
                if cap is None:
                    cap = _SampleCap(_check_rate(frame.sample_rate), policy)
                    mixer = av.AudioResampler(format="flt", layout="mono", rate=cap.rate)
                elif frame.sample_rate != cap.rate:
                    raise MalformedMediaError("The audio changes its sample rate midway.")
                chunks += [cap.add(out.to_ndarray()[0]) for out in mixer.resample(frame)]
            if cap is not None:
                chunks += [cap.add(out.to_ndarray()[0]) for out in mixer.resample(None)]
        except MediaError:
            raise
        except Exception:
            raise MalformedMediaError("The audio is truncated or malformed.") from None
    if cap is None:
        raise MalformedMediaError("The audio has no samples.")
    return cap.samples(chunks), cap.rate


def _check_rate(rate: int) -> int:
    if not 0 < rate <= MAX_SAMPLE_RATE:
        raise MalformedMediaError(f"The audio's sample rate {rate} Hz is outside 1 to {MAX_SAMPLE_RATE} Hz.")
    return int(rate)


class _SampleCap:
    """Counts decoded samples against the duration cap (at the clip's own rate) and the decoded-bytes cap."""

    def __init__(self, rate: int, policy: MediaPolicy) -> None:
        self.rate, self.policy, self.count = rate, policy, 0
        self.limit = min(int(policy.max_audio_seconds * rate), policy.max_bytes // 4)

    def add(self, mono: np.ndarray) -> np.ndarray:
        self.count += len(mono)
        if self.count > self.limit:
            seconds = self.count / self.rate
            if seconds > self.policy.max_audio_seconds:
                raise DurationLimitError(f"The audio lasts more than the server's limit of "
                                         f"{self.policy.max_audio_seconds:g} s (over {seconds:.0f} s at its "
                                         f"{self.rate} Hz).")
            raise MediaSizeError(f"The decoded audio is larger than the server's limit of {self.policy.max_bytes} "
                                 "bytes.")
        return mono

    def samples(self, chunks: list[np.ndarray]) -> np.ndarray:
        import numpy as np
        if not self.count:
            raise MalformedMediaError("The audio has no samples.")
        return np.concatenate(chunks).astype(np.float32, copy=False)


# ---- video ----

def load_video(url: str, policy: MediaPolicy, with_metadata: bool = False):
    """A video_url's frames: policy.video_frames of them, evenly spaced, as uint8 RGB (frames, height, width, 3);
    `with_metadata`: (frames, metadata) as decode_video gives them."""
    fetched = fetch(url, policy)
    if fetched.mime not in _GENERIC_MIMES and not fetched.mime.startswith("video/") and fetched.mime != "image/gif":
        raise MimeMismatchError(f"A video was expected; the URL's type is {fetched.mime!r}.")
    return decode_video(fetched.data, policy, with_metadata)


def decode_video(data: bytes, policy: MediaPolicy, with_metadata: bool = False):
    """Video bytes as sampled RGB frames. The frame size is checked from the stream's header (and each decoded
    frame's own size) against the pixel cap over the frames kept; decoding stops past max_frames. Frames are
    kept at a stride that doubles whenever 2 x video_frames are held (the header's frame count is not trusted),
    then video_frames of them picked evenly. `with_metadata`: (frames, vLLM's and HF's video metadata: the
    stream's `fps` where it has one, `frames_indices` of the frames kept, `total_num_frames` decoded), from which
    a model's processor finds the sampled frames' rate (Qwen2.5-VL's M-RoPE time axis)."""
    import av
    import numpy as np
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # a decoder's failure on a client's bytes, whatever its type
        raise MalformedMediaError("The video is not a video format the server reads, or is malformed.") from None
    count = policy.video_frames
    with container:
        if not container.streams.video:
            raise MalformedMediaError("The video has no video stream.")
        stream = container.streams.video[0]
        context = stream.codec_context
        if context is None:
            raise MalformedMediaError("The video's stream has no codec.")
        _check_pixels(context.width, context.height, count, policy, "video")
        rate = stream.average_rate or stream.guessed_rate
        kept, indices, stride, total = [], [], 1, 0
        try:
            for seen, frame in enumerate(container.decode(stream)):
                if seen >= policy.max_frames:
                    raise FrameLimitError(f"The video has more than {policy.max_frames} frames, the server's limit.")
                _check_pixels(frame.width, frame.height, count, policy, "video")
                total = seen + 1
                if seen % stride == 0:
                    kept.append(frame.to_ndarray(format="rgb24"))
                    indices.append(seen)
                if len(kept) == 2 * count:
                    kept, indices, stride = kept[::2], indices[::2], 2 * stride
        except MediaError:
            raise
        except Exception:
            raise MalformedMediaError("The video is truncated or malformed.") from None
    if not kept:
        raise MalformedMediaError("The video has no frames.")
    if len({f.shape for f in kept}) > 1:
        raise MalformedMediaError("The video's frames change size midway.")
    picked = _even_indices(len(kept), count)
    frames = np.stack([kept[i] for i in picked])
    if not with_metadata:
        return frames
    metadata = {"frames_indices": [indices[i] for i in picked], "total_num_frames": total}
    if rate and float(rate) > 0:
        metadata["fps"] = float(rate)
    return frames, metadata


def _even_indices(total: int, count: int) -> list[int]:
    if total <= count:
        return list(range(total))
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)}) if count > 1 else [0]
