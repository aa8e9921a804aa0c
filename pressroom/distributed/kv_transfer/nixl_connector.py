"""NixlConnector: a request's prompt KV moved from a prefill engine (producer) to a decode engine (consumer) over
NIXL, as vLLM's NixlConnector moves it (UCX; host memory here).

Producer: a request sent with {"do_remote_decode": true} runs as usual (a prefill and max_tokens 1); when it
finishes, its ranks copy the blocks that hold its prompt's first n - 1 tokens into chunks of the staging buffer
(staging.py), the core seals each chunk's header, and the request's output carries the kv_transfer_params a decode
engine needs: where the chunks are (this engine's NIXL agent, its metadata port, the chunks' slots and addresses),
how many tokens they cover, the block size and the model fingerprint. The device blocks go back at once; the chunks
are held until the consumer says it has read them, or for abort_request_timeout_s.

Consumer: a request with {"do_remote_prefill": true, ...} is checked on arrival (same block size and model
fingerprint, else a ValueError that says which). At its first admission attempt the connector fetches the
producer's agent metadata (NIXL's listener) and reads the chunks past the local prefix hits into its own staging
buffer, one READ for all of them; the request waits meanwhile and others are admitted past it. When the read is
done each chunk's header and checksum are checked (kv_offload/layout.py: fingerprint, key, token ids, length,
XXH3), the producer is told to let go, and the request is admitted with those tokens computed: its ranks copy the
chunks into its fresh blocks before the step's forward pass, and the step computes the prompt's last token only.
A read that fails, times out (transfer_timeout_s) or brings a corrupt chunk falls back to computing the prompt
here: the output is the same, only slower.

E/P/D: media_transfer.py moves encoder outputs (keyed by media hash) through the same staging buffer and agent:
an encode engine stages them for {"do_remote_encode": true}, a prefill engine reads them for "remote_encoder".

Chunks are head-major over every KV head, so engines of different tensor-parallel sizes exchange them: each rank
copies its own heads (worker_side.py) and the transport sees one region per engine.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pressroom.config import KVTransferConfig
from pressroom.core.outputs import EngineCoreOutput
from pressroom.core.request import Request, RequestStatus
from pressroom.core.scheduler import KVTransferStats
from pressroom.distributed.kv_transfer.base import KVConnector, Rpc, check_kv_transfer_params, kv_transfer_params
from pressroom.distributed.kv_transfer.media_transfer import REMOTE_ENCODER, MediaTransfers, check_encoder_params
from pressroom.distributed.kv_transfer.staging import StagingBuffer
from pressroom.kv_offload.layout import HEADER_BYTES, CorruptChunk, check_header, check_payload, tokens_digest

logger = logging.getLogger("pressroom")

POLL_S = 0.02  # how often the background thread reads notifications and expires held chunks
# a consumer's word on a transfer, b"<word><bytes read>:<request id>": read (and checked), or given up
DONE, DROP = b"done:", b"drop:"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def agent_name(engine_id: str) -> str:
    return f"pressroom-{engine_id}"


def load_nixl():
    """NIXL's agent API, or an ImportError that says how to get it."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ImportError("NixlConnector needs the nixl package (pip install 'pressroom[disagg]' or "
                          f"pip install nixl): {e}") from e
    return nixl_agent, nixl_agent_config


@dataclass(slots=True)
class _Staged:
    """A producer's finished request: its chunks, held for a consumer until `expires`."""
    slots: list[int]
    expires: float
    nbytes: int


@dataclass(slots=True)
class _Pending:
    """A consumer's request whose prompt KV comes from a producer."""
    params: dict
    peer: str  # the producer's agent name
    deadline: float
    num_tokens: int  # prompt tokens the producer's chunks cover
    first: int  # the first chunk read (the ones before it were local prefix hits)
    state: str = "handshake"  # -> reading -> ready -> loading -> consumed; or failed
    slots: list[int] = field(default_factory=list)  # local staging slots: chunk first + i in slots[i]
    handle: Any = None  # the NIXL read in flight

    @property
    def num_chunks(self) -> int:
        return len(self.params["remote_block_ids"])


class NixlConnector(KVConnector):
    agent_name = staticmethod(agent_name)

    def __init__(self, config: KVTransferConfig, *, fingerprint: bytes, chunk_shape: tuple[int, ...],
                 kv_dtype: torch.dtype, block_size: int, tp_size: int = 1, pin: bool = False) -> None:
        nixl_agent, nixl_agent_config = load_nixl()
        self.config, self.fingerprint, self.block_size, self.tp_size = config, fingerprint, block_size, tp_size
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        self.staging = StagingBuffer(config.kv_buffer_size, chunk_shape, kv_dtype, pin)
        # No progress thread: NIXL's spins (0.6 of a core, measured idle); UCX progresses inside the calls this
        # connector makes anyway (the producer's notification poll, the consumer's transfer checks).
        self.agent = nixl_agent(agent_name(self.engine_id), nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=True, listen_port=config.kv_port, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL started without its UCX backend; the KV transfer needs it.")
        self._registered = [self.agent.register_memory(t) for t in (self.staging.chunks, self.staging.headers)]
        self._lock = threading.RLock()  # the agent, the staging buffer and the tables below
        self._stats = KVTransferStats(staging_slots=self.staging.num_slots)
        self._staged: dict[str, _Staged] = {}  # producer: request id -> its held chunks
        self._to_save: dict[str, tuple[Request, list[int], list[int], int]] = {}  # finished this step
        self._pending: dict[str, _Pending] = {}  # consumer: request id -> its transfer
        self._loads: list[tuple[int, int]] = []  # (block, slot) for the next step
        self._loading: list[str] = []
        self._draining: list[tuple[Any, list[int]]] = []  # abandoned reads: their handle and slots
        self._peers: set[str] = set()  # agents whose metadata was asked for
        self._closed = threading.Event()
        self.media = MediaTransfers(self)  # E/P/D: encoder outputs, staged and read through the same buffer
        self._thread = threading.Thread(target=self._background, name="kv-transfer", daemon=True)
        self._thread.start()
        logger.info("KV transfer: NixlConnector (%s) engine %s, NIXL agent on port %d, staging %.0f MiB (%d chunks "
                    "of %d bytes)", config.kv_role, self.engine_id, config.kv_port, config.kv_buffer_size / 2**20,
                    self.staging.num_slots, self.staging.chunk_bytes)

    # ---- requests ----

    def check_request(self, params: dict | None) -> None:
        check_kv_transfer_params(params, self.config, self.block_size, self.fingerprint.hex())
        if params and params.get("do_remote_prefill") and params["chunk_bytes"] != self.staging.chunk_bytes:
            raise ValueError(f"the prefill engine {params['remote_engine_id']} stages chunks of "
                             f"{params['chunk_bytes']} bytes, this engine's are {self.staging.chunk_bytes}: they serve "
                             "different models.")
        if params and params.get(REMOTE_ENCODER) is not None:
            check_encoder_params(params[REMOTE_ENCODER], self.fingerprint.hex(), self.staging.chunk_bytes)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        params = kv_transfer_params(request.sampling_params)
        if params and params.get(REMOTE_ENCODER) and not self.media.ready(request, params):
            return None  # its media's encoder outputs are on their way
        if not params or not params.get("do_remote_prefill"):
            return 0
        with self._lock:
            pending = self._pending.get(request.request_id)
            if pending is None and request.sampling_params.prompt_logprobs is not None:
                # its prompt's logprobs need every prompt position computed here (as prefix hits are skipped)
                pending = self._pending[request.request_id] = self._begin(request, params, 0)
                self._abandon(pending)
                pending.state = "consumed"
                return 0
            if pending is None:
                pending = self._pending[request.request_id] = self._begin(request, params, num_computed_tokens)
            if pending.state in ("handshake", "reading"):
                try:
                    self._advance(pending, request)
                except Exception as e:  # noqa: BLE001 — a transfer's fault is its request's: computed here
                    self._fail(pending, request, f"{type(e).__name__}: {e}")
            if pending.state in ("handshake", "reading"):
                return None
            if pending.state != "ready":
                return 0
            local_blocks = num_computed_tokens // self.block_size
            if local_blocks < pending.first or local_blocks >= pending.num_chunks:
                # the local hits shrank below what was read (evicted meanwhile), or cover it all
                self._release(pending)
                pending.state = "consumed"
                return 0
            return pending.num_tokens - local_blocks * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_blocks: int,
                                 num_external_tokens: int) -> None:
        with self._lock:
            pending = self._pending[request.request_id]
            self._loads += [(block_ids[k], pending.slots[k - pending.first])
                            for k in range(num_local_blocks, pending.num_chunks)]
            self._loading.append(request.request_id)
            pending.state = "loading"
            self._stats.tokens_received += num_external_tokens

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        with self._lock:
            pending = self._pending.pop(request.request_id, None)
            if pending is not None and pending.state not in ("consumed", "failed"):
                self._abandon(pending)
        self.media.finished(request)
        params = kv_transfer_params(request.sampling_params)
        if params and params.get("do_remote_encode") and self.config.is_producer and request.status in (
                RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            self.media.stage_later(request)
        if not (params and params.get("do_remote_decode") and self.config.is_producer) or request.pooling is not None \
                or request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            return
        num_tokens = request.num_prompt_tokens - 1  # the consumer computes the last one: it samples from it
        num_chunks = min(cdiv(num_tokens, self.block_size), len(block_ids))
        with self._lock:
            self._unstage(request.request_id)
            slots = self.staging.allocate(num_chunks) if num_chunks else []
        if slots is None:
            logger.warning("KV transfer: the staging buffer is full; request %s's prompt will be computed by its "
                           "decode engine (raise kv_buffer_size)", request.request_id)
            slots, num_tokens = [], 0
        self._to_save[request.request_id] = (request, block_ids[:len(slots)], slots,
                                             min(num_tokens, len(slots) * self.block_size))

    # ---- engine hooks ----

    def before_step(self, rpc: Rpc) -> None:
        if self._to_save:  # finished in a step whose outputs were never processed: their blocks may be reused now
            with self._lock:
                for _, _, slots, _ in self._to_save.values():
                    self.staging.release(slots)
            self._to_save = {}
        self.media.before_step(rpc)
        if not self._loads:
            return
        loads, self._loads = self._loads, []
        rpc("kv_connector_load", loads)
        with self._lock:
            for rid in self._loading:
                pending = self._pending.get(rid)
                if pending is not None:
                    self._release(pending)
                    pending.state = "consumed"
            self._loading = []

    def after_update(self, outputs: list[EngineCoreOutput], rpc: Rpc) -> None:
        self.media.after_update(outputs, rpc)
        if not self._to_save:
            return
        to_save, self._to_save = self._to_save, {}
        saves = [(block, slot) for _, blocks, slots, _ in to_save.values() for block, slot in zip(blocks, slots)]
        if saves:
            rpc("kv_connector_save", saves)
        params = {rid: self._stage(rid, *entry) for rid, entry in to_save.items()}
        for out in outputs:
            if out.req_id in params:
                out.kv_transfer_params = params.pop(out.req_id)
        with self._lock:
            for rid in params:  # finished without an output of this step (stopped by the front-end): not served
                self._unstage(rid)

    def _stage(self, rid: str, request: Request, blocks: list[int], slots: list[int], num_tokens: int) -> dict:
        """Seals the chunks the ranks just wrote and returns the params a consumer reads them by."""
        bs = self.block_size
        with self._lock:
            for k, slot in enumerate(slots):
                tokens = tokens_digest(request.prompt_token_ids[k * bs:min((k + 1) * bs, num_tokens)])
                self.staging.seal(slot, self.fingerprint, f"{rid}/{k}", tokens)
            if slots and self.config.fault_injection == "corrupt_staged":
                self.staging.payload(slots[-1])[0] ^= 0xFF  # after the checksum: bytes "corrupted in transit"
            nbytes = len(slots) * (self.staging.chunk_bytes + HEADER_BYTES)
            self._hold(rid, slots, nbytes)
            self._stats.transfers_staged += 1
            self._stats.bytes_staged += nbytes
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port, "remote_request_id": rid,
                "remote_block_ids": slots, "remote_num_tokens": num_tokens,
                "remote_chunk_base": self.staging.chunk_address(0),
                "remote_header_base": self.staging.header_address(0),
                "chunk_bytes": self.staging.chunk_bytes, "block_size": bs, "tp_size": self.tp_size,
                "model_fingerprint": self.fingerprint.hex()}

    def _hold(self, rid: str, slots: list[int], nbytes: int) -> None:
        """Holds staged chunks for a consumer until it says it read them, or abort_request_timeout_s."""
        self._staged[rid] = _Staged(slots, time.monotonic() + self.config.abort_request_timeout_s, nbytes)

    @property
    def waiting_for_remote(self) -> bool:
        return self.media.waiting or any(p.state in ("handshake", "reading") for p in self._pending.values())

    def stats(self) -> KVTransferStats:
        with self._lock:
            self._stats.staging_slots_used = self.staging.num_used
            return self._stats.copy()

    # ---- consumer: one request's transfer ----

    def _begin(self, request: Request, params: dict, num_computed: int) -> _Pending:
        num_tokens, chunks = int(params["remote_num_tokens"]), params["remote_block_ids"]
        peer = agent_name(str(params["remote_engine_id"]))
        first = min(num_computed // self.block_size, len(chunks))
        pending = _Pending(params, peer, time.monotonic() + self.config.transfer_timeout_s, num_tokens, first)
        if not 0 < num_tokens < request.num_prompt_tokens or len(chunks) != cdiv(num_tokens, self.block_size):
            if num_tokens:
                logger.warning("KV transfer: request %s's kv_transfer_params cover %d tokens in %d chunks for a prompt "
                               "of %d; computing it here", request.request_id, num_tokens, len(chunks),
                               request.num_prompt_tokens)
            pending.state = "failed"
            self._notify(pending, DROP)
        elif first == len(chunks):  # the local prefix cache holds it all
            pending.state = "consumed"
            self._notify(pending, DONE)
        return pending

    def _advance(self, pending: _Pending, request: Request) -> None:
        if pending.state == "handshake" and self._peer_ready(pending):
            error = self._start_read(pending)
            if error:
                self._fail(pending, request, f"the read could not start: {error}")
                return
        if pending.state == "reading":
            state = "PROC" if self.config.fault_injection == "stall_reads" else self.agent.check_xfer_state(
                pending.handle)
            if state == "DONE":
                self.agent.release_xfer_handle(pending.handle)
                pending.handle = None
                self._check_chunks(pending, request)
            elif state == "ERR":
                self._fail(pending, request, "the read failed (the prefill engine is gone?)")
        if pending.state in ("handshake", "reading") and time.monotonic() > pending.deadline:
            what = "no metadata came (unreachable?)" if pending.state == "handshake" else "the read did not end"
            self._fail(pending, request, f"timed out after {self.config.transfer_timeout_s:g} s: {what}")

    def _peer_ready(self, pending: _Pending) -> bool:
        params = pending.params
        if pending.peer not in self._peers:
            self._peers.add(pending.peer)
            try:
                self.agent.fetch_remote_metadata(pending.peer, str(params["remote_host"]), int(params["remote_port"]))
                self.agent.send_local_metadata(str(params["remote_host"]), int(params["remote_port"]))
            except Exception as e:  # noqa: BLE001 — NIXL's errors have many types; the deadline ends the wait
                logger.warning("KV transfer: asking %s:%s for its metadata failed: %s", params["remote_host"],
                               params["remote_port"], e)
                self._peers.discard(pending.peer)
                return False
        return self.agent.check_remote_metadata(pending.peer)

    def _start_read(self, pending: _Pending) -> str | None:
        """Posts the read of the chunks past the local hits (or waits for staging room); the error, if NIXL
        refused it."""
        count = pending.num_chunks - pending.first
        slots = self.staging.allocate(count)
        if slots is None:
            if count > self.staging.num_slots:
                return f"{count} chunks never fit this engine's staging buffer of {self.staging.num_slots}"
            return None  # wait for room until the deadline
        pending.slots = slots
        params, staging = pending.params, self.staging
        remote = params["remote_block_ids"][pending.first:]
        chunk, header = int(params["remote_chunk_base"]), int(params["remote_header_base"])
        local = np.array([row for s in slots for row in ((staging.header_address(s), HEADER_BYTES, 0),
                                                          (staging.chunk_address(s), staging.chunk_bytes, 0))],
                         dtype=np.uint64)
        far = np.array([row for s in remote for row in ((header + s * HEADER_BYTES, HEADER_BYTES, 0),
                                                         (chunk + s * staging.chunk_bytes, staging.chunk_bytes, 0))],
                       dtype=np.uint64)
        try:
            pending.handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                        self.agent.get_xfer_descs(far, "DRAM"), pending.peer)
            if self.agent.transfer(pending.handle) == "ERR":
                return "NIXL refused to post it"
        except Exception as e:  # noqa: BLE001 — NIXL's errors have many types
            return f"{type(e).__name__}: {e}"
        pending.state = "reading"
        return None

    def _check_chunks(self, pending: _Pending, request: Request) -> None:
        bs, staging = self.block_size, self.staging
        rid = pending.params["remote_request_id"]
        for i, slot in enumerate(pending.slots):
            k = pending.first + i
            tokens = tokens_digest(request.prompt_token_ids[k * bs:min((k + 1) * bs, pending.num_tokens)])
            try:
                checksum = check_header(self.fingerprint, f"{rid}/{k}", staging.header(slot), staging.chunk_bytes,
                                        staging.chunk_bytes, tokens)
                check_payload(staging.payload(slot), checksum)
            except CorruptChunk as e:
                self._stats.corrupt_chunks += 1
                self._fail(pending, request, f"chunk {k} is not served: {e}")
                return
        pending.state = "ready"
        self._stats.transfers_done += 1
        self._stats.bytes_received += len(pending.slots) * (staging.chunk_bytes + HEADER_BYTES)
        self._notify(pending, DONE, len(pending.slots) * (staging.chunk_bytes + HEADER_BYTES))

    def _fail(self, pending: _Pending, request: Request, why: str) -> None:
        params = pending.params
        logger.warning("KV transfer: request %s's KV from %s (%s:%s) is not used, its prompt is computed here: %s",
                       request.request_id, params["remote_engine_id"], params["remote_host"], params["remote_port"],
                       why)
        self._stats.transfers_failed += 1
        self._abandon(pending)
        pending.state = "failed"

    def _abandon(self, pending: _Pending) -> None:
        """Drops a transfer: a read in flight is cancelled (its slots wait until NIXL lets go of them)."""
        if pending.handle is not None:
            self._draining.append((pending.handle, pending.slots))
            pending.handle, pending.slots = None, []
        self._release(pending)
        if pending.state in ("handshake", "reading"):
            self._notify(pending, DROP)

    def _release(self, pending: _Pending) -> None:
        self.staging.release(pending.slots)
        pending.slots = []

    def _notify(self, pending: _Pending, word: bytes, nbytes: int = 0) -> None:
        """Tells the producer it may let go of the chunks (best effort: it lets go after a timeout anyway)."""
        if pending.peer not in self._peers:
            return
        try:
            if not self.agent.check_remote_metadata(pending.peer):
                return
            self.agent.send_notif(pending.peer, word + f"{nbytes}:{pending.params['remote_request_id']}".encode())
        except Exception as e:  # noqa: BLE001
            logger.debug("KV transfer: notifying %s failed: %s", pending.peer, e)

    # ---- producer: held chunks ----

    def _unstage(self, rid: str, nbytes_read: int = 0) -> None:
        staged = self._staged.pop(rid, None)
        if staged is None:
            return
        self.staging.release(staged.slots)
        self._stats.bytes_sent += min(nbytes_read, staged.nbytes)

    def _background(self) -> None:
        """Reads consumers' notifications, lets go of chunks read or held too long, and frees the slots of
        abandoned reads once NIXL is done with them."""
        while not self._closed.wait(POLL_S):
            try:
                with self._lock:
                    self._poll()
            except Exception:  # noqa: BLE001 — the thread must outlive one bad poll
                logger.exception("KV transfer: polling failed")

    def _poll(self) -> None:
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                word, _, rest = message.partition(b":")
                nbytes, _, rid = rest.decode(errors="replace").partition(":")
                self._unstage(rid, int(nbytes) if word + b":" == DONE and nbytes.isdigit() else 0)
        now = time.monotonic()
        for rid in [rid for rid, s in self._staged.items() if s.expires < now]:
            logger.warning("KV transfer: request %s's staged KV was not read within %g s; let go",
                           rid, self.config.abort_request_timeout_s)
            self._stats.transfers_expired += 1
            self._unstage(rid)
        still = []
        for handle, slots in self._draining:
            try:
                self.agent.release_xfer_handle(handle)
                self.staging.release(slots)
            except Exception:  # noqa: BLE001 — still in flight: try again next time
                still.append((handle, slots))
        self._draining = still

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        with self._lock:
            for pending in self._pending.values():
                if pending.handle is not None:
                    try:
                        self.agent.release_xfer_handle(pending.handle)
                    except Exception:  # noqa: BLE001
                        pass
            for registered in self._registered:
                try:
                    self.agent.deregister_memory(registered)
                except Exception:  # noqa: BLE001
                    pass
            self.staging.close()
