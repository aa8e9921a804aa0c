"""The MLA kernel (absorbed multi-head latent attention over a paged latent cache) and the latent cache write
equal their torch references: on the CPU through Triton's interpreter with tiny shapes, on CUDA as they are
(tests/gpu adds DeepSeek-V2-Lite's real shapes)."""
from __future__ import annotations

import pytest
import torch
from conftest import scattered_paged_layout

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.attention import torch_ref
from pressroom.attention.backend import AttentionMetadata
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import cache, mla

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
SENTINEL = 123.0
# (context after this step, query tokens): decodes over one to several tiles, a padding decode, a chunk behind a
# cached prefix, a fresh prompt of several query blocks, an empty padding request
MIXED = [(37, 1), (150, 1), (0, 1), (74, 12), (34, 34), (0, 0)]
DECODES = [(150, 1), (5, 1), (64, 1), (0, 1), (300, 1)]


class LatentBatch:
    """A paged batch over a one-plane latent cache whose entries may carry extra values (DSA's indexer key)."""

    def __init__(self, specs, heads: int, latent: int, rope: int, block_size: int, dtype: torch.dtype,
                 extra: int = 0, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_tables, self.seq_lens, self.query_start_loc, num_blocks = scattered_paged_layout(
            specs, block_size, gen)
        self.max_query_len = max(q for _, q in specs)
        tokens = int(self.query_start_loc[-1])
        self.latent, self.dim = latent, latent + rope
        self.cache = torch.randn(num_blocks, block_size, 1, latent + rope + extra, generator=gen).to(dtype)
        # q a strided view: a wider buffer, as the model's concatenation of latent query and rope part is not
        self.q_buffer = torch.randn(tokens, heads, latent + rope + 8, generator=gen).to(dtype)
        self.scale = (latent + rope) ** -0.5

    @property
    def q(self) -> torch.Tensor:
        return self.q_buffer[..., :self.dim]

    def to(self, device: str) -> LatentBatch:
        for name in ("block_tables", "seq_lens", "query_start_loc", "cache", "q_buffer"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def run(self, splits: int) -> torch.Tensor:
        out = torch.full((*self.q.shape[:2], self.latent), SENTINEL, dtype=self.q.dtype, device=self.q.device)
        return mla.mla_attention(self.q, self.cache, self.block_tables, self.seq_lens, self.query_start_loc,
                                 self.max_query_len, self.scale, out, self.latent, splits)

    def reference(self) -> torch.Tensor:
        out = torch.full((*self.q.shape[:2], self.latent), SENTINEL, dtype=torch.float32, device=self.q.device)
        return mla.mla_attention_reference(self.q, self.cache, self.block_tables, self.seq_lens,
                                           self.query_start_loc, self.scale, out, self.latent)

    def padding_rows(self) -> torch.Tensor:
        owned = torch.zeros(self.q.shape[0], dtype=torch.bool)
        loc = self.query_start_loc.tolist()
        for b, ctx in enumerate(self.seq_lens.tolist()):
            owned[loc[b]:loc[b + 1]] = ctx > 0
        return ~owned


def _check(batch: LatentBatch, splits: int, tol: float) -> None:
    out = batch.run(splits)
    torch.testing.assert_close(out.float().cpu(), batch.reference().float().cpu(), atol=tol, rtol=tol)
    assert bool((out[batch.padding_rows()] == SENTINEL).all())


@pytest.mark.parametrize("dtype, heads, latent, rope, block_size, extra", [
    (torch.float32, 4, 32, 8, 16, 0),  # the tiny test models' shape: a rope part below the 16-wide dot minimum
    (torch.float32, 20, 32, 16, 4, 0),  # two head blocks, the second partly empty
    (torch.bfloat16, 16, 64, 16, 16, 0),
    (torch.float32, 4, 24, 8, 16, 32),  # a latent not a power of two; a DSA indexer key after each entry
])
def test_mla_attention_mixed_batch(dtype, heads, latent, rope, block_size, extra):
    batch = LatentBatch(MIXED, heads, latent, rope, block_size, dtype, extra).to(DEVICE)
    _check(batch, 1, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_mla_attention_decodes_with_split_kv(dtype, splits):
    batch = LatentBatch(DECODES, 16, 32, 16, 16, dtype).to(DEVICE)
    _check(batch, splits, TOL[dtype])


def test_mla_attention_merges_more_splits_than_one_merge_chunk():
    """64 splits over a 4,000-token context (31 in use at two 64-token tiles each): the merge walks its splits 16 at
    a time (batch-1 MLA decodes take up to 64 on a GPU with many SMs)."""
    batch = LatentBatch([(4000, 1), (300, 1), (0, 1)], 4, 32, 16, 16, torch.float32).to(DEVICE)
    _check(batch, 64, TOL[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mla_attention_reads_an_fp8_latent_cache(cache_dtype):
    batch = LatentBatch(DECODES, 16, 32, 16, 16, torch.bfloat16)
    batch.cache = batch.cache.to(cache_dtype)
    _check(batch.to(DEVICE), 3, TOL[torch.bfloat16])


def test_mla_attention_refuses_a_full_width_output():
    batch = LatentBatch(MIXED, 4, 32, 8, 16, torch.float32)
    out = torch.empty(*batch.q.shape)
    with pytest.raises(ValueError, match="out must be"):
        mla.mla_attention(batch.q, batch.cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.max_query_len, batch.scale, out, batch.latent)


def test_the_reference_equals_the_torch_backend_on_a_latent_cache():
    """Anchors the reference to the CPU backend (decodes first, a chunk, a fresh prompt)."""
    specs = [(9, 1), (20, 1), (30, 6), (5, 5)]
    batch = LatentBatch(specs, 4, 32, 8, 4, torch.float32)
    q, latent = batch.q, batch.latent
    meta = AttentionMetadata(num_decodes=2, num_decode_tokens=2, slot_mapping=_slots(batch, specs),
                             block_tables=batch.block_tables, seq_lens=batch.seq_lens.long(),
                             query_start_loc=batch.query_start_loc.tolist(), seq_lens_host=batch.seq_lens.tolist())
    k = _new_entries(batch, specs)
    expected = torch_ref.TorchAttentionBackend().forward(q, k, k[..., :latent], batch.cache.unsqueeze(0), meta,
                                                         batch.scale)
    torch.testing.assert_close(batch.reference(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_backend_writes_and_attends_a_latent_cache(splits):
    """The CUDA backend's MLA step: the new entries written (nothing past them in the entry touched), then
    the decodes and the chunks launched apart, as the reference attends over the whole batch."""
    from pressroom.attention.triton_backend import TritonAttentionBackend
    specs = [(37, 1), (150, 1), (400, 1), (74, 12), (34, 34)]
    batch = LatentBatch(specs, 4, 32, 8, 16, torch.float32, extra=16)
    k = _new_entries(batch, specs) + 1.0  # differs from what the cache holds
    slots = _slots(batch, specs)
    expected_cache = batch.cache.clone()
    expected_cache.view(-1, batch.cache.shape[-1])[slots, :k.shape[-1]] = k[:, 0]
    batch.to(DEVICE)
    meta = AttentionMetadata(num_decodes=3, num_decode_tokens=3, slot_mapping=slots.to(DEVICE),
                             block_tables=batch.block_tables, seq_lens=batch.seq_lens, query_start_loc=[],
                             seq_lens_host=[], query_start_loc_device=batch.query_start_loc,
                             max_query_len=batch.max_query_len, num_kv_splits=splits)
    k = k.to(DEVICE)
    out = TritonAttentionBackend().forward(batch.q, k, k[..., :batch.latent], batch.cache.unsqueeze(0), meta,
                                           batch.scale)
    assert torch.equal(batch.cache.cpu(), expected_cache)
    torch.testing.assert_close(out.cpu(), batch.reference().cpu(), atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_write_kv_fills_the_front_of_latent_entries_and_skips_padding():
    gen = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(1, 5, 4, 1, 40, generator=gen)
    k = torch.randn(6, 1, 24, generator=gen)
    slots = torch.tensor([3, -1, 17, 8, -1, 0])
    expected = kv_cache.clone()
    expected.view(-1, 40)[slots[slots >= 0], :24] = k[slots >= 0, 0]
    actual = kv_cache.to(DEVICE)
    cache.write_kv(actual, k.to(DEVICE), None, slots.to(DEVICE))
    assert torch.equal(actual.cpu(), expected)


def _slots(batch: LatentBatch, specs) -> torch.Tensor:
    block_size = batch.cache.shape[1]
    parts = []
    for b, (ctx, q) in enumerate(specs):
        pos = torch.arange(ctx - q, ctx)
        parts.append(batch.block_tables[b, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(parts)


def _new_entries(batch: LatentBatch, specs) -> torch.Tensor:
    """This step's cache entries [tokens, 1, latent + rope], as the cache holds them now."""
    dim = batch.q.shape[-1]
    return batch.cache.view(-1, batch.cache.shape[-1])[_slots(batch, specs), :dim].unsqueeze(1).clone()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need CUDA (the interpreter takes minutes)")
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, DeepSeek-V3
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_attention_at_deepseek_shapes(heads, cache_dtype):
    """Latent 512 + rope 64: 32 decodes up to 4k context (split-KV) and a mixed step with two 512-token chunks."""
    gen = torch.Generator().manual_seed(0)
    decodes = [(int(n), 1) for n in torch.randint(1, 4097, (32,), generator=gen)]
    for specs, splits in ((decodes, 4), (decodes + [(1536, 512), (700, 700)], 1)):
        batch = LatentBatch(specs, heads, 512, 64, 16, torch.bfloat16)
        batch.cache = batch.cache.to(cache_dtype)
        _check(batch.to(DEVICE), splits, TOL[torch.bfloat16])
