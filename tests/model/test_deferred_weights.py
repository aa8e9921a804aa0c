"""The layers a quantization method takes never allocate their dense weights (model/layers/deferred.py), nor do a
GGUF's projections kept as shipped: the bytes allocated while the loader builds (or loads) a model, counted op by
op, against the plain build and against building every weight dense first (as the loader did before)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pressroom.config import ModelConfig
from pressroom.model import loader
from pressroom.model.layers.deferred import DeferredWeights, held_weight
from pressroom.model.layers.fused_moe import FusedMoE
from pressroom.model.layers.linear import LinearBase
from pressroom.model.layers.quant import int4_kernel_available
from pressroom.model.quantization import LinearMethod, QuantizationMethod, resolve_method
from pressroom.model.registry import resolve_architecture

FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
_HELD = ("weight", "w13", "w2")  # the parameters a method may take


class Allocations(TorchDispatchMode):
    """Bytes of every tensor an op makes in new storage (a view or an in-place op makes none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                self.bytes += t.untyped_storage().nbytes() if t.layout == torch.strided else t.nbytes
        return out


def _storage(t: torch.Tensor) -> int | None:
    """The tensor's storage (None for oneDNN's opaque layout: always new)."""
    return t.untyped_storage()._cdata if t.layout == torch.strided else None


def _deepseek_fp8():
    """A tiny DeepSeek-V3 whose config ships DeepSeek's FP8 blocks (every linear layer and the experts taken)."""
    cfg = tiny_config("deepseek_v3")
    cfg.update(dict(vocab_size=2048, hidden_size=256, q_lora_rank=160, intermediate_size=320, kv_lora_rank=124))
    cfg.quantization_config = FP8_BLOCKS
    return cfg


def _build(hf_config, quantization: str, method: QuantizationMethod | None) -> tuple[nn.Module, int]:
    """The loader's build (construction, methods attached, the rest allocated) and the bytes it allocated."""
    config = ModelConfig(model="unused", dtype=torch.float32, quantization=quantization)
    with Allocations() as counted:
        model = loader._build_model(resolve_architecture(hf_config), hf_config, config, method, "cpu")
    return model, counted.bytes


def _build_dense_then_attach(hf_config, method: QuantizationMethod) -> int:
    """What the loader allocated before weights were deferred: the whole model dense, then the methods."""
    with Allocations() as counted:
        model = resolve_architecture(hf_config)(hf_config)
        loader._attach_quantization(model, method)
    return counted.bytes


def _taken(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (LinearBase, FusedMoE)) and m.quant_method is not None]


def _held_bytes(layers: list[nn.Module], dense: bool) -> int:
    """The held parameters' bytes: as the method holds them, or their dense size in fp32."""
    held = [getattr(m, name) for m in layers for name in _HELD if hasattr(m, name)]
    return sum(p.numel() * (4 if dense else p.element_size()) for p in held)


def _scale_bytes(layers: list[nn.Module]) -> int:
    return sum(b.numel() * b.element_size() for m in layers for n, b in m.named_buffers() if n.endswith("_scale"))


def test_fp8_blocks_never_allocate_the_dense_weights_of_the_layers_they_take():
    cfg = _deepseek_fp8()
    method = resolve_method("auto", FP8_BLOCKS)
    plain, plain_bytes = _build(cfg, "none", resolve_method("none", FP8_BLOCKS))  # dense: allocated as ever
    quantized, quantized_bytes = _build(cfg, "auto", method)
    before = _build_dense_then_attach(cfg, method)
    taken = _taken(quantized)
    assert sum(isinstance(m, FusedMoE) for m in taken) == 1 and len(taken) > 10 and not _taken(plain)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in taken if isinstance(m, LinearBase))
    dense, fp8 = _held_bytes(taken, dense=True), _held_bytes(taken, dense=False) + _scale_bytes(taken)
    assert plain_bytes >= sum(p.numel() * 4 for p in plain.parameters())
    # the build allocates what the plain one does, less every taken layer's dense weight, plus the FP8 form
    # (the stand-ins' one shared element: 4 bytes)
    assert quantized_bytes - (plain_bytes - dense + fp8) in range(0, 64)
    assert dense - (before - quantized_bytes) in range(0, 64)  # building dense, then attaching: all of it on top


class _RowInt8(LinearMethod):
    """An online method that takes the weight: int8 rows and a scale per row, quantized as they are stored."""

    def create_weights(self, layer: nn.Module) -> None:
        out, cols = layer.weight.shape
        layer.weight.data = torch.empty(out, cols, dtype=torch.int8, device=layer.weight.device)
        layer.register_buffer("weight_scale", torch.ones(out, 1, device=layer.weight.device))


class _RowInt8Method(QuantizationMethod):
    name = "row_int8"

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return _RowInt8() if prefix.endswith("_proj") else None


def test_an_online_method_allocates_only_what_it_keeps_dense():
    """fp8 quantizes after loading: it keeps the dense weights, allocated once (as before, never twice); a method
    that takes them at create_weights allocates none of them."""
    cfg = tiny_config("llama")
    _, plain_bytes = _build(cfg, "auto", None)
    fp8, fp8_bytes = _build(cfg, "fp8", resolve_method("fp8", None))
    assert len(_taken(fp8)) == 8 and all(m.weight.dtype == torch.float32 for m in _taken(fp8))
    assert fp8_bytes - plain_bytes in range(0, 64)
    int8, int8_bytes = _build(cfg, "test_deferred_weights:_RowInt8Method", _RowInt8Method())
    taken = _taken(int8)
    assert len(taken) == 8 and all(m.weight.dtype == torch.int8 for m in taken)
    dense = _held_bytes(taken, dense=True)
    assert dense == sum(p.numel() * 4 for name, p in fp8.named_parameters() if name.endswith("_proj.weight"))
    assert int8_bytes - (plain_bytes - dense + _held_bytes(taken, dense=False) + _scale_bytes(taken)) in range(0, 64)


@pytest.mark.parametrize("arch, quantization", [("llama", "fp8"), ("qwen2_moe", "fp8"), ("qwen2_moe", "mxfp4")])
def test_weights_no_method_took_are_made_as_the_layer_makes_them(arch, quantization):
    """Online methods keep the dense weights and fp8 leaves experts dense: each is the plain build's parameter
    (shape, dtype, device, attributes such as weight_loader), and everything else is built as ever (buffers
    computed at construction, to the bit)."""
    cfg = tiny_config(arch)
    plain, _ = _build(cfg, "auto", None)
    deferred, _ = _build(cfg, quantization, resolve_method(quantization, None))
    assert any(isinstance(m, FusedMoE) for m in deferred.modules()) == (arch == "qwen2_moe")
    want, got = dict(plain.named_parameters()), dict(deferred.named_parameters())
    assert want.keys() == got.keys()
    for name, p in got.items():
        q = want[name]
        assert (type(p), p.shape, p.dtype, p.device, p.stride(), p.requires_grad) == \
            (type(q), q.shape, q.dtype, q.device, q.stride(), q.requires_grad), name
        assert p.__dict__.keys() == q.__dict__.keys(), name
        if hasattr(q, "weight_loader"):
            assert p.weight_loader.__func__ is q.weight_loader.__func__, name
    want_buffers, got_buffers = dict(plain.named_buffers()), dict(deferred.named_buffers())
    for name, b in want_buffers.items():
        assert torch.equal(got_buffers[name], b), name


def test_a_stand_in_refuses_writes_until_allocated():
    """A held weight no method took and that was never allocated fails loudly when loaded into, not silently."""
    with DeferredWeights() as deferred:
        layer = nn.Module()
        layer.weight = held_weight(64, 32)
        layer.weight.weight_loader = "kept"
    assert deferred.is_stand_in(layer.weight) and layer.weight.untyped_storage().nbytes() == 4
    with pytest.raises(RuntimeError):
        layer.weight.data[3:5].copy_(torch.ones(2, 32))
    assert deferred.allocate(layer) == 64 * 32 * 4
    layer.weight.data[3:5].copy_(torch.ones(2, 32))
    assert layer.weight.is_contiguous() and layer.weight.weight_loader == "kept"
    assert deferred.allocate(layer) == 0 and held_weight(2, 2).untyped_storage().nbytes() == 16  # outside: dense


HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 256, 512, 320, 4, 2
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _q8_rows(rows: int, cols: int, rng) -> np.ndarray:
    """Random Q8_0 blocks (an f16 scale, then 32 int8 values, per 32 inputs)."""
    raw = rng.integers(-127, 128, (rows, cols // 32, 34)).astype(np.int8).view(np.uint8)
    raw[..., :2] = np.full((rows, cols // 32, 1), 2e-3, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> str:
    """A tiny llama GGUF whose projections are Q8_0 (kept as shipped on the CPU), the rest fp32."""
    path = str(tmp_path_factory.mktemp("q8-gguf") / "tiny.gguf")
    rng, writer = np.random.default_rng(0), gguf.GGUFWriter(path, "llama")
    for add, value in [(writer.add_block_count, 2), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0)]:
        add(value)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(2):
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _q8_rows(rows, cols, rng), raw_dtype=Q8_0)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path: str, quantization: str) -> tuple[nn.Module, int]:
    with Allocations() as counted:
        model = loader.load_model(ModelConfig(model=path, dtype=torch.float32, quantization=quantization), "cpu").model
    return model, counted.bytes


@pytest.mark.skipif(not int4_kernel_available(), reason="GGUF forms are kept only where the CPU kernels are")
def test_gguf_projections_kept_as_shipped_never_allocate_their_dense_weights(q8_gguf, monkeypatch):
    kept, kept_bytes = _load(q8_gguf, "auto")
    projections = [m for m in kept.modules() if isinstance(m, LinearBase)]
    assert len(projections) == 8 and all(m.ggml is not None and m.weight.numel() == 0 for m in projections)
    build = loader._build_model
    monkeypatch.setattr(loader, "_build_model", lambda *args, **kw: build(*args, **{**kw, "ggml_rows": False}))
    _, dense_first_bytes = _load(q8_gguf, "auto")  # as before: every projection built dense, then dropped
    kv = KV_HEADS * HIDDEN // HEADS
    dense = 2 * 4 * HIDDEN * (HIDDEN + 2 * kv + HIDDEN + 3 * FFN)  # two layers' projections in fp32
    assert dense - (dense_first_bytes - kept_bytes) in range(0, 64)
