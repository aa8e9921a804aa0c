"""The canonical on-tier layout of a chunk (one KV block) and its integrity header.

A chunk's payload is the block's KV for every attention layer and every KV head of the model, head-major:
[kv_heads, layers, planes (k, v; 1 for a latent cache), block_size, head_dim] in the KV dtype, row-major,
whichever backend wrote it and whatever its tensor-parallel size (a rank's heads are one contiguous range
of the chunk). Files and secondary tiers hold header + payload; the header carries a
format version, the model fingerprint, the payload's length and its XXH3-64 checksum, so a truncated,
corrupt or foreign chunk is recognised before it is served. (XXH3 hashes at memory speed; CRC-32, the first
version's checksum, cost more than the disk reads it guarded on the H200.)
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import torch
import xxhash

MAGIC = b"PRKV"
VERSION = 3  # 3: head-major chunks
_HEADER = struct.Struct("<4sH16sQQ")  # magic, version, fingerprint, payload length, xxh3-64
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


def chunk_parts(fingerprint: bytes, chunk: torch.Tensor) -> tuple[bytes, memoryview]:
    """A host chunk's header and its payload, the payload a view of the chunk's own memory (no copy): a tier
    that writes both in turn stores the chunk straight from the CPU tier's slot."""
    payload = payload_view(chunk)
    return _HEADER.pack(MAGIC, VERSION, fingerprint, len(payload), xxhash.xxh3_64_intdigest(payload)), payload


def encode_chunk(fingerprint: bytes, chunk: torch.Tensor) -> bytes:
    header, payload = chunk_parts(fingerprint, chunk)
    return header + payload.tobytes()


def payload_view(chunk: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host chunk, writable in place."""
    return memoryview(chunk.view(-1).view(torch.uint8).numpy())


def check_header(fingerprint: bytes, header: bytes | memoryview, payload_len: int, expected: int) -> int:
    """The checksum a chunk's header promises, if the header belongs to this model's chunks of `expected`
    bytes and `payload_len` bytes followed it; raises CorruptChunk with the reason otherwise."""
    if len(header) < HEADER_BYTES:
        raise CorruptChunk("shorter than its header (truncated)")
    magic, version, fp, length, checksum = _HEADER.unpack_from(header)
    if magic != MAGIC or version != VERSION:
        raise CorruptChunk(f"not a version-{VERSION} pressroom KV chunk")
    if fp != fingerprint:
        raise CorruptChunk("written for another model or cache layout (fingerprint differs)")
    if length != expected or payload_len != length:
        raise CorruptChunk(f"payload of {payload_len} bytes, header says {length}, the layout {expected} "
                           "(truncated)")
    return checksum


def check_payload(payload: memoryview, checksum: int) -> None:
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptChunk("checksum mismatch (corrupted bytes)")


def checked_payload(fingerprint: bytes, blob: bytes, expected: int) -> memoryview:
    """The payload of a blob whose header, length and checksum hold for this model's chunks of `expected`
    bytes; raises CorruptChunk with the reason otherwise."""
    payload = memoryview(blob)[HEADER_BYTES:]
    check_payload(payload, check_header(fingerprint, blob, len(payload), expected))
    return payload


def copy_payload(payload: memoryview, chunk: torch.Tensor) -> None:
    """Writes a checked payload's bytes into a (contiguous) host chunk."""
    np.frombuffer(payload_view(chunk), dtype=np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
