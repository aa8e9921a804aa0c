"""E/P/D: a media item's encoder outputs (its embedding rows, keyed by the media's content hash) moved from an encoder
engine to a prefill engine through the NixlConnector's staging buffer and NIXL agent.

Encoder engine (a producer): a request with {"do_remote_encode": true} runs as usual (the router sends max_tokens 1:
its prefill runs the vision tower); when it finishes, its ranks copy each of its items' cached rows (encoded then if
the cache lacks them: evicted, or the prefix cache covered their tokens) into staging
chunks as raw bytes (worker_side.py), the core seals each chunk's header under the key "media/<hash>/<k>" with the
digest of (hash, shape, dtype) in the token-ids field, and the output's kv_transfer_params say where they are
({"remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_chunk_base",
"remote_header_base", "chunk_bytes", "model_fingerprint", "media": [{"hash", "shape", "dtype", "slots"}]}).

Prefill engine (any role): a request whose kv_transfer_params carry those as "remote_encoder" waits, without
blocking others, while the connector reads the chunks of the items it has (one READ), checks each header and
checksum and each item's rows against its placeholder run; then the rows go into its ranks' encoder caches before
the step that admits it (counted as received, not as encoder runs). A read that fails, times out or is corrupt is
dropped: the prefill engine runs its encoder itself, with the same output.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pressroom.core.request import Request
from pressroom.kv_offload.layout import HEADER_BYTES, CorruptChunk, check_header, check_payload, key_digest

logger = logging.getLogger("pressroom")

REMOTE_ENCODER = "remote_encoder"  # its key in a prefill request's kv_transfer_params
ENCODER_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_chunk_base",
                "remote_header_base", "chunk_bytes", "model_fingerprint", "media")
DTYPES = ("float32", "float16", "bfloat16")  # encoder rows' dtypes a reader accepts


def media_key(media_hash: str, k: int) -> str:
    return f"media/{media_hash}/{k}"


def media_digest(media_hash: str, shape: tuple[int, ...], dtype: str) -> bytes:
    """What a media chunk's header carries in place of token ids: the item, its rows' shape and dtype."""
    return key_digest(f"{media_hash}|{','.join(map(str, shape))}|{dtype}")


def check_encoder_params(params: Any, fingerprint_hex: str | None, chunk_bytes: int | None = None) -> None:
    """Raises ValueError, saying why, for a "remote_encoder" this engine cannot read (the fingerprint and chunk
    size are checked where given: the front-end knows the former, the core both)."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params.remote_encoder must be a JSON object (the encoder engine's "
                         "kv_transfer_params, unchanged).")
    missing = [k for k in ENCODER_KEYS if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params.remote_encoder lacks {', '.join(missing)} (pass the params the "
                         "encoder engine returned, unchanged).")
    where = f"{params['remote_engine_id']} at {params['remote_host']}:{params['remote_port']}"
    if fingerprint_hex is not None and params["model_fingerprint"] != fingerprint_hex or \
            chunk_bytes is not None and params["chunk_bytes"] != chunk_bytes:
        raise ValueError(f"the encoder engine {where} serves another model or KV layout than this engine (their "
                         "model fingerprints or chunk sizes differ): both must serve the same model with the same "
                         "settings.")
    media = params["media"]
    if not isinstance(media, list) or not all(
            isinstance(m, dict) and isinstance(m.get("hash"), str) and isinstance(m.get("slots"), list)
            and isinstance(m.get("shape"), list) and m.get("dtype") in DTYPES for m in media):
        raise ValueError("kv_transfer_params.remote_encoder.media must be a list of {hash, shape, dtype, slots}.")


def media_bytes(shape: tuple[int, ...] | list[int], dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


@dataclass(slots=True)
class _MediaPending:
    """A prefill engine's request whose media rows come from an encoder engine."""
    params: dict
    peer: str
    deadline: float
    items: list[dict]  # the params' media entries this request has (and the cache may lack)
    state: str = "handshake"  # -> reading -> received; or failed
    slots: list[list[int]] = field(default_factory=list)  # local staging slots, per item
    handle: Any = None


class MediaTransfers:
    """The connector's E/P/D side (see the module's docstring); it shares the connector's lock, agent and
    staging buffer."""

    def __init__(self, connector: Any) -> None:
        """`connector`: the NixlConnector that owns this (not imported here: it imports this module)."""
        self.c = connector
        self._pending: dict[str, _MediaPending] = {}
        self._to_save: dict[str, Request] = {}
        self._loads: list[tuple[str, list[int], tuple[int, ...], str]] = []
        self._load_slots: list[int] = []
        self._runs_stale = False  # a request with media finished since the encoder runs were last read

    # ---- prefill engine ----

    def ready(self, request: Request, params: dict) -> bool:
        """False while the request's media rows are on their way; True once received, or dropped (then the
        encoder runs here)."""
        with self.c._lock:
            pending = self._pending.get(request.request_id)
            if pending is None:
                pending = self._pending[request.request_id] = self._begin(request, params[REMOTE_ENCODER])
            if pending.state in ("handshake", "reading"):
                try:
                    self._advance(pending, request)
                except Exception as e:  # noqa: BLE001 — a transfer's fault: the encoder runs here
                    self._fail(pending, request, f"{type(e).__name__}: {e}")
            return pending.state not in ("handshake", "reading")

    def _begin(self, request: Request, params: dict) -> _MediaPending:
        lengths = {m.hash: m.length for m in request.mm_features or ()}
        items = [m for m in params["media"] if m["hash"] in lengths]
        pending = _MediaPending(params, self.c.agent_name(str(params["remote_engine_id"])),
                                time.monotonic() + self.c.config.transfer_timeout_s, items)
        bad = [m["hash"] for m in items if not m["shape"] or m["shape"][0] != lengths[m["hash"]]
               or len(m["slots"]) != -(-media_bytes(m["shape"], m["dtype"]) // self.c.staging.chunk_bytes)]
        if bad or not items:
            if bad:
                logger.warning("E/P/D: request %s's encoder outputs for %s do not fit its placeholder runs; encoding "
                               "here", request.request_id, ", ".join(bad))
                self.c._stats.media_failed += len(items)
            pending.state = "failed"
        return pending

    def _advance(self, pending: _MediaPending, request: Request) -> None:
        if pending.state == "handshake" and self.c._peer_ready(pending):
            error = self._start_read(pending)
            if error:
                self._fail(pending, request, f"the read could not start: {error}")
                return
        if pending.state == "reading":
            state = self.c.agent.check_xfer_state(pending.handle)
            if state == "DONE":
                self.c.agent.release_xfer_handle(pending.handle)
                pending.handle = None
                self._check(pending, request)
            elif state == "ERR":
                self._fail(pending, request, "the read failed (the encoder engine is gone?)")
        if pending.state in ("handshake", "reading") and time.monotonic() > pending.deadline:
            self._fail(pending, request, f"timed out after {self.c.config.transfer_timeout_s:g} s")

    def _start_read(self, pending: _MediaPending) -> str | None:
        staging = self.c.staging
        count = sum(len(m["slots"]) for m in pending.items)
        slots = staging.allocate(count)
        if slots is None:
            return f"{count} chunks never fit the staging buffer" if count > staging.num_slots else None
        it = iter(slots)
        pending.slots = [[next(it) for _ in m["slots"]] for m in pending.items]
        params = pending.params
        chunk, header = int(params["remote_chunk_base"]), int(params["remote_header_base"])
        local = np.array([row for s in slots for row in ((staging.header_address(s), HEADER_BYTES, 0),
                                                          (staging.chunk_address(s), staging.chunk_bytes, 0))],
                         dtype=np.uint64)
        remote = [s for m in pending.items for s in m["slots"]]
        far = np.array([row for s in remote for row in ((header + int(s) * HEADER_BYTES, HEADER_BYTES, 0),
                                                         (chunk + int(s) * staging.chunk_bytes, staging.chunk_bytes,
                                                          0))], dtype=np.uint64)
        agent = self.c.agent
        try:
            pending.handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                                   agent.get_xfer_descs(far, "DRAM"), pending.peer)
            if agent.transfer(pending.handle) == "ERR":
                return "NIXL refused to post it"
        except Exception as e:  # noqa: BLE001 — NIXL's errors have many types
            return f"{type(e).__name__}: {e}"
        pending.state = "reading"
        return None

    def _check(self, pending: _MediaPending, request: Request) -> None:
        staging = self.c.staging
        for item, slots in zip(pending.items, pending.slots):
            tokens = media_digest(item["hash"], tuple(item["shape"]), item["dtype"])
            for k, slot in enumerate(slots):
                try:
                    checksum = check_header(self.c.fingerprint, media_key(item["hash"], k), staging.header(slot),
                                            staging.chunk_bytes, staging.chunk_bytes, tokens)
                    check_payload(staging.payload(slot), checksum)
                except CorruptChunk as e:
                    self.c._stats.corrupt_chunks += 1
                    self._fail(pending, request, f"item {item['hash'][:12]}'s chunk {k} is not served: {e}")
                    return
        nbytes = sum(len(s) for s in pending.slots) * (staging.chunk_bytes + HEADER_BYTES)
        self._loads += [(m["hash"], slots, tuple(m["shape"]), m["dtype"]) for m, slots in zip(pending.items,
                                                                                                 pending.slots)]
        self._load_slots += [s for slots in pending.slots for s in slots]
        pending.slots = []
        pending.state = "received"
        self.c._stats.media_received += len(pending.items)
        self.c._stats.bytes_received += nbytes
        self.c._notify(pending, b"done:", nbytes)

    def _fail(self, pending: _MediaPending, request: Request, why: str) -> None:
        logger.warning("E/P/D: request %s's encoder outputs from %s are not used, its media are encoded here: %s",
                       request.request_id, pending.params["remote_engine_id"], why)
        self.c._stats.media_failed += len(pending.items)
        self._abandon(pending)
        pending.state = "failed"

    def _abandon(self, pending: _MediaPending) -> None:
        slots = [s for group in pending.slots for s in group]
        if pending.handle is not None:
            self.c._draining.append((pending.handle, slots))
            pending.handle = None
        else:
            self.c.staging.release(slots)
        pending.slots = []
        if pending.state in ("handshake", "reading"):
            self.c._notify(pending, b"drop:")

    def before_step(self, rpc) -> None:
        """Rows read since the last step into the ranks' encoder caches (before the step that admits them)."""
        if not self._loads:
            return
        loads, self._loads = self._loads, []
        try:
            runs = rpc("kv_connector_load_media", loads)
            self.c._stats.encoder_runs = int(runs[0])
        finally:
            with self.c._lock:
                self.c.staging.release(self._load_slots)
                self._load_slots = []

    def finished(self, request: Request) -> None:
        if request.mm_features:
            self._runs_stale = True
        with self.c._lock:
            pending = self._pending.pop(request.request_id, None)
            if pending is not None and pending.state in ("handshake", "reading"):
                self._abandon(pending)
                pending.state = "failed"

    @property
    def waiting(self) -> bool:
        return any(p.state in ("handshake", "reading") for p in self._pending.values())

    # ---- encoder engine ----

    def stage_later(self, request: Request) -> None:
        if request.mm_features:
            self._to_save[request.request_id] = request

    def after_update(self, outputs: list, rpc) -> None:
        """Stages the finished encode requests' rows and sets their outputs' kv_transfer_params; refreshes the
        encoder-run counter when a request with media finished."""
        if self._runs_stale:
            self._runs_stale = False
            self.c._stats.encoder_runs = int(rpc("kv_connector_encoder_runs")[0])
        if not self._to_save:
            return
        to_save, self._to_save = self._to_save, {}
        params = {rid: self._stage(rid, request, rpc) for rid, request in to_save.items()}
        for out in outputs:
            if out.req_id in params:
                out.kv_transfer_params = params.pop(out.req_id)
        with self.c._lock:
            for rid in params:
                self.c._unstage(rid)

    def _stage(self, rid: str, request: Request, rpc) -> dict:
        hashes = list(dict.fromkeys(m.hash for m in request.mm_features))
        shapes = rpc("kv_connector_media_shapes", hashes)[0]
        if any(found is None for found in shapes):  # not in the encoder cache (evicted, or its tokens were hits)
            items = {m.hash: m for m in request.mm_features}
            missing = [items[key] for key, found in zip(hashes, shapes) if found is None]
            again = iter(rpc("kv_connector_encode_media", missing)[0])
            shapes = [found if found is not None else next(again) for found in shapes]
        staging, media, saves = self.c.staging, [], []
        with self.c._lock:
            for key, found in zip(hashes, shapes):
                if found is None or found[1] not in DTYPES:
                    continue  # the prefill engine encodes it
                shape, dtype = found
                slots = staging.allocate(-(-media_bytes(shape, dtype) // staging.chunk_bytes))
                if slots is None:
                    logger.warning("E/P/D: the staging buffer is full; media %s is encoded by its prefill engine "
                                   "(raise kv_buffer_size)", key[:12])
                    continue
                media.append({"hash": key, "shape": list(shape), "dtype": dtype, "slots": slots})
                saves.append((key, slots))
        if saves:
            rpc("kv_connector_save_media", saves)
        with self.c._lock:
            for m in media:
                tokens = media_digest(m["hash"], tuple(m["shape"]), m["dtype"])
                for k, slot in enumerate(m["slots"]):
                    staging.seal(slot, self.c.fingerprint, media_key(m["hash"], k), tokens)
                if self.c.config.fault_injection == "corrupt_staged":
                    staging.payload(m["slots"][-1])[0] ^= 0xFF  # after the checksum: "corrupted in transit"
            slots = [s for m in media for s in m["slots"]]
            nbytes = len(slots) * (staging.chunk_bytes + HEADER_BYTES)
            self.c._hold(rid, slots, nbytes)
            self.c._stats.media_staged += len(media)
            self.c._stats.bytes_staged += nbytes
        return {"do_remote_encode": False, "remote_engine_id": self.c.engine_id, "remote_host": self.c.config.kv_ip,
                "remote_port": self.c.config.kv_port, "remote_request_id": rid,
                "remote_chunk_base": staging.chunk_address(0), "remote_header_base": staging.header_address(0),
                "chunk_bytes": staging.chunk_bytes, "model_fingerprint": self.c.fingerprint.hex(), "media": media}
