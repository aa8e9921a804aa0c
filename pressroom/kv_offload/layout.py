"""The canonical on-tier layout of a chunk (one KV block), its integrity header and the model fingerprint.

A chunk's payload is the block's KV for every attention layer and every KV head of the model, head-major:
[kv_heads, layers, planes (k, v; 1 for a latent cache), block_size, head_dim] in the KV dtype, row-major,
whichever backend wrote it and whatever its tensor-parallel size (a rank's heads are one contiguous range
of the chunk). Files and secondary tiers hold header + payload; the header carries a format version, the
model fingerprint, a digest of the chunk's own key (the chained block hash it is stored under), a digest of
the block's token ids, the payload's length and its XXH3-64 checksum, so a truncated, corrupt or foreign
chunk, or one filed under another prefix's key or holding other tokens' KV, is recognised before it is
served. (XXH3 hashes at memory speed; CRC-32, the first
version's checksum, cost more than the disk reads it guarded on the H200.)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from pressroom.config import ModelConfig
from pressroom.platforms import user_cache_dir

logger = logging.getLogger("pressroom")

MAGIC = b"PRKV"
# 3: head-major chunks; 4: the header carries the chunk's key; 5: and its token ids' digest (older files fail
# the version check: a miss, recomputed)
VERSION = 5
_HEADER = struct.Struct("<4sH16s16s16sQQ")  # magic, version, fingerprint, key, token ids, payload length, xxh3-64
HEADER_BYTES = _HEADER.size
_READ_BYTES = 16 << 20  # a weight file is hashed in reads of this size
# A file changed this recently is hashed but its hash not cached: a second change within the same tick of the
# file system's clock would leave its identity as it was.
_SETTLE_NS = 1_000_000_000


class CorruptChunk(ValueError):
    """A chunk that must not be served: its header or checksum does not match."""


# ---- the model fingerprint ----

def model_fingerprint(model_path: str, model: ModelConfig, kv_dtype: torch.dtype, block_size: int,
                      chunk_shape: tuple[int, ...], hash_cache: Path | None = None) -> bytes:
    """16 bytes that change with anything that changes what a block's KV is: the weights' content (for
    dummy weights, their seed), the model's config (shapes, rope: config.json and the quantization configs
    beside it, or a GGUF's metadata, which the file's content hash covers), the quantization asked for,
    the dtypes, the block size, the chunk's shape and the layout's version. The tensor-parallel size is left
    out: chunks are the same at any size. Weight files are hashed once per file identity (`hash_cache`,
    by default `weight_hash_cache()`)."""
    parts: dict = {"version": VERSION, "load_format": model.load_format, "quantization": model.quantization,
                   "dtype": str(model.dtype), "kv_dtype": str(kv_dtype), "block_size": block_size,
                   "chunk_shape": list(chunk_shape)}
    path = Path(model_path) if model_path else None
    cache = weight_hash_cache() if hash_cache is None else hash_cache
    dummy = model.load_format == "dummy"
    if dummy:
        parts["seed"] = model.seed
    if path is not None and path.is_file():  # GGUF: config and weights in one file
        parts["gguf"] = _weight_digests([path], cache)[0]
    elif path is not None and path.is_dir():
        configs, weights = _checkpoint_files(path)
        parts["config"] = {f.name: xxhash.xxh3_128_hexdigest(f.read_bytes()) for f in configs}
        if not dummy:
            parts["weights"] = dict(zip((f.name for f in weights), _weight_digests(weights, cache)))
    else:
        parts["model"] = model_path
    return xxhash.xxh3_128_digest(json.dumps(parts, sort_keys=True).encode())


def _checkpoint_files(path: Path) -> tuple[list[Path], list[Path]]:
    """An HF directory's files that determine its KV: the configs (config.json and quantization configs;
    not the tokenizer's or generation's) and the weights the loader reads (*.safetensors)."""
    files = sorted(f for f in path.iterdir() if f.is_file())
    configs = [f for f in files if f.suffix == ".json" and "config" in f.name
               and not f.name.startswith(("tokenizer", "generation"))]
    return configs, [f for f in files if f.suffix == ".safetensors"]


def weight_hash_cache() -> Path:
    """Where weight files' content hashes are kept: the user's pressroom cache, not a disk tier's directory,
    since the hash names the weights (one entry serves every tier path and every restart) and a disk tier's
    directory is itself named by the fingerprint the hash goes into."""
    return user_cache_dir("weight-hashes")


def _weight_digests(files: list[Path], cache: Path) -> list[str]:
    """Each file's XXH3-128 content hash, from `cache` when the file's identity (path, device, inode, size,
    mtime, ctime) is unchanged since it was hashed; the others are hashed now, side by side, and cached."""
    seen_ns = time.time_ns()
    identities = [_identity(f) for f in files]
    digests = [_cached_digest(cache, identity) for identity, _ in identities]
    missing = [i for i, digest in enumerate(digests) if digest is None]
    if not missing:
        return digests
    start = time.perf_counter()
    gib = sum(files[i].stat().st_size for i in missing) / 2**30
    logger.info("KV offload: hashing %d weight file(s) (%.2f GiB) for the disk tier's model fingerprint, "
                "once per file (cached in %s)", len(missing), gib, cache)
    with ThreadPoolExecutor(min(4, len(missing)), thread_name_prefix="weight-hash") as pool:
        for i, digest in zip(missing, pool.map(lambda i: _hash_file(files[i]), missing)):
            digests[i] = digest
            identity, changed_ns = identities[i]
            # a file changed while it was read, or just before, is hashed again next time
            if _identity(files[i]) == identities[i] and seen_ns - changed_ns > _SETTLE_NS:
                _cache_digest(cache, identity, digest)
    logger.info("KV offload: weights hashed in %.1fs", time.perf_counter() - start)
    return digests


def _identity(path: Path) -> tuple[str, int]:
    """The file's identity for the hash cache, and when it last changed (its ctime, which no one can set)."""
    st = path.stat()
    return (f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}",
            st.st_ctime_ns)


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _entry(cache: Path, identity: str) -> Path:
    return cache / xxhash.xxh3_128_hexdigest(identity.encode())


def _cached_digest(cache: Path, identity: str) -> str | None:
    try:
        algorithm, digest, *_ = _entry(cache, identity).read_text().split()
    except (OSError, ValueError):
        return None
    return digest if algorithm == "xxh3-128" and len(digest) == 32 else None


def _cache_digest(cache: Path, identity: str, digest: str) -> None:
    """Best effort (an unwritable cache means hashing again at the next start); written atomically, since
    engines started together may hash the same file."""
    entry = _entry(cache, identity)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"xxh3-128 {digest} {identity.split(chr(0))[0]}\n")
        os.replace(tmp, entry)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        logger.debug("KV offload: weight hash not cached in %s: %s", cache, e)


# ---- chunks ----

def key_digest(key: str) -> bytes:
    """The 16 bytes a chunk's header carries for the key it is stored under (any tier key; the engine's
    are chained block hashes in hex, which cover every token up to the block's end)."""
    return xxhash.xxh3_128_digest(key.encode())


def tokens_digest(token_ids: Sequence[int]) -> bytes:
    """The 16 bytes a chunk's header carries for the token ids of the block it holds (as int64)."""
    return xxhash.xxh3_128_digest(np.asarray(token_ids, dtype=np.int64).tobytes())


def chunk_parts(fingerprint: bytes, key: str, tokens: bytes, chunk: torch.Tensor) -> tuple[bytes, memoryview]:
    """A host chunk's header and its payload, the payload a view of the chunk's own memory (no copy): a tier
    that writes both in turn stores the chunk straight from the CPU tier's slot. `tokens`: the block's
    `tokens_digest`."""
    payload = payload_view(chunk)
    header = _HEADER.pack(MAGIC, VERSION, fingerprint, key_digest(key), tokens, len(payload),
                          xxhash.xxh3_64_intdigest(payload))
    return header, payload


def encode_chunk(fingerprint: bytes, key: str, tokens: bytes, chunk: torch.Tensor) -> bytes:
    header, payload = chunk_parts(fingerprint, key, tokens, chunk)
    return header + payload.tobytes()


def payload_view(chunk: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host chunk, writable in place."""
    return memoryview(chunk.view(-1).view(torch.uint8).numpy())


def check_header(fingerprint: bytes, key: str, header: bytes | memoryview, payload_len: int, expected: int,
                 tokens: bytes | None = None) -> int:
    """The checksum a chunk's header promises, if the header belongs to this model's chunk `key` of
    `expected` bytes (holding the token ids whose `tokens_digest` is `tokens`, when the reader knows them)
    and `payload_len` bytes followed it; raises CorruptChunk with the reason otherwise."""
    if len(header) < HEADER_BYTES:
        raise CorruptChunk("shorter than its header (truncated)")
    magic, version, fp, stored_key, stored_tokens, length, checksum = _HEADER.unpack_from(header)
    if magic != MAGIC or version != VERSION:  # an older version's fields are not read
        raise CorruptChunk(f"not a version-{VERSION} pressroom KV chunk")
    if fp != fingerprint:
        raise CorruptChunk("written for another model or cache layout (fingerprint differs)")
    if stored_key != key_digest(key):
        raise CorruptChunk("stored under another key (another prefix's KV)")
    if tokens is not None and stored_tokens != tokens:
        raise CorruptChunk("holds other token ids' KV (their digest differs)")
    if length != expected or payload_len != length:
        raise CorruptChunk(f"payload of {payload_len} bytes, header says {length}, the layout {expected} "
                           "(truncated)")
    return checksum


def check_payload(payload: memoryview, checksum: int) -> None:
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptChunk("checksum mismatch (corrupted bytes)")


def checked_payload(fingerprint: bytes, key: str, blob: bytes, expected: int, tokens: bytes | None = None
                    ) -> memoryview:
    """The payload of a blob whose header, key, token ids (`tokens`, when known), length and checksum hold
    for this model's chunk `key` of `expected` bytes; raises CorruptChunk with the reason otherwise."""
    payload = memoryview(blob)[HEADER_BYTES:]
    check_payload(payload, check_header(fingerprint, key, blob, len(payload), expected, tokens))
    return payload


def copy_payload(payload: memoryview, chunk: torch.Tensor) -> None:
    """Writes a checked payload's bytes into a (contiguous) host chunk."""
    np.frombuffer(payload_view(chunk), dtype=np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
