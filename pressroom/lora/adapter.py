"""A PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) read and checked against the model.

PEFT names each update by the module it adapts in HF's naming (`base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight`, A [r, in], B [out, r]); the model's own name map (`checkpoint_target`, the one its weights load
through) says which of its linear layers that is and which slice of it (q of a fused qkv_proj, gate of gate_up).
Every problem is a ValueError naming the adapter: a path that is no PEFT directory, a corrupt file, a rank past
--max-lora-rank, a module the model lacks, a shape that does not match the base, a PEFT feature not served.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear

_PREFIX = "base_model.model."
_UNSERVED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained copies of modules)",
             "layer_replication": "layer replication"}


@dataclass(frozen=True, slots=True)
class LoRAUpdate:
    """One adapted slice of a linear layer: rows [offset, offset + size) of `module`'s output get
    scaling * B (A x); A [rank, in], B [size, rank] (fp32, as read)."""
    module: str
    offset: int
    size: int
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    updates: tuple[LoRAUpdate, ...]


def check_adapter_files(name: str, path: str, max_rank: int) -> None:
    """What can be checked without the model (the front-end's check, from the safetensors header only): a PEFT
    LoRA directory whose config pressroom serves and whose ranks fit `max_rank`."""
    from safetensors import SafetensorError, safe_open
    _read_config(name, path)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} has no adapter_model.safetensors.")
    try:
        with safe_open(file, "pt") as f:
            ranks = {key: f.get_slice(key).get_shape()[0] for key in f.keys() if ".lora_A" in key}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file: {e}") from None
    for key, rank in ranks.items():
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {rank} ({key}) exceeds --max-lora-rank {max_rank}; "
                             "raise --max-lora-rank.")


def load_peft_adapter(name: str, path: str, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` for `model` (a name map's `checkpoint_target`); ranks up to `max_rank`."""
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _split_key(name, key)
        pairs.setdefault(module, {})[part] = tensor
    updates = []
    for module, parts in sorted(pairs.items()):
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has {sorted(parts)}, not one lora_A and one lora_B.")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, which do not make a low-rank product.")
        if a.shape[0] > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {a.shape[0]} ({module}) exceeds --max-lora-rank "
                             f"{max_rank}; raise --max-lora-rank.")
        rank = a.shape[0]  # rank_pattern's for this module, as the tensors are shaped by it
        module_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha))
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        updates.append(_place(name, module, a.float(), b.float(), scaling, model))
    if not updates:
        raise ValueError(f"LoRA adapter {name!r} at {path!r} adapts no module.")
    return LoRAAdapter(name, tuple(updates))


def _pattern_value(pattern: dict, module: str, default: float) -> float:
    """PEFT's per-module override: the first key that names the module or a dotted suffix of it (a regex)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(name: str, path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is no PEFT adapter directory (no adapter_config.json).")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA.")
    for key, what in _UNSERVED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which pressroom does not serve.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={config['bias']!r}); pressroom serves "
                         "bias='none' adapters.")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} has no adapter_model.safetensors (PEFT's .bin files are "
                         "not read: they are pickles).")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file: {e}") from None


def _split_key(name: str, key: str) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'lora_A') (PEFT may name the adapter: lora_A.default)."""
    body = key.removeprefix(_PREFIX).removesuffix(".weight")
    for part in ("lora_A", "lora_B"):
        for marker in (f".{part}.default", f".{part}"):
            if body.endswith(marker):
                return body.removesuffix(marker), part
    raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is no lora_A/lora_B weight (embedding or LM-head "
                     "updates and magnitude vectors are not served).")


def _place(name: str, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float, model: nn.Module
           ) -> LoRAUpdate:
    """Which linear layer of the model, and which rows of its output, PEFT's `module` is."""
    target, shard = model.checkpoint_target(module + ".weight")
    owner = target.removesuffix(".weight")
    try:
        layer = model.get_submodule(owner)
    except AttributeError:
        layer = None
    if isinstance(layer, FusedMoE):
        raise ValueError(f"LoRA adapter {name!r} targets {module}, a routed expert: LoRA on MoE experts is not "
                         "served yet (adapters on attention and dense MLPs are).")
    if not isinstance(layer, LinearBase):
        raise ValueError(f"LoRA adapter {name!r} targets {module}, which the model has no linear layer for.")
    offset, size = _slice(layer, shard, layer_slices(layer))
    in_features = layer.in_features
    if a.shape[1] != in_features or b.shape[0] != size:
        raise ValueError(f"LoRA adapter {name!r}: {module} maps {a.shape[1]} -> {b.shape[0]} features; the model's "
                         f"layer maps {in_features} -> {size}. Was it trained on another base model?")
    return LoRAUpdate(owner, offset, size, a, b, scaling)


def layer_slices(layer: LinearBase) -> list[tuple[int, int]]:
    """(first output row, rows) of each part an adapter may update separately."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [(0, q), (q, kv), (q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        starts = [sum(layer.output_sizes[:i]) for i in range(len(layer.output_sizes))]
        return list(zip(starts, layer.output_sizes))
    return [(0, layer.out_features)]


def _slice(layer: LinearBase, shard: object, slices: list[tuple[int, int]]) -> tuple[int, int]:
    """(first output row, rows) of a shard of a fused layer (q, k, v; 0, 1, ...); the whole output for a plain
    one."""
    if isinstance(layer, QKVParallelLinear) and shard in ("q", "k", "v"):
        return slices["qkv".index(shard)]
    if isinstance(layer, MergedColumnParallelLinear) and isinstance(shard, int):
        return slices[shard]
    return slices[0]
