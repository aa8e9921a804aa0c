"""Sleep mode's memory moves (vLLM's `--enable-sleep-mode`), for one rank's worker.

vLLM's level 1 copies the weights to host memory and drops the KV cache; level 2 drops both. vLLM does it
under its own CUDA allocator (the tensors keep their addresses); pressroom moves tensor storages instead:
every device storage the model reaches (parameters, buffers, and the tensors its layers keep as plain
attributes, such as packed or quantized forms) is copied to pinned host memory and resized to nothing, so
every view of it elsewhere stays valid and comes back with it. Addresses change on waking, so CUDA graphs
are captured again then.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags


@dataclass(slots=True)
class HostCopy:
    """One device storage parked in host memory while its device bytes are freed."""
    storage: torch.UntypedStorage
    host: torch.Tensor  # uint8, pinned where the device is CUDA


def check_wake_tags(tags: list[str] | None) -> tuple[str, ...]:
    """The tags a wake_up restores (None: all); ValueError naming the accepted ones otherwise."""
    if tags is None:
        return SLEEP_TAGS
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"Unknown wake_up tag(s) {', '.join(map(repr, unknown))}; the tags are "
                         f"{', '.join(SLEEP_TAGS)} (none: both).")
    return tuple(t for t in SLEEP_TAGS if t in tags)


def device_storages(model: nn.Module, device: torch.device) -> list[torch.UntypedStorage]:
    """Every distinct storage on `device` the model's modules hold: parameters, buffers and tensor attributes
    (one storage however many tensors view it, such as tied embeddings). Opaque tensors (oneDNN's prepacked
    CPU weights) have no storage to reach and are left out."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in _module_tensors(model, device):
        if t.is_mkldnn:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def model_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of the model's tensors on `device`, each storage once (opaque ones by their elements)."""
    opaque = sum(t.numel() * t.element_size() for t in _module_tensors(model, device) if t.is_mkldnn)
    return opaque + sum(s.nbytes() for s in device_storages(model, device))


def _module_tensors(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    tensors = []
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(t, torch.Tensor) and t.device.type == device.type:
                tensors.append(t)
    return tensors


def offload_to_host(storages: list[torch.UntypedStorage]) -> list[HostCopy]:
    """Copies each storage to host memory, then frees its device bytes (the storage object stays, empty)."""
    copies = []
    pin = torch.cuda.is_available()
    for storage in storages:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.copy_(_bytes(storage))
        copies.append(HostCopy(storage, host))
    if copies and storages[0].device.type == "cuda":
        torch.cuda.synchronize()
    for copy in copies:
        copy.storage.resize_(0)
    return copies


def drop_storages(storages: list[torch.UntypedStorage]) -> None:
    """Frees each storage's device bytes now, whatever else still refers to the tensors viewing it."""
    for storage in storages:
        storage.resize_(0)


def restore_from_host(copies: list[HostCopy]) -> None:
    """Gives each storage its device bytes back and copies its contents in."""
    for copy in copies:
        copy.storage.resize_(copy.host.numel())
        _bytes(copy.storage).copy_(copy.host, non_blocking=True)
    if copies and copies[0].storage.device.type == "cuda":
        torch.cuda.synchronize()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def device_bytes_in_use(device: str) -> int:
    """Bytes the device's allocator holds (CUDA); 0 elsewhere."""
    return torch.cuda.memory_reserved() if device == "cuda" and torch.cuda.is_available() else 0
