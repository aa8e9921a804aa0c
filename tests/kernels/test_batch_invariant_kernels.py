"""`--batch-invariant`'s kernels: a row's result is the same bits alone and inside batches of other sizes.

The Triton kernels run under TRITON_INTERPRET=1 on the CPU (tests/conftest.py), at tiny shapes; each
invariance check comes with the default path's counterpart where that one does differ, so the check can
fail. The CPU's own kernels (kernels/batch_invariant.py) are checked the same way.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.attention.triton_backend import TritonAttentionBackend
from pressroom.kernels import batch_invariant as invariant
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import attention, norm
from pressroom.kernels.triton.matmul import invariant_matmul

triton_only = pytest.mark.skipif(not triton_kernels.available(),
                                 reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCHES = [(0, 1), (0, 5), (3, 17), (0, 37)]  # (first row, rows): the same rows inside batches of other sizes


@pytest.fixture(autouse=True)
def _dot_of_a_row_alone(monkeypatch):
    """The Triton interpreter computes tl.dot with numpy's BLAS, and OpenBLAS's Haswell kernels (which
    OPENBLAS_CORETYPE=Haswell forces on some machines here) round a row by its place in the tile; a GPU's
    MMA does not. Each row of an interpreted dot is computed on its own, so that what these checks see is
    the kernels' own tiling and reduction order (which must not depend on the batch), not the BLAS's."""
    if DEVICE == "cuda":
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    dot = InterpreterBuilder.create_dot

    def row_by_row(self, a, b, d, *args):
        if a.data.ndim != 2:
            return dot(self, a, b, d, *args)
        rows = [dot(self, TensorHandle(a.data[i:i + 1], a.dtype), b, TensorHandle(d.data[i:i + 1], d.dtype), *args)
                for i in range(a.data.shape[0])]
        return TensorHandle(np.concatenate([r.data for r in rows]), rows[0].dtype)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", row_by_row)


def _rows_alone_and_batched(fn, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    return alone, [fn(x[start:start + n]) for start, n in BATCHES]


def _assert_rows_equal(alone: torch.Tensor, batched: list[torch.Tensor]) -> None:
    for (start, n), out in zip(BATCHES, batched):
        assert torch.equal(out, alone[start:start + n]), f"rows {start}..{start + n} differ inside a batch of {n}"


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matmul_rows_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 200, generator=gen).to(dtype).to(DEVICE)  # N and K off the 64-wide tiles
    bias = torch.randn(96, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(40, 200, generator=gen).to(dtype).to(DEVICE)
    alone, batched = _rows_alone_and_batched(lambda rows: invariant_matmul(rows, weight, bias), x)
    _assert_rows_equal(alone, batched)
    expected = F.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(batched[-1].float(), expected[:37], atol=tol, rtol=tol)


@triton_only
def test_triton_matmul_keeps_leading_dims_and_empty_inputs():
    weight = torch.randn(8, 16, device=DEVICE)
    x = torch.randn(2, 3, 16, device=DEVICE)
    torch.testing.assert_close(invariant_matmul(x, weight), x @ weight.T, atol=1e-5, rtol=1e-5)
    assert invariant_matmul(x[:0], weight).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="weight"):
        invariant_matmul(x, weight.T)


@triton_only
def test_triton_rms_norm_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 200, generator=gen).to(DEVICE)
    weight = torch.rand(200, generator=gen).to(DEVICE) + 0.5
    alone, batched = _rows_alone_and_batched(lambda rows: norm.rms_norm(rows, weight, 1e-6), x)
    _assert_rows_equal(alone, batched)


def test_cpu_linear_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 2048, generator=gen)  # K = 2048: oneDNN and BLAS block such a K by the batch
    x = torch.randn(40, 2048, generator=gen)
    alone, batched = _rows_alone_and_batched(lambda rows: invariant.linear(rows, weight), x)
    _assert_rows_equal(alone, batched)
    torch.testing.assert_close(batched[-1], x[:37] @ weight.T, atol=1e-3, rtol=1e-4)
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        alone, batched = _rows_alone_and_batched(lambda rows: invariant.linear(rows, weight[:0], None, packed), x)
        _assert_rows_equal(alone, batched)


def test_cpu_silu_and_mul_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 2 * 75, generator=gen) * 4  # 75: a row ends mid-vector, so torch's own has tails
    alone, batched = _rows_alone_and_batched(invariant.silu_and_mul, x[:40])
    _assert_rows_equal(alone, batched)
    assert torch.equal(invariant.silu_and_mul(x)[:40], alone)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(invariant.silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_torch_silu_rounds_a_vector_and_a_loop_tail_differently():
    """Why the CPU's silu_and_mul avoids torch's: an element alone (a loop tail) and inside a long run (SIMD)."""
    x = torch.linspace(-9, 9, 4099)
    assert not torch.equal(torch.cat([F.silu(x[i:i + 1]) for i in range(x.shape[0])]), F.silu(x))
    one_row = invariant.silu_and_mul(torch.cat([x, torch.ones_like(x)]).view(1, -1)).flatten()
    each_alone = invariant.silu_and_mul(torch.stack([x, torch.ones_like(x)], dim=1)).flatten()
    assert torch.equal(one_row, each_alone)


def test_exp_exact_is_close_to_exp_everywhere_it_is_used():
    x = torch.linspace(-87, 88, 100_003)
    rel = (invariant.exp_exact(x).double() / torch.exp(x.double()) - 1).abs().max()
    assert rel < 3e-7


# ---- attention: one request's prompt, computed whole, in chunks beside other requests, and as decodes ----

BLOCK, HEADS, KV_HEADS, DIM, CONTEXT = 16, 4, 2, 32, 70


class _Pool:
    """A paged KV cache holding request A's 70 tokens and two other requests' (B: 40 tokens, C: 50)."""

    def __init__(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(4)
        blocks = {"A": 5, "B": 3, "C": 4}
        order = torch.randperm(sum(blocks.values()) + 2, generator=gen).tolist()
        self.tables = {}
        for name, n in blocks.items():
            self.tables[name], order = order[:n], order[n:]
        self.kv_cache = torch.randn(2, sum(blocks.values()) + 2, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
        self.q = {name: torch.randn(n * BLOCK, HEADS, DIM, generator=gen).to(dtype) for name, n in blocks.items()}

    def run(self, queries: list[tuple[str, int, int]], invariant_mode: bool) -> list[torch.Tensor]:
        """Each (request, first position, last position + 1) as one query run of one launch (decodes, one
        token each, first); returns each run's output rows."""
        width = max(len(t) for t in self.tables.values())
        tables = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r, _, _ in queries],
                              dtype=torch.int32)
        seq_lens = torch.tensor([end for _, _, end in queries], dtype=torch.int32)
        lens = [end - start for _, start, end in queries]
        loc = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).int()
        q = torch.cat([self.q[r][start:end] for r, start, end in queries]).to(DEVICE)
        out = torch.zeros_like(q)
        attention.paged_attention(q, self.kv_cache.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE),
                                  loc.to(DEVICE), max(lens), DIM ** -0.5, out, batch_invariant=invariant_mode)
        return [out[a:b].cpu() for a, b in zip(loc[:-1].tolist(), loc[1:].tolist())]

    def whole(self, invariant_mode: bool) -> torch.Tensor:
        return self.run([("A", 0, CONTEXT)], invariant_mode)[0]

    def chunked(self, invariant_mode: bool) -> torch.Tensor:
        """A's prompt in three chunks, each beside a decode of B and a chunk of C."""
        runs = [self.run([("B", 39, 40), ("A", a, b), ("C", 30, 50)], invariant_mode)[1]
                for a, b in [(0, 5), (5, 37), (37, CONTEXT)]]
        return torch.cat(runs)

    def as_decodes(self, invariant_mode: bool) -> torch.Tensor:
        """Each of A's positions a one-token query, beside the decodes of B and C."""
        rows = self.run([("B", 39, 40), *[("A", p, p + 1) for p in range(CONTEXT)], ("C", 49, 50)], invariant_mode)
        return torch.cat(rows[1:-1])


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_query_is_the_same_whole_chunked_or_decoded(dtype):
    pool = _Pool(dtype)
    whole = pool.whole(True)
    assert torch.equal(pool.chunked(True), whole)
    assert torch.equal(pool.as_decodes(True), whole)
    expected = torch.zeros(CONTEXT, HEADS, DIM)
    attention.paged_attention_reference(pool.q["A"][:CONTEXT], pool.kv_cache,
                                        torch.tensor([pool.tables["A"]], dtype=torch.int32),
                                        torch.tensor([CONTEXT], dtype=torch.int32),
                                        torch.tensor([0, CONTEXT], dtype=torch.int32), DIM ** -0.5, expected)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(whole.float(), expected, atol=tol, rtol=tol)


@triton_only
def test_default_attention_differs_between_a_decode_and_a_chunk():
    """What the mode fixes: by default a decode walks the context in 64-token tiles and a chunk in 32-token ones."""
    pool = _Pool(torch.float32)
    assert not torch.equal(pool.as_decodes(False), pool.whole(False))


def test_invariant_attention_refuses_split_kv():
    pool = _Pool(torch.float32)
    with pytest.raises(ValueError, match="never splits"):
        attention.paged_attention(pool.q["A"][:1], pool.kv_cache, torch.tensor([pool.tables["A"]], dtype=torch.int32),
                                  torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1,
                                  1.0, torch.empty(1, HEADS, DIM), num_kv_splits=4, batch_invariant=True)


def test_invariant_builder_never_splits_the_kv():
    default = TritonAttentionBackend().make_metadata_builder("cpu", KV_HEADS, 512)
    fixed = TritonAttentionBackend(batch_invariant=True).make_metadata_builder("cpu", KV_HEADS, 512)
    assert default.num_kv_splits(1) > 1
    assert fixed.num_kv_splits(1) == 1
