"""Find a model, read its config and tokenizer, build it in the target dtype and fill its weights.

Sources: an HF directory (config.json, *.safetensors, sharded or not), a single GGUF file, or
`load_format="dummy"` (random weights for a config, for benchmarks of large shapes). Weights go
straight into the model's parameters through per-parameter loaders, never via a full HF copy. The layers a
quantization method takes are handed to it before their dense weights exist (`_build_model`, layers/deferred.py).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pressroom.config import ModelConfig
from pressroom.model import gguf_file
from pressroom.model.batch_invariant import make_batch_invariant
from pressroom.model.layers.deferred import DeferredWeights
from pressroom.model.layers.embedding import ParallelLMHead
from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.layers.linear import LinearBase
from pressroom.model.layers.quant import VNNI_MAX_ROWS, int4_kernel_available
from pressroom.model.lazy_weight import Index, LazyWeight, ReadTally
from pressroom.model.quantization import QuantizationMethod, checkpoint_quantization, resolve_method
from pressroom.model.registry import resolve_architecture
from pressroom.model.weight_offload import OffloadPlan, WeightOffload, place_on_host, plan_offload

logger = logging.getLogger("pressroom")


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: object
    source: str  # the resolved path
    # bytes this process read from the checkpoint, by tensor name: with tensor parallelism, its slices only
    reads: ReadTally = field(default_factory=ReadTally)
    weight_offload: WeightOffload | None = None  # --cpu-offload-gb: the layers streamed from host memory


_HUB_FILES = ["*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # what serving reads


def is_hub_repo_id(model: str) -> bool:
    """`org/name` that names no local path: a Hugging Face repository id."""
    return (not os.path.exists(os.path.expanduser(model)) and model.count("/") == 1
            and not model.startswith((".", "/", "~")) and all(model.split("/")))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def download_hub_model(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A hub repository's snapshot directory in the HF cache (`download_dir`, else huggingface_hub's): found there,
    or fetched unless HF_HUB_OFFLINE is set. A clear ValueError when neither can be."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    offline = hub_offline()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=_HUB_FILES,
                                 local_files_only=offline)
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        where = download_dir or "the Hugging Face cache"
        how = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise ValueError(f"Model {repo_id!r}{f' at revision {revision!r}' if revision else ''} is not in {where} "
                         f"and {how}: download it there first (huggingface-cli download {repo_id}) or pass a local "
                         f"directory. ({type(e).__name__})") from None
    except (RepositoryNotFoundError, HFValidationError) as e:
        raise ValueError(f"Model {repo_id!r}: {e}") from None


def resolve_model_path(model: str | None) -> str:
    if not model:
        return gguf_file.embedded_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(f"Model path {model!r} does not exist. Pass a local HF model directory, a .gguf file or a "
                         "hub repository id (org/name), or leave --model out for the embedded SmolLM2.")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"Model directory {model!r} has no config.json.")
    return path


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path)


def load_hf_config(path: str, overrides: dict[str, Any] | None = None):
    """The model's HF config, with `overrides` (vLLM's --hf-overrides) applied."""
    from transformers import AutoConfig
    if _is_gguf(path):
        config = AutoConfig.for_model(**gguf_file.read_gguf_config(path))
    else:
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"Could not read {os.path.join(path, 'config.json')}: {e}") from e
    if overrides:
        apply_hf_overrides(config, overrides)
    return config


def apply_hf_overrides(config, overrides: dict[str, Any]) -> None:
    """Sets each key on the config; an object given for a sub-config (text_config, vision_config, ...) updates
    that sub-config key by key, as vLLM does, rather than replacing it."""
    from transformers import PretrainedConfig
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)


def load_tokenizer(path: str):
    if _is_gguf(path):
        return gguf_file.load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not load a tokenizer from {path!r}: {e}") from e


def iter_safetensors(path: str, tally: ReadTally | None = None) -> Iterator[tuple[str, LazyWeight]]:
    """Every tensor of the checkpoint as a LazyWeight: weight loaders narrow it to this rank's part, and
    only that part is read (`PySafeSlice` indexing); a whole tensor comes from `get_tensor`, as ever."""
    from safetensors import SafetensorError, safe_open
    for file in _safetensors_files(path):
        try:
            handle = safe_open(file, framework="pt")  # closed when its last LazyWeight is gone
            names = list(handle.keys())
            for name in names:
                yield name, _lazy_safetensor(handle, handle.get_slice(name), file, name, tally)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"Checkpoint file {file!r} is truncated or corrupt: {e}") from e


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def _lazy_safetensor(handle, part, file: str, name: str, tally: ReadTally | None) -> LazyWeight:
    shape = tuple(part.get_shape())
    whole = tuple((0, n) for n in shape)

    def read(index: Index) -> torch.Tensor:
        from safetensors import SafetensorError
        try:
            tensor = handle.get_tensor(name) if index == whole else part[tuple(slice(a, b) for a, b in index)]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"Checkpoint file {file!r} is truncated or corrupt: {e}") from e
        if tally is not None:
            tally.add(name, tensor.numel() * tensor.element_size())
        return tensor

    dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
    if dtype is None:  # a rarer type: ask the tensor (a view of the mapped file, nothing read)
        dtype = handle.get_tensor(name).dtype
    return LazyWeight(shape, dtype, read)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"Checkpoint index {index!r} is corrupt: {e}") from e
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"Model directory {path!r} has no *.safetensors weights "
                         "(use load_format='dummy' for random ones).")
    files = [os.path.join(path, n) for n in names]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ValueError(f"Checkpoint shard(s) missing: {', '.join(missing)}.")
    return files


def _count_tensors(path: str) -> int | None:
    """The checkpoint's tensors (a GGUF's, some of which the loader skips: the bar's total is an estimate); None
    where a header does not read (the loader's own read then names the damage)."""
    from safetensors import SafetensorError, safe_open
    try:
        if _is_gguf(path):
            return len(gguf_file._open(path).tensors)
        total = 0
        for file in _safetensors_files(path):
            with safe_open(file, framework="pt") as handle:  # reads the header only
                total += len(handle.keys())
        return total
    except (OSError, ValueError, SafetensorError):
        return None


def _with_progress(weights: Iterator[tuple[str, LazyWeight]], total: int | None
                   ) -> Iterator[tuple[str, LazyWeight]]:
    """The weights, a tqdm bar on stderr counting those loaded (vLLM's "Loading safetensors checkpoint shards"),
    shown by tensor-parallel rank 0 only. A tensor is read while the next is asked for, so the count is of
    tensors read."""
    from tqdm import tqdm

    from pressroom.distributed.parallel_state import get_tp_rank
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=get_tp_rank() != 0,
              dynamic_ncols=True, mininterval=0.5) as bar:
        for item in weights:
            yield item
            bar.update(1)
        bar.total = bar.n  # a GGUF's skipped tensors: end at 100 % of what was loaded
        bar.refresh()


def _fill_dummy(model: nn.Module, seed: int, device: str) -> None:
    """Uniform random weights drawn on `device` (an 8B model fills in a second on a GPU); a weight kept in host
    memory (--cpu-offload-gb) is drawn there too and copied over, so offloading changes no value."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif param.device.type == torch.device(device).type:
            param.data.uniform_(-0.05, 0.05, generator=gen)
        else:
            param.data.copy_(torch.empty_like(param.data, device=device).uniform_(-0.05, 0.05, generator=gen))


def _keep_4bit(config: ModelConfig, device: str) -> bool:
    # --batch-invariant: dense weights only (the 4-bit kernels' path depends on the batch's size)
    return config.quantization == "auto" and device == "cpu" and int4_kernel_available() and not config.batch_invariant


def _prepack(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            module.prepack_onednn()


def _pack_int4(model: nn.Module) -> None:
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    packed = sum(m.pack_int4() for m in linears)
    panels = [m.int4.panel for m in linears if getattr(m.int4, "panel", None) is not None]
    panel_bytes = sum(p.panel.nbytes + p.d.nbytes + p.m.nbytes for p in panels)
    logger.info("kept %d weight matrices in 4 bits, as the checkpoint ships them%s", packed,
                f", and their byte panels for steps of up to {VNNI_MAX_ROWS} tokens ({panel_bytes / 2**20:.0f} MiB)"
                if panels else "")


def _attach_quantization(model: nn.Module, method: QuantizationMethod) -> None:
    """Before loading: each linear layer (and experts' layer) the method quantizes takes its layer method (the
    rest stay dense)."""
    linear = experts = 0
    for prefix, module in model.named_modules():
        if isinstance(module, LinearBase) and (layer_method := method.layer_method(module, prefix)) is not None:
            module.set_quant_method(layer_method)
            linear += 1
        elif isinstance(module, FusedMoE) and (moe_method := method.moe_method(module, prefix)) is not None:
            module.set_quant_method(moe_method)
            experts += 1
    logger.info("quantization %s: %d linear layers, %d expert layers", method.name or type(method).__name__,
                linear, experts)


def _finish_quantization(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedMoE)) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)


def _build_model(model_cls: type[nn.Module], hf_config, config: ModelConfig, method: QuantizationMethod | None,
                 device: str, ggml_rows: bool = False,
                 before_allocation: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The model in the target dtype on `device`, each layer a quantization method takes handed to it. Those
    layers never allocate their dense weights: they are built with stand-ins of them (layers/deferred.py), the
    method chooses and creates its own tensors, and only then do the weights no method took get their dense
    tensors. `ggml_rows` (a GGUF whose projections may stay as shipped): the linear layers' weights stay
    stand-ins until some rows come dense (LinearBase allocates them then). Everything else (norms, embeddings,
    buffers computed at construction) is built as ever. `before_allocation(model)` runs once the methods took
    their layers, before the remaining dense weights are allocated (--cpu-offload-gb puts its layers' weights in
    host memory there, so the device never holds them)."""
    quantize = method is not None and config.quantization != "none"  # none: the method only reads the checkpoint
    deferred = DeferredWeights() if quantize or ggml_rows or before_allocation else None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device), deferred or nullcontext():
            model = model_cls(hf_config)
    finally:
        torch.set_default_dtype(previous)
    if quantize:
        _attach_quantization(model, method)
    if before_allocation is not None:
        before_allocation(model)
    if deferred is not None:
        later = [m.weight for m in model.modules() if isinstance(m, LinearBase) and m.quant_method is None] \
            if ggml_rows else []
        dense = deferred.allocate(model, later)
        if quantize:
            logger.info("quantization %s: %.2f GiB of dense weights never allocated",
                        method.name or type(method).__name__, (deferred.deferred_bytes - dense) / 2**30)
    return model


def _offload_bytes(config: ModelConfig, device: str) -> int:
    """--cpu-offload-gb in bytes; on the CPU none (vLLM's rule too): the weights already live in host memory."""
    if config.cpu_offload_gb and device == "cpu":
        logger.info("--cpu-offload-gb %g has no effect on the CPU: the weights already live in host memory",
                    config.cpu_offload_gb)
        return 0
    return int(config.cpu_offload_gb * 2**30)


def load_model(config: ModelConfig, device: str = "cpu") -> LoadedModel:
    path = resolve_model_path(config.model)
    fmt = config.load_format
    if fmt == "gguf" and not _is_gguf(path) or fmt == "safetensors" and _is_gguf(path):
        raise ValueError(f"load_format={fmt!r} does not match {path!r}.")
    hf_config = load_hf_config(path, config.hf_overrides)
    model_cls = resolve_architecture(hf_config)
    # dummy weights are random, never a checkpoint's quantized ones: a method quantizes them at load
    method = resolve_method(config.quantization, None if fmt == "dummy" else checkpoint_quantization(hf_config, path))
    if method is not None:
        method.check_device(device, config.dtype)
    keep_4bit = fmt != "dummy" and _keep_4bit(config, device)
    offload_bytes = _offload_bytes(config, device)
    host: list[tuple[OffloadPlan, list[torch.Tensor]]] = []  # the offloaded layers and their host buffers

    def keep_on_host(model: nn.Module) -> None:
        plan = plan_offload(model, offload_bytes)
        host.append((plan, place_on_host(plan, pin=device == "cuda")))

    model = _build_model(model_cls, hf_config, config, method, device, ggml_rows=keep_4bit and _is_gguf(path),
                         before_allocation=keep_on_host if offload_bytes else None)
    reads = ReadTally()
    if fmt == "dummy":
        _fill_dummy(model, config.seed, device)
    else:
        weights = gguf_file.iter_gguf_weights(path, keep_4bit, reads) if _is_gguf(path) else \
            iter_safetensors(path, reads)
        weights = _with_progress(weights, _count_tensors(path))
        if method is not None:
            weights = method.checkpoint_weights(model, weights)
        loaded = model.load_weights(weights)
        missing = sorted(model.expected_weights() - loaded)
        if missing:
            raise ValueError(f"Checkpoint at {path!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}.")
        if keep_4bit:
            _pack_int4(model)
    _finish_quantization(model)
    offload = None
    if host:  # before prepacking, which takes CPU weights (the host buffers') but never the device's slots
        plan, buffers = host[0]
        offload = WeightOffload(model, plan, device, buffers)
        logger.info("--cpu-offload-gb %g: %s", config.cpu_offload_gb, offload.describe())
    _prepack(model)
    if config.batch_invariant:
        make_batch_invariant(model)
    model.eval()
    return LoadedModel(model, hf_config, path, reads, offload)
