"""The C paged-decode kernel equals the torch reference backend on ragged batches."""
from __future__ import annotations

import pytest
import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.attention.torch_ref import CpuAttentionBackend, TorchAttentionBackend
from pressroom.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the torch path is used instead")


def _decode_batch(dtype: torch.dtype, seqs=7, heads=8, kv_heads=2, dim=32, block_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (seqs,), generator=gen)
    max_blocks = int(lens.max() + block_size - 1) // block_size
    num_blocks = seqs * max_blocks + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:seqs * max_blocks] + 1).view(seqs, max_blocks)
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    k = torch.randn(seqs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(seqs, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens.tolist())])
    meta = AttentionMetadata(num_decodes=seqs, num_decode_tokens=seqs, slot_mapping=slots, block_tables=tables,
                             seq_lens=lens, query_start_loc=list(range(seqs + 1)), seq_lens_host=lens.tolist())
    return q, k, v, cache, meta


@pytest.mark.parametrize("dim", [32, 64, 128])  # 64 and 128 take the specialised kernels
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_matches_reference(dtype, tol, dim):
    q, k, v, cache, meta = _decode_batch(dtype, dim=dim)
    ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.2)
    got = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)
    assert got.dtype == dtype
    assert (got.float() - ref.float()).abs().max() < tol


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("dim", [32, 256])  # 256 (Gemma 3's head size) takes a specialised kernel
def test_paged_decode_with_a_sliding_window_matches_reference(window, dim):
    """Each sequence sees its last `window` keys only (contexts of 1-39 tokens: some shorter than the window)."""
    q, k, v, cache, meta = _decode_batch(torch.float32, dim=dim, seed=1)
    ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.2, window)
    got = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2, window)
    assert (got - ref).abs().max() < 1e-5
    assert (got - CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)).abs().max() > 1e-3  # it hid keys


def test_kernel_reads_only_its_own_blocks():
    q, k, v, cache, meta = _decode_batch(torch.float32, seed=3)
    ref = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)
    used = set(meta.block_tables.flatten().tolist())
    cache[:, [b for b in range(1, cache.shape[1]) if b not in used]] = float("nan")
    again = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)
    assert torch.equal(ref, again)


def _reference(q, cache, tables, lens: list[int], loc: list[int], scale: float) -> torch.Tensor:
    """Per request and query token: softmax over its context up to and including its own position."""
    kv_heads = cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n in enumerate(lens):
        keys = cache[0, tables[b]].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, heads, dim]
        vals = cache[1, tables[b]].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        qlen = loc[b + 1] - loc[b]
        for i in range(qlen):
            pos = n - qlen + i
            t = loc[b] + i
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), keys[:pos + 1]) * scale, dim=-1)
            out[t] = torch.einsum("hn,nhd->hd", w, vals[:pos + 1])
    return out


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
def test_mixed_batch_short_queries_run_as_decode_rows(backend):
    """Decodes, draft verifications (3 and 5 tokens after a cached context), a long chunk after a cached
    prefix and a fresh prompt in one step; the short ones take the batched decode path as rows."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, bs = 8, 2, 64, 4
    qlens = [1, 1, 1, 3, 5, 20, 9]
    lens = [17, 5, 30, 20, 9, 33, 9]  # the last request is a fresh prompt (nothing cached)
    max_blocks = -(-max(lens) // bs)
    cache = torch.randn(2, len(lens) * max_blocks + 1, bs, kv_heads, dim, generator=gen)
    tables = torch.arange(1, len(lens) * max_blocks + 1).view(len(lens), max_blocks)
    loc = [0]
    for n in qlens:
        loc.append(loc[-1] + n)
    slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs
                          for b, (n, qn) in enumerate(zip(lens, qlens)) for p in range(n - qn, n)])
    tokens = loc[-1]
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    meta = AttentionMetadata(num_decodes=3, num_decode_tokens=3, slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.tensor(lens), query_start_loc=loc, seq_lens_host=lens)
    got = backend().forward(q, k, v, cache, meta, 0.125)
    assert meta.plan.rows is not None and meta.plan.num_rows == 3 + 3 + 5  # verifications joined the decodes
    assert (got - _reference(q, cache, tables, lens, loc, 0.125)).abs().max() < 1e-4
