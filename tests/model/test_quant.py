"""GGUF matrices kept as shipped (Q4 projections, a Q8_0 LM head): exact unpacking, and the kernels that
take them agree with the dense path."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import cpu
from pressroom.model import gguf_file
from pressroom.model.layers.linear import MergedColumnParallelLinear
from pressroom.model.layers.quant import (
    VNNI_MAX_ROWS,
    NibbleMatrix,
    PackedInt4,
    Q4Weight,
    Q8Blocks,
    Q8Weight,
    int4_kernel_available,
    q4_panels,
    q8_panels,
)

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="this torch build has no int4 CPU kernel")


def test_q4_blocks_unpack_exactly_like_the_dequantizer(embedded_path):
    dense = {name: lazy.load() for name, lazy in gguf_file.iter_gguf_weights(embedded_path)}
    kept = {name: lazy.load() for name, lazy in gguf_file.iter_gguf_weights(embedded_path, keep_4bit=True)}
    q4 = {k: v for k, v in kept.items() if isinstance(v, Q4Weight)}
    assert len(q4) == 30 * 7  # q, k, v, o, gate, up, down in each layer
    for name, weight in q4.items():
        assert torch.equal(weight.dequantize(), dense[name]), name
    head = kept["model.embed_tokens.weight"]  # Q8_0 in this file, tied to the LM head
    assert isinstance(head, Q8Weight) and torch.equal(head.dequantize(), dense["model.embed_tokens.weight"])


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
    assert _close(layer(x).float(), dense, 0.02)


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


def _random_q8(rows: int, cols: int, seed: int) -> Q8Weight:
    gen = torch.Generator().manual_seed(seed)
    return Q8Weight(torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8),
                    torch.rand(rows, cols // 32, generator=gen) * 0.01)


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    """Activations are rounded to int8 per block of 32 (llama.cpp's arithmetic): errors of about
    1/254 of each block's largest input, summed over the row."""
    return bool(((y - ref).abs() <= rel * ref.abs().max()).all())


@pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch int4 kernel is used instead")
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("rows, cols", [(96, 128), (37, 128), (96, 96)])  # 37 rows: not a multiple of the
def test_c_quant_kernels_match_dense(tokens, rows, cols):                   # four-row tile; 96: an odd block
    gen = torch.Generator().manual_seed(tokens * 100 + rows)
    x = torch.randn(tokens, cols, generator=gen)
    q4 = _random_q4(rows, cols, tokens)
    assert _close(NibbleMatrix.pack(q4).matmul(x), x @ q4.dequantize().t(), 0.02)
    q8 = _random_q8(rows, cols, tokens)
    assert _close(q8.matmul(x), x @ q8.dequantize().t(), 0.02)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler: the torch int4 kernel is used instead")
@pytest.mark.parametrize("rows, cols", [(64, 576), (37, 96)])
def test_a_tokens_product_has_the_same_bits_alone_and_among_rows(rows, cols):
    # a verification's rows must give what decoding each token alone gives, or greedy speculation drifts
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(9, cols, generator=gen)
    q8 = _random_q8(rows, cols, 4)
    q8 = Q8Weight(q8.q, q8.scale.half().float())
    # the 4-bit tiles take up to 4 tokens an unpacked block, the Q8_0 kernels 4 tokens a pass: 9 = 4 + 4 + 1
    for matrix in (NibbleMatrix.pack(_random_q4(rows, cols, 3)), q8, Q8Blocks.pack(q8)):
        together = matrix.matmul(x)
        for t in range(x.shape[0]):
            assert torch.equal(matrix.matmul(x[t:t + 1]), together[t:t + 1]), (type(matrix).__name__, t)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("tokens", [1, 4, 9])  # 9: two passes of four tokens a row, then one alone
@pytest.mark.parametrize("rows, cols", [(37, 96), (300, 640)])
def test_q8_blocks_compute_the_two_array_forms_bits(tokens, rows, cols):
    # the LM head's GGUF-block form must give what Q8Weight (and llama.cpp) gives, to the bit
    q8 = _random_q8(rows, cols, tokens)
    q8 = Q8Weight(q8.q, q8.scale.half().float())  # GGUF's scales are fp16 values
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(rows))
    blocks = Q8Blocks.pack(q8)
    assert blocks.shape == q8.shape and blocks.blocks.shape == (rows, cols // 32 * 34)
    assert torch.equal(blocks.matmul(x), q8.matmul(x))


def test_q8_blocks_refuse_scales_that_are_not_fp16():
    with pytest.raises(ValueError, match="fp16"):
        Q8Blocks.pack(_random_q8(8, 64, 0))


@pytest.mark.skipif(not q4_panels(), reason="no C compiler: no panel, the row kernel serves up to 8 rows")
def test_the_vnni_panel_gives_the_row_kernels_bits():
    # 37 rows: two 16-row vectors then a masked one; 70 tokens: tiles of 4 tokens, then 2
    q4 = _random_q4(37, 96, 5)
    matrix = NibbleMatrix.pack(q4)
    assert matrix.panel is not None and matrix.max_rows == VNNI_MAX_ROWS
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(5))
    assert torch.equal(matrix.matmul(x), cpu.q4_matmul(x, matrix.qs, matrix.scale, matrix.min, 37))
    assert _close(matrix.matmul(x), x @ q4.dequantize().t(), 0.02)


@pytest.mark.skipif(not q8_panels(), reason="no AVX-512 VNNI: the LM head keeps the row kernel")
def test_the_q8_panel_gives_the_row_kernels_bits():
    # the LM head's Q8_0 panel: llama.cpp's bits (the row kernel's) at any number of tokens, odd ones included
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(5))
    q8 = _random_q8(37, 96, 5)
    q8 = Q8Weight(q8.q, q8.scale.half().float())
    head = Q8Blocks.pack(q8)
    assert head.panel is not None
    for tokens in (2, 3, 70):
        assert torch.equal(head.matmul(x[:tokens]), cpu.ggml_q8_0_blocks_matmul(x[:tokens], head.blocks)), tokens


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_c_quant_kernels_handle_a_zero_block():
    x = torch.zeros(1, 64)
    x[0, 40] = 3.0  # the first block all zeros: its scale is 0, not a division by zero
    q4 = _random_q4(8, 64, 5)
    assert _close(NibbleMatrix.pack(q4).matmul(x), x @ q4.dequantize().t(), 0.01)


def test_torch_int4_fallback_matches_dense():
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch build has no int4 CPU kernel")
    q4 = _random_q4(96, 128, 7)
    x = torch.randn(3, 128)
    assert _close(PackedInt4.pack(q4).matmul(x), x @ q4.dequantize().t(), 0.02)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler: the LM head stays dense")
def test_embedded_lm_head_keeps_q8_and_agrees_with_dense():
    from pressroom import LLM
    llm = LLM(kv_cache_memory_gib=0.05)
    model = llm.engine.model
    assert model.lm_head.q8 is not None and model.lm_head.weight is model.model.embed_tokens.weight
    # a fixed draw: the global generator's state depends on the tests before, and a random row can hold a near-tie
    hidden = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(llm.engine.config.model.dtype)
    quant = model.compute_logits(hidden).float()
    dense = hidden.float() @ model.lm_head.weight.float().t()
    assert _close(quant, dense, 0.02)
    assert (quant.argmax(-1) == dense.argmax(-1)).all()
