"""Sliding-window attention on the CPU backends: each query sees only its last `window` positions, on every
path (decode rows, short queries after a cached context, chunks after a cached prefix, fresh prompts alone
and in equal-length runs)."""
from __future__ import annotations

import pytest
import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.attention.torch_ref import CpuAttentionBackend, TorchAttentionBackend
from pressroom.kernels import cpu as cpu_kernels

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 4


def _reference(q, cache, tables, lens, loc, scale, window):
    """Per query token at position p: softmax over positions max(0, p - window + 1) .. p."""
    group = HEADS // KV_HEADS
    out = torch.empty(q.shape)
    for b, n in enumerate(lens):
        keys = cache[0, tables[b]].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        vals = cache[1, tables[b]].flatten(0, 1)[:n].repeat_interleave(group, dim=1)
        qlen = loc[b + 1] - loc[b]
        for i in range(qlen):
            pos, t = n - qlen + i, loc[b] + i
            lo = max(0, pos - window + 1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[t], keys[lo:pos + 1]) * scale, dim=-1)
            out[t] = torch.einsum("hn,nhd->hd", w, vals[lo:pos + 1])
    return out


def _step(qlens, lens, num_decodes, seed):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // BLOCK)
    cache = torch.randn(2, len(lens) * max_blocks + 1, BLOCK, KV_HEADS, DIM, generator=gen)
    tables = torch.arange(1, len(lens) * max_blocks + 1).view(len(lens), max_blocks)
    loc = [0]
    for n in qlens:
        loc.append(loc[-1] + n)
    slots = torch.tensor([int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK
                          for b, (n, qn) in enumerate(zip(lens, qlens)) for p in range(n - qn, n)])
    q = torch.randn(loc[-1], HEADS, DIM, generator=gen)
    k = torch.randn(loc[-1], KV_HEADS, DIM, generator=gen)
    v = torch.randn(loc[-1], KV_HEADS, DIM, generator=gen)
    meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes, slot_mapping=slots,
                             block_tables=tables, seq_lens=torch.tensor(lens), query_start_loc=loc, seq_lens_host=lens)
    return q, k, v, cache, meta


BACKENDS = [TorchAttentionBackend, pytest.param(CpuAttentionBackend, marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler: the torch path is used instead"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 6, 64])  # 64: wider than every context, nothing hidden
def test_mixed_batch_masks_by_window(backend, window):
    """Decodes (contexts shorter and longer than the window), verifications, a chunk after a cached prefix
    and a lone fresh prompt in one step."""
    qlens, lens = [1, 1, 1, 3, 20, 9], [17, 5, 30, 20, 33, 9]
    q, k, v, cache, meta = _step(qlens, lens, num_decodes=3, seed=window)
    got = backend().forward(q, k, v, cache, meta, 0.2, window)
    ref = _reference(q, cache, meta.block_tables, lens, meta.query_start_loc, 0.2, window)
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_length_fresh_prompts_mask_by_window(backend):
    q, k, v, cache, meta = _step([12, 12, 12], [12, 12, 12], num_decodes=0, seed=5)
    got = backend().forward(q, k, v, cache, meta, 0.2, 5)
    assert (got - _reference(q, cache, meta.block_tables, [12] * 3, meta.query_start_loc, 0.2, 5)).abs().max() < 1e-4


def test_window_changes_the_output():
    """The masks are not vacuous: with a window shorter than the contexts, outputs differ from full attention."""
    q, k, v, cache, meta = _step([1, 20], [30, 20], num_decodes=1, seed=9)
    full = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.2)
    meta.plan = None
    windowed = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.2, 4)
    assert (full[0] - windowed[0]).abs().max() > 1e-2 and (full[-1] - windowed[-1]).abs().max() > 1e-2
