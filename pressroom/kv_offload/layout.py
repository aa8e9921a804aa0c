"""The canonical on-tier layout of a chunk (one KV block) and its integrity header.

A chunk's payload is the block's KV for every attention layer, as [layers, planes (k, v; 1 for a latent
cache), block_size, kv_heads, head_dim] in the KV dtype, row-major: the layout of the device cache's
block, whichever backend wrote it. Files and secondary tiers hold header + payload; the header carries a
format version, the model fingerprint, the payload's length and its CRC-32, so a truncated, corrupt or
foreign chunk is recognised before it is served.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

MAGIC = b"PRKV"
VERSION = 1
_HEADER = struct.Struct("<4sH16sQI")  # magic, version, fingerprint, payload length, crc32
HEADER_BYTES = _HEADER.size


class CorruptChunk(ValueError):
    """A chunk that must not be served: its header or checksum does not match."""


def model_fingerprint(model_path: str, load_format: str, seed: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                      block_size: int, chunk_shape: tuple[int, ...]) -> bytes:
    """16 bytes that change with anything that changes a block's KV: the weights (the model's config and its
    weight files' names and sizes; for dummy weights the seed), the dtypes, the block size and the chunk's
    shape."""
    h = hashlib.blake2b(digest_size=16)
    path = Path(model_path) if model_path else None
    parts: dict = {"load_format": load_format, "dtype": str(dtype), "kv_dtype": str(kv_dtype),
                   "block_size": block_size, "chunk_shape": list(chunk_shape), "version": VERSION}
    if load_format == "dummy":
        parts["seed"] = seed
    if path is not None and path.is_dir():
        config = path / "config.json"
        parts["config"] = config.read_text() if config.exists() else ""
        parts["weights"] = sorted((f.name, f.stat().st_size) for f in path.iterdir()
                                  if f.suffix in (".safetensors", ".gguf", ".bin"))
    elif path is not None and path.is_file():
        parts["weights"] = [(path.name, path.stat().st_size)]
    else:
        parts["model"] = model_path
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.digest()


def encode_chunk(fingerprint: bytes, chunk: torch.Tensor) -> bytes:
    payload = chunk_bytes(chunk)
    return _HEADER.pack(MAGIC, VERSION, fingerprint, len(payload), zlib.crc32(payload)) + payload


def checked_payload(fingerprint: bytes, blob: bytes, expected: int) -> memoryview:
    """The payload of a blob whose header, length and checksum hold for this model's chunks of `expected`
    bytes; raises CorruptChunk with the reason otherwise."""
    if len(blob) < HEADER_BYTES:
        raise CorruptChunk("shorter than its header (truncated)")
    magic, version, fp, length, crc = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        raise CorruptChunk(f"not a version-{VERSION} pressroom KV chunk")
    if fp != fingerprint:
        raise CorruptChunk("written for another model or cache layout (fingerprint differs)")
    payload = memoryview(blob)[HEADER_BYTES:]
    if length != expected or len(payload) != length:
        raise CorruptChunk(f"payload of {len(payload)} bytes, header says {length}, the layout {expected} "
                           "(truncated)")
    if zlib.crc32(payload) != crc:
        raise CorruptChunk("checksum mismatch (corrupted bytes)")
    return payload


def copy_payload(payload: memoryview, chunk: torch.Tensor) -> None:
    """Writes a checked payload's bytes into a (contiguous) host chunk."""
    chunk.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)


def chunk_bytes(chunk: torch.Tensor) -> bytes:
    return chunk.contiguous().view(torch.uint8).numpy().tobytes()
