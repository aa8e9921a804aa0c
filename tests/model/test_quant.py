"""4-bit GGUF matrices kept as shipped: exact unpacking, and the int4 kernel agrees with the dense path."""
from __future__ import annotations

import pytest
import torch

from pressroom.model import gguf_file
from pressroom.model.layers.linear import MergedColumnParallelLinear
from pressroom.model.layers.quant import Q4Weight, int4_kernel_available

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="this torch build has no int4 CPU kernel")


def test_q4_blocks_unpack_exactly_like_the_dequantizer(embedded_path):
    dense = dict(gguf_file.iter_gguf_weights(embedded_path))
    kept = dict(gguf_file.iter_gguf_weights(embedded_path, keep_4bit=True))
    q4 = {k: v for k, v in kept.items() if isinstance(v, Q4Weight)}
    assert len(q4) == 30 * 7  # q, k, v, o, gate, up, down in each layer
    for name, weight in q4.items():
        assert torch.equal(weight.dequantize(), dense[name]), name


def _random_q4(rows: int, cols: int, seed: int) -> Q4Weight:
    gen = torch.Generator().manual_seed(seed)
    return Q4Weight(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
                    torch.rand(rows, cols // 32, generator=gen) * 0.05,
                    torch.randn(rows, cols // 32, generator=gen) * 0.05)


def test_packed_int4_matches_dense_weights():
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = MergedColumnParallelLinear(64, [96, 96])
    finally:
        torch.set_default_dtype(torch.float32)
    gate, up = _random_q4(96, 64, 1), _random_q4(96, 64, 2)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    assert layer.pack_int4()
    x = torch.randn(3, 64).to(torch.bfloat16)
    dense = x.float() @ torch.cat([gate.dequantize(), up.dequantize()]).t()
    assert layer._use_int4(x)
    assert ((layer(x).float() - dense).abs() <= 0.02 * (1 + dense.abs())).all()


def test_a_matrix_with_a_dense_part_stays_dense():
    layer = MergedColumnParallelLinear(64, [96, 96])
    layer.weight_loader(layer.weight, _random_q4(96, 64, 3), 0)
    layer.weight_loader(layer.weight, torch.randn(96, 64), 1)
    assert not layer.pack_int4() and layer.int4 is None


def test_embedded_model_keeps_its_projections_in_4_bits():
    from pressroom import LLM
    llm = LLM(kv_cache_memory_gib=0.05)
    layer = llm.engine.model.model.layers[0]
    assert layer.mlp.gate_up_proj.int4 is not None and layer.self_attn.qkv_proj.int4 is not None
    dense = LLM(kv_cache_memory_gib=0.05, quantization="none")
    assert dense.engine.model.model.layers[0].mlp.gate_up_proj.int4 is None
