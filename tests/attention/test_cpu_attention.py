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
                             seq_lens=lens, query_start_loc=list(range(seqs + 1)), seq_lens_host=lens.tolist(),
                             max_decode_seq_len=int(lens.max()))
    return q, k, v, cache, meta


@pytest.mark.parametrize("dim", [32, 64, 128])  # 64 and 128 take the specialised kernels
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_matches_reference(dtype, tol, dim):
    q, k, v, cache, meta = _decode_batch(dtype, dim=dim)
    ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.2)
    got = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)
    assert got.dtype == dtype
    assert (got.float() - ref.float()).abs().max() < tol


def test_kernel_reads_only_its_own_blocks():
    q, k, v, cache, meta = _decode_batch(torch.float32, seed=3)
    ref = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)
    used = set(meta.block_tables.flatten().tolist())
    cache[:, [b for b in range(1, cache.shape[1]) if b not in used]] = float("nan")
    again = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.2)
    assert torch.equal(ref, again)
