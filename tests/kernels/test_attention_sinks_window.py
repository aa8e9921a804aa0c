"""gpt-oss's attention: learned per-head sinks (a logit in each softmax's denominator, with no value) and a sliding
window, in the Triton paged-attention kernel (interpreter on the CPU) and the CPU backends, against the torch
reference; the masks and sinks are shown to change the result."""
from __future__ import annotations

import pytest
import torch
from conftest import scattered_paged_layout

from pressroom.attention.backend import AttentionMetadata
from pressroom.attention.torch_ref import CpuAttentionBackend, TorchAttentionBackend
from pressroom.kernels import cpu as cpu_kernels
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
WINDOW = 24
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 16
# (context after the step, query tokens): decodes inside and past the window (one over several 64-token tiles),
# a chunk after a cached prefix that crosses the window's edge, a fresh prompt longer than the window, a padding
# decode and a padding request
MIXED = [(20, 1), (150, 1), (0, 1), (90, 12), (40, 40), (0, 0)]
DECODES = [(150, 1), (5, 1), (64, 1), (300, 1), (0, 1)]

needs_triton = pytest.mark.skipif(not triton_kernels.available(),
                                  reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")


def _batch(specs, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tables, lens, loc, num_blocks = scattered_paged_layout(specs, BLOCK, gen)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    q = torch.randn(int(loc[-1]), HEADS, DIM, generator=gen).to(dtype)
    sinks = torch.randn(HEADS, generator=gen) * 2  # some heads' sinks outweigh their keys, some do not
    return q, cache, tables, lens, loc, sinks


def _reference(q, cache, tables, lens, loc, window, sinks):
    out = torch.zeros(q.shape, dtype=torch.float32)
    return attention.paged_attention_reference(q, cache, tables, lens, loc, DIM ** -0.5, out, window, sinks)


def _triton(q, cache, tables, lens, loc, specs, window, sinks, splits=1):
    out = torch.zeros_like(q, device=DEVICE)
    got = attention.paged_attention(q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE),
                                    loc.to(DEVICE), max(n for _, n in specs), DIM ** -0.5, out, splits,
                                    window=window, sinks=None if sinks is None else sinks.to(DEVICE))
    return got.float().cpu()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, with_sinks", [(WINDOW, True), (WINDOW, False), (None, True), (3, True)])
def test_triton_mixed_batch_with_sinks_and_window(dtype, window, with_sinks):
    q, cache, tables, lens, loc, sinks = _batch(MIXED, dtype)
    sinks = sinks if with_sinks else None
    got = _triton(q, cache, tables, lens, loc, MIXED, window, sinks)
    torch.testing.assert_close(got, _reference(q, cache, tables, lens, loc, window, sinks), atol=TOL[dtype],
                               rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_triton_split_kv_decodes_merge_the_sink_once(splits):
    """Split-KV decodes: splits wholly before the window hold nothing, and the merge adds each head's sink once."""
    q, cache, tables, lens, loc, sinks = _batch(DECODES, torch.float32, seed=1)
    got = _triton(q, cache, tables, lens, loc, DECODES, WINDOW, sinks, splits)
    torch.testing.assert_close(got, _reference(q, cache, tables, lens, loc, WINDOW, sinks), atol=2e-5, rtol=2e-5)


def test_sinks_and_window_change_the_reference():
    """Neither is vacuous: each moves every real row's output."""
    q, cache, tables, lens, loc, sinks = _batch(MIXED, torch.float32)
    plain = _reference(q, cache, tables, lens, loc, None, None)
    real = torch.cat([torch.arange(loc[b], loc[b + 1]) for b in range(len(MIXED)) if lens[b] > 0])
    with_sinks = _reference(q, cache, tables, lens, loc, None, sinks)
    assert ((plain - with_sinks)[real].abs().amax(dim=(1, 2)) > 1e-3).all()
    windowed = _reference(q, cache, tables, lens, loc, WINDOW, None)
    far = [i for b, (ctx, n) in enumerate(MIXED) for i in range(int(loc[b]), int(loc[b + 1]))
           if ctx - n + (i - int(loc[b])) >= WINDOW]  # queries with keys beyond their window
    assert far and ((plain - windowed)[far].abs().amax(dim=(1, 2)) > 1e-3).all()


BACKENDS = [TorchAttentionBackend, pytest.param(CpuAttentionBackend, marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler: the torch path is used instead"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [WINDOW, None])
def test_cpu_backends_attend_with_sinks(backend, window):
    """Every CPU path (decode rows, short queries after a cached context, a chunk after a cached prefix, fresh
    prompts alone and in equal-length runs) with sinks equals the reference."""
    specs = [(20, 1), (150, 1), (60, 3), (90, 30), (40, 40), (12, 12), (12, 12)]
    q, cache, tables, lens, loc, sinks = _batch(specs, torch.float32, seed=2)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(q.shape[0], KV_HEADS, DIM, generator=gen)
    v = torch.randn(q.shape[0], KV_HEADS, DIM, generator=gen)
    slots = torch.cat([tables[b, torch.arange(c - n, c) // BLOCK].long() * BLOCK + torch.arange(c - n, c) % BLOCK
                       for b, (c, n) in enumerate(specs)])
    meta = AttentionMetadata(num_decodes=2, num_decode_tokens=2, slot_mapping=slots, block_tables=tables.long(),
                             seq_lens=lens.long(), query_start_loc=loc.tolist(), seq_lens_host=lens.tolist())
    got = backend().forward(q, k, v, cache, meta, DIM ** -0.5, window, sinks)
    want = _reference(q, cache, tables, lens, loc, window, sinks)  # the cache holds this step's k, v now
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
