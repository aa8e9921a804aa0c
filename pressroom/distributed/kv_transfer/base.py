"""The KV connector interface, in the shape of vLLM's V1 KVConnector, and what requests carry for it.

Scheduler side (the engine core's process): `get_num_new_matched_tokens` (how many of a prompt's tokens can be
loaded from elsewhere beyond the local prefix hits; None while they are on their way, so the request waits and the
batch goes on), `update_state_after_alloc` (the blocks they go into), `request_finished` (a producer stages a
finished request's KV; a consumer drops what it held). Engine hooks: `before_step` runs the step's loads on every
rank before its forward pass, `after_update` the saves of the requests that finished in it, and hands their
kv_transfer_params to their outputs. Worker side (worker_side.py): `save_kv`, `start_load_kv`, `wait_for_load`.

A request's `kv_transfer_params` travel in SamplingParams.extra_args (vLLM's place for them): a prefill engine gets
{"do_remote_decode": true} and returns the params a decode engine is then given ({"do_remote_prefill": true,
"remote_engine_id", "remote_host", "remote_port", "remote_block_ids", ...}).
E/P/D (media_transfer.py): an encoder engine gets {"do_remote_encode": true} and returns where its media items'
encoder outputs are staged; a prefill engine gets those as {"remote_encoder": {...}} beside its own params.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pressroom.config import KVTransferConfig
from pressroom.core.outputs import EngineCoreOutput
from pressroom.core.request import Request
from pressroom.core.scheduler import KVTransferStats
from pressroom.distributed.kv_transfer.media_transfer import REMOTE_ENCODER, check_encoder_params

KV_TRANSFER_PARAMS = "kv_transfer_params"  # its key in SamplingParams.extra_args

Rpc = Callable[..., list]  # executor.collective_rpc: runs Worker.<method>(*args) on every rank


def kv_transfer_params(request_params: Any) -> dict | None:
    """A request's kv_transfer_params (its SamplingParams' extra_args), or None."""
    extra = getattr(request_params, "extra_args", None) or {}
    params = extra.get(KV_TRANSFER_PARAMS)
    if params is not None and not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object.")
    return params


# what a decode engine needs of a producer's params (the ones NixlConnector returns)
REMOTE_PREFILL_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
                       "remote_num_tokens", "remote_chunk_base", "remote_header_base", "chunk_bytes", "block_size",
                       "model_fingerprint")


def check_kv_transfer_params(params: Any, transfer: KVTransferConfig | None, block_size: int,
                             fingerprint: str | None = None) -> None:
    """Raises ValueError, saying why, for kv_transfer_params this engine cannot serve: a transfer asked of an engine
    without a connector or of the wrong role, a decode's params missing keys, from an engine of another block size
    or (where `fingerprint`, this engine's model fingerprint in hex, is given) of another model."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object.")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    encode, encoder = params.get("do_remote_encode"), params.get(REMOTE_ENCODER)
    if not (decode or prefill or encode or encoder):
        return
    if transfer is None:
        raise ValueError("kv_transfer_params asks for a KV transfer, but this engine runs no KV connector (start it "
                         "with --kv-transfer-config '{\"kv_connector\": \"NixlConnector\", \"kv_role\": ...}').")
    if decode and not transfer.is_producer:
        raise ValueError(f"kv_transfer_params asks for do_remote_decode, but this engine's kv_role is "
                         f"{transfer.kv_role}: it does not stage KV for other engines.")
    if encoder is not None:
        check_encoder_params(encoder, fingerprint)
    if encode and not transfer.is_producer:
        raise ValueError(f"kv_transfer_params asks for do_remote_encode, but this engine's kv_role is "
                         f"{transfer.kv_role}: it does not stage encoder outputs for other engines.")
    if not prefill:
        return
    if not transfer.is_consumer:
        raise ValueError(f"kv_transfer_params asks for do_remote_prefill, but this engine's kv_role is "
                         f"{transfer.kv_role}: it does not read KV from other engines.")
    missing = [k for k in REMOTE_PREFILL_KEYS if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {', '.join(missing)} (pass the params "
                         "the prefill engine returned, unchanged).")
    if params["block_size"] != block_size:
        raise ValueError(f"the prefill engine {params['remote_engine_id']} at {params['remote_host']}:"
                         f"{params['remote_port']} has block size {params['block_size']}, this engine {block_size}: "
                         "start both with the same --block-size.")
    if fingerprint is not None and params["model_fingerprint"] != fingerprint:
        raise ValueError(f"the prefill engine {params['remote_engine_id']} at {params['remote_host']}:"
                         f"{params['remote_port']} serves another model or KV layout than this engine (their model "
                         "fingerprints differ: weights, config, dtype, KV cache dtype or block size): both must serve "
                         "the same model with the same settings.")


class KVConnector(ABC):
    """The scheduler side of a connector and its engine hooks (see the module's docstring)."""

    @abstractmethod
    def check_request(self, params: dict | None) -> None:
        """Raises ValueError, with the reason, for kv_transfer_params this engine cannot serve."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Prompt tokens past `num_computed_tokens` (local hits) whose KV can be loaded from elsewhere; None while
        it is still on its way (the request waits, others are admitted past it)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_blocks: int,
                                 num_external_tokens: int) -> None:
        """The request was admitted with `num_external_tokens` loaded into its blocks after its local hits."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """The request ended (its blocks are released after this call; their KV is still there until the next
        step is scheduled)."""

    @abstractmethod
    def before_step(self, rpc: Rpc) -> None:
        """The scheduled step's loads, on every rank, before its forward pass."""

    @abstractmethod
    def after_update(self, outputs: list[EngineCoreOutput], rpc: Rpc) -> None:
        """Stages the requests that finished in this step and sets their outputs' kv_transfer_params."""

    @property
    @abstractmethod
    def waiting_for_remote(self) -> bool:
        """Some request waits for KV on its way (the engine keeps polling)."""

    @abstractmethod
    def stats(self) -> KVTransferStats: ...

    @abstractmethod
    def close(self) -> None: ...
