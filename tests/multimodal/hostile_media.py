"""Media files built in the tests, good and hostile (issue 47's guards), and a loopback HTTP server that serves
them, redirects and stalls. Shared by tests/multimodal/test_media.py and the server's hostile-media suite."""
from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png(width: int = 8, height: int = 6, color: tuple[int, ...] = (255, 0, 0, 128)) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGBA" if len(color) == 4 else "RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def jpeg(width: int = 8, height: int = 6) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (width, height), (0, 128, 255)).save(out, "JPEG")
    return out.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 100_000) -> bytes:
    """A PNG whose header claims side x side RGB pixels (10^10 by default: 30 GB decoded) over a few bytes of data."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def gif(frames: int) -> bytes:
    """A 1x1 GIF of `frames` frames, written by hand (Pillow's writer merges identical frames)."""
    frame = (b"\x21\xf9\x04\x00\x01\x00\x00\x00"  # graphic control: a 10 ms delay
             + b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00"  # the frame's descriptor
             + b"\x02\x02\x44\x01\x00")  # LZW: clear, pixel 0, end
    return b"GIF89a" + struct.pack("<HH", 1, 1) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff" + frame * frames + b";"


def apng(frames: int) -> bytes:
    """An animated PNG of `frames` 1x1 frames (alternating colours: Pillow merges identical ones)."""
    from PIL import Image
    images = [Image.new("RGB", (1, 1), (255 * (i % 2), 0, 0)) for i in range(frames)]
    out = io.BytesIO()
    images[0].save(out, "PNG", save_all=True, append_images=images[1:])
    return out.getvalue()


def wav(seconds: float = 1.0, rate: int = 16_000, fmt: str = "WAV") -> bytes:
    """A 440 Hz tone as 16-bit PCM in `fmt` (WAV, FLAC, OGG: soundfile's names)."""
    import soundfile
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    out = io.BytesIO()
    soundfile.write(out, tone, rate, format=fmt, subtype="VORBIS" if fmt == "OGG" else "PCM_16")
    return out.getvalue()


def forged_rate_wav(seconds: float = 3600.0, real_rate: int = 16_000, claimed_rate: int = 1) -> bytes:
    """An hour of 16 kHz silence whose header claims `claimed_rate` Hz: read at that rate it lasts 57.6 million
    seconds, and a model's resampler would blow it up 16000-fold. Built by hand: 115 MB of zeros."""
    samples = int(seconds * real_rate)
    data_size = samples * 2
    fmt = struct.pack("<HHIIHH", 1, 1, claimed_rate, claimed_rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + data_size) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_size) + bytes(data_size))


def mp4_video(frames: int = 40, width: int = 32, height: int = 24) -> bytes:
    import av
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), (i * 6) % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def m4a_tone(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """AAC in MP4, which soundfile cannot read (PyAV decodes it)."""
    import av
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        for i in range(0, len(tone), 1024):
            frame = av.AudioFrame.from_ndarray(tone[None, i:i + 1024], format="flt", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


# ---- a loopback HTTP server of media ----

class MediaServer(http.server.ThreadingHTTPServer):
    """Serves `files` (path -> (content type, bytes)); /redirect?to=URL answers 302 to URL; /slow trickles a byte
    every 0.2 s for ever (a 200 with a long Content-Length); /stall accepts and never answers."""
    daemon_threads = True

    def __init__(self, files: dict[str, tuple[str, bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.stop = threading.Event()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MediaServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        path, _, query = self.path.partition("?")
        if path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query.removeprefix("to="))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/slow":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            while not self.server.stop.is_set():
                try:
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)
        elif path == "/stall":
            self.server.stop.wait(60)
        elif path in self.server.files:
            mime, body = self.server.files[path]
            self.send_response(200)
            self.send_header("Content-Type", mime)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)


@contextmanager
def media_server(files: dict[str, tuple[str, bytes]]) -> Iterator[MediaServer]:
    server = MediaServer(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
