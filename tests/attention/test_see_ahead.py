"""Attention with `see_ahead` (Gemma 3's image tokens see the rest of their image): each backend's step (a decode, a
prompt chunk after a cached prefix whose image run starts inside it, a fresh prompt), with and without a sliding
window, equals attention under the dense mask "key <= position + see_ahead, inside the window"; the Triton backend
(its kernel causal, the chunks with such tokens recomputed by the torch reference) runs under TRITON_INTERPRET."""
from __future__ import annotations

import pytest
import torch

from pressroom.attention.torch_ref import CpuAttentionBackend, TorchAttentionBackend, write_kv

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 8
# (context length after the step, query tokens, see_ahead of the query tokens)
STEP = [(21, 1, [0]),  # a decode
        (30, 14, [0, 0, 0, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0, 0]),  # a chunk after 16 cached tokens: a 7-token run
        (12, 12, [0, 4, 3, 2, 1, 0, 0, 2, 1, 0, 0, 0])]  # a fresh prompt: two runs


def _dense(q, keys, values, positions, ahead, window, scale):
    """q [n, heads, dim] at `positions` over keys, values [length, kv_heads, dim], masked densely."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    key_pos = torch.arange(keys.shape[0])[None, :]
    seen = key_pos <= (positions + ahead)[:, None]
    if window is not None:
        seen &= key_pos > positions[:, None] - window
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    logits = logits.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)


def _step(backend, device: str, window: int | None):
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = 4
    kv_cache = torch.zeros(2, len(STEP) * blocks_per_seq, BLOCK, KV_HEADS, DIM)
    tables = torch.arange(len(STEP) * blocks_per_seq).view(len(STEP), blocks_per_seq)
    qs, ks, vs, slots, ahead, expected, loc = [], [], [], [], [], [], [0]
    scale = DIM ** -0.5
    for i, (length, n, see) in enumerate(STEP):
        keys = torch.randn(length, KV_HEADS, DIM, generator=gen)
        values = torch.randn(length, KV_HEADS, DIM, generator=gen)
        pos = torch.arange(length)
        seq_slots = tables[i, pos // BLOCK] * BLOCK + pos % BLOCK
        write_kv(kv_cache, keys[:-n], values[:-n], seq_slots[:-n])  # the cached prefix
        q = torch.randn(n, HEADS, DIM, generator=gen)
        expected.append(_dense(q, keys, values, pos[-n:], torch.tensor(see), window, scale))
        qs.append(q), ks.append(keys[-n:]), vs.append(values[-n:]), slots.append(seq_slots[-n:])
        ahead += see
        loc.append(loc[-1] + n)
    builder = backend.make_metadata_builder(device, KV_HEADS, blocks_per_seq)
    lens = [length for length, _, _ in STEP]
    meta = builder.build(num_decodes=1, slot_mapping=torch.cat(slots).to(device),
                         block_tables=tables.to(device, builder.index_dtype),
                         seq_lens=torch.tensor(lens, dtype=builder.index_dtype, device=device), query_start_loc=loc,
                         seq_lens_host=lens, max_query_len=max(n for _, n, _ in STEP))
    out = backend.forward(torch.cat(qs).to(device), torch.cat(ks).to(device), torch.cat(vs).to(device),
                          kv_cache.to(device), meta, scale, window, see_ahead=torch.tensor(ahead, device=device))
    return out.cpu(), torch.cat(expected)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("backend", [TorchAttentionBackend(), CpuAttentionBackend()], ids=["torch", "cpu"])
def test_see_ahead_matches_the_dense_mask(backend, window):
    out, expected = _step(backend, "cpu", window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_triton_backend_recomputes_chunks_that_see_ahead(window):
    triton_backend = pytest.importorskip("pressroom.attention.triton_backend", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: under TRITON_INTERPRET (tests/conftest.py)
    out, expected = _step(triton_backend.TritonAttentionBackend(), device, window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
