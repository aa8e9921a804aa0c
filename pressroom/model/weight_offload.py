"""Weight offloading (vLLM's --cpu-offload-gb): whole decoder layers kept in host memory and copied to the device
ahead of their use, so a model larger than the device's budget serves.

Which layers: the last decoder layers, whole, until the asked bytes are covered (the last one may pass them, as
vLLM's rule does). vLLM's original offloader walks from the first layer, parameter by parameter, and lets the GPU
read them in place; here every offloaded layer is copied whole before it runs, so the offloaded layers are the last
ones: the first one's copy then runs while the resident layers compute.

How: an offloaded layer's parameters live in one host buffer of its own (pinned on CUDA), laid out parameter after
parameter at aligned offsets, and on the device they are views of one of two staging buffers ("slots"): offloaded
layer j in slot j % 2. At the model's forward start the first layer's copy starts on a side stream; as layer j
starts, the compute stream waits for its copy, and layer j + 1's copy starts into the other slot once the compute
stream is done with it (with layer j - 1). Every copy a forward starts is waited for inside that forward, so a CUDA
graph captures the copies as nodes (fixed pinned addresses into fixed slots) and a replay streams the weights as an
eager step does. On the CPU the copies run in line (the engine never offloads there; tests use it to check the
mechanics).

The device keeps the resident weights and the slots (twice the largest offloaded layer): all the memory profile
sees, since the host buffers are outside the device's allocator.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pressroom.model.layers.deferred import is_expanded

ALIGN = 256  # bytes: each parameter's offset in a layer's buffer (any dtype's view, and coalesced copies)
NUM_SLOTS = 2  # double buffering: layer j + 1 copies while layer j computes
PAGE = 4096  # host pages: the unit cudaHostRegister locks


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """The decoder layers to keep in host memory, in the order the forward pass runs them."""
    layers: tuple[nn.Module, ...]
    offloaded_bytes: int  # their parameters' bytes
    total_layers: int  # decoder layers in the model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the ModuleList holding the most parameter bytes (a vision tower's blocks
    are another, smaller one)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no stack of layers to offload; drop --cpu-offload-gb.")
    return max(lists, key=_module_bytes)


def plan_offload(model: nn.Module, nbytes: int) -> OffloadPlan:
    """The last decoder layers whose parameters cover `nbytes` (all of them where the layers hold less). Works on a
    model still holding its weights' stand-ins (layers/deferred.py): sizes come from shapes."""
    stack = decoder_layers(model)
    chosen, total = [], 0
    for layer in reversed(stack):
        if total >= nbytes:
            break
        chosen.append(layer)
        total += _module_bytes(layer)
    _check_unshared(model, chosen)
    return OffloadPlan(tuple(reversed(chosen)), total, len(stack))


def place_on_host(plan: OffloadPlan, pin: bool) -> list[torch.Tensor]:
    """Before loading: every parameter of the planned layers becomes a view of its layer's host buffer, so the
    checkpoint's bytes land there and the device never holds them. A stand-in stays uninitialised (the loader fills
    it); anything else (a norm's ones) is copied over. Returns the buffers, one per layer."""
    buffers = []
    for layer in plan.layers:
        params = _params(layer)
        offsets, size = _layout(params)
        host = host_buffer(size, pin)
        for param, offset in zip(params, offsets):
            view = _view(host, offset, param)
            if not is_expanded(param.data):
                view.copy_(param.data)
            param.data = view
        buffers.append(host)
    return buffers


class WeightOffload:
    """The installed offload of a loaded model: the layers' host buffers, the device slots and the hooks that stream
    them. Built after loading (and after a quantization method's last changes to the weights)."""

    def __init__(self, model: nn.Module, plan: OffloadPlan, device: str | torch.device,
                 buffers: list[torch.Tensor] | None = None) -> None:
        """`buffers`: the host buffers `place_on_host` made, reused where the parameters still view them."""
        self.device = torch.device(device)
        self.plan = plan
        pin = self.device.type == "cuda"
        packed = [_pack(layer, host, pin) for layer, host in zip(plan.layers, buffers or [None] * len(plan.layers))]
        self.hosts = [host for host, _ in packed]
        slot_bytes = max((host.numel() for host in self.hosts), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(min(NUM_SLOTS, len(plan.layers)))]
        for j, (_, placed) in enumerate(packed):
            for param, offset in placed:
                param.data = _view(self.slots[j % len(self.slots)], offset, param)
        self._pending: int | None = None  # the offloaded layer whose copy was started last and not yet waited for
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self._loaded = [torch.cuda.Event() for _ in self.slots] if pin else []
        self._free = torch.cuda.Event() if pin else None
        model.register_forward_pre_hook(self._before_forward)
        for j, layer in enumerate(plan.layers):
            layer.register_forward_pre_hook(partial(self._before_layer, j))
        for module in model.modules():  # the CPU's fused decode stacks read every layer's weights at once
            if hasattr(module, "fused_decode"):
                module.fused_decode = False

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() for host in self.hosts)

    @property
    def staging_bytes(self) -> int:
        return sum(slot.numel() for slot in self.slots)

    def describe(self) -> str:
        plan = self.plan
        return (f"{len(plan.layers)} of {plan.total_layers} decoder layers ({self.host_bytes / 2**30:.2f} GiB) in "
                f"{'pinned ' if self._stream is not None else ''}host memory, streamed through "
                f"{len(self.slots)} staging buffer(s) of {self.staging_bytes / max(1, len(self.slots)) / 2**30:.2f} "
                f"GiB on {self.device}; the device saves {(self.host_bytes - self.staging_bytes) / 2**30:.2f} GiB")

    # ---- the stream of copies ----

    def _before_forward(self, module: nn.Module, args) -> None:
        if self.plan.layers:
            self._start(0)

    def _before_layer(self, j: int, module: nn.Module, args) -> None:
        if self._pending != j:  # not started ahead (the layers run without the model's forward)
            self._start(j)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[j % len(self.slots)])
        self._pending = None
        if j + 1 < len(self.plan.layers):
            self._start(j + 1)

    def _start(self, j: int) -> None:
        """Layer j's copy into its slot, once the compute stream has finished with the slot's previous layer."""
        host = self.hosts[j]
        slot = j % len(self.slots)
        target = self.slots[slot][:host.numel()]
        self._pending = j
        if self._stream is None:
            target.copy_(host)
            return
        self._free.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(self._free)
        with torch.cuda.stream(self._stream):
            target.copy_(host, non_blocking=True)
        self._loaded[slot].record(self._stream)


def host_buffer(size: int, pin: bool) -> torch.Tensor:
    """`size` bytes of host memory, page-locked (cudaHostRegister, whole pages) where `pin`, so copies to the device
    run asynchronously and a CUDA graph may hold them. Not torch's pinned allocator: it rounds each block up to a
    power of two, which for layers of 1.1 GiB would lock 2 GiB each. Unlocked again when the buffer is collected."""
    if not pin or not size:
        return torch.empty(size, dtype=torch.uint8)
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    host = raw[start:start + size]
    # The whole storage from its first byte: torch judges a tensor pinned (as a copy inside CUDA graph capture
    # requires) by its storage's start, not by the view's.
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(raw.data_ptr(), raw.numel(), 0))
    if rc != 0:
        raise ValueError(f"--cpu-offload-gb: page-locking {raw.numel() / 2**30:.2f} GiB of host memory failed (CUDA "
                         f"error {rc}); lower --cpu-offload-gb or free host memory.")
    weakref.finalize(host, cudart.cudaHostUnregister, raw.data_ptr()).atexit = False  # CUDA may be gone at exit
    return host


def _module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _params(layer: nn.Module) -> list[nn.Parameter]:
    return list(layer.parameters())


def _check_unshared(model: nn.Module, layers: list[nn.Module]) -> None:
    """A parameter an offloaded layer shares with another module would be read there from a slot that holds another
    layer's weights by then."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    for layer in layers:
        for name, param in layer.named_parameters():
            if uses[id(param)] > 1:
                raise ValueError(f"--cpu-offload-gb cannot offload {type(layer).__name__}: its parameter {name!r} is "
                                 "shared with another module; lower --cpu-offload-gb.")


def _nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def _layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    """Each parameter's offset in its layer's buffer, and the buffer's size."""
    offsets, end = [], 0
    for param in params:
        offsets.append(end)
        end += -(-_nbytes(param) // ALIGN) * ALIGN
    return offsets, end


def _view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    return buffer[offset:offset + _nbytes(param)].view(param.dtype).view(param.shape)


def _pack(layer: nn.Module, host: torch.Tensor | None, pin: bool
          ) -> tuple[torch.Tensor, list[tuple[nn.Parameter, int]]]:
    """The layer's host buffer and each parameter's offset in it: `host` as it is where every parameter still views
    it at its offset, else a new buffer holding the parameters' current values (a quantization method replaced some
    after loading)."""
    params = _params(layer)
    offsets, size = _layout(params)
    intact = host is not None and host.numel() == size and all(
        p.data.is_contiguous() and p.data.data_ptr() == host.data_ptr() + off for p, off in zip(params, offsets))
    if not intact:
        host = host_buffer(size, pin)
        for param, offset in zip(params, offsets):
            _view(host, offset, param).copy_(param.data)
    return host, list(zip(params, offsets))
