"""DeepSeek-V4's decode-path kernels (kernels/triton/v4_attention.py) against torch written here, on the CPU
interpreter (CUDA where there is one): the joint softmax of each query over its sliding window, its compressed
entries (all causal ones, or the chosen ones) and its sink, read from paged caches; the lightning indexer's
choice of entries. Batches mix contexts: inside the first window, fewer entries than the top-k, far past both,
and padding rows (position -1)."""
from __future__ import annotations

import pytest
import torch

from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton.dsa import token_positions

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, DIM, INDEX_HEADS, INDEX_DIM, WINDOW, TOPK = 5, 32, 16, 16, 12, 6


def _paged(lengths: list[int], block_size: int, rate: int, gen: torch.Generator, dtype: torch.dtype):
    """Block tables over shuffled blocks (block 0 unused: the padding block), a window cache and a compressed
    cache (entries [values | indexer key]) of random contents."""
    per_seq = max(-(-n // block_size) for n in lengths) + 1
    order = (torch.randperm(len(lengths) * per_seq, generator=gen) + 1).view(len(lengths), per_seq)
    blocks = len(lengths) * per_seq + 1
    window = torch.randn(1, blocks, block_size, 1, DIM, generator=gen).to(dtype)
    per_block = max(1, block_size // rate)
    entries = torch.randn(1, blocks, per_block, 1, DIM + INDEX_DIM, generator=gen).to(dtype)
    return order, window, entries


def _entry_rows(entries: torch.Tensor, table: torch.Tensor, rate: int, block_size: int, count: int) -> torch.Tensor:
    """A request's entries 0 .. count - 1 by their definition: entry w in the block of token w * rate + rate - 1."""
    last = torch.arange(count) * rate + rate - 1
    per_block = entries.shape[2]
    return entries[0, table[last // block_size], last % block_size // rate if per_block > 1 else 0, 0]


def _paged_keys(window_cache, tables, block_size):
    return lambda t, r, key_pos: window_cache[0, tables[r, key_pos // block_size], key_pos % block_size, 0]


def _reference(q, window_keys, entries, tables, req, pos, sinks, rate, block_size, chosen=None, sliding=False):
    """`window_keys(token, request, key positions)`: the window's K=V rows a query reads."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        p, r = int(pos[t]), int(req[t])
        if p < 0:
            continue
        key_pos = torch.arange(max(0, p - WINDOW + 1), p + 1)
        keys = window_keys(t, r, key_pos).float()
        if not sliding:
            rows = _entry_rows(entries, tables[r], rate, block_size, (p + 1) // rate)[:, :DIM].float()
            if chosen is not None:
                rows = rows[chosen[t][(chosen[t] >= 0) & (chosen[t] < rows.shape[0])].long()]
            keys = torch.cat((keys, rows))
        logits = q[t].float() @ keys.t() * DIM ** -0.5
        logits = torch.cat((logits, sinks[:, None]), dim=1)
        out[t] = logits.softmax(dim=-1)[:, :-1] @ keys
    return out


def _batch(lengths: list[int], padding: int, gen: torch.Generator, dtype: torch.dtype):
    """One query per request at its last position, then `padding` rows of no request."""
    q = torch.randn(len(lengths) + padding, HEADS, DIM, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths)
    loc = torch.tensor([0] + list(range(1, len(lengths) + 1)), dtype=torch.int32)
    req, pos = token_positions(loc, seq_lens, q.shape[0])
    return q, req, pos


LENGTHS = [1, 7, 12, 13, 30, 77]  # inside the first window and entry, at its end, fewer entries than top-k, far past


def _random_choice(pos: torch.Tensor, rate: int, gen: torch.Generator) -> torch.Tensor:
    """A random subset of each query's causal entries, then entries past them (as `choose_entries` leaves them:
    unused, dsa.py's rule)."""
    chosen = torch.full((pos.shape[0], 4), -1, dtype=torch.int64)
    for t, p in enumerate(pos.tolist()):
        causal = max(0, (p + 1) // rate)
        picks = torch.randperm(causal, generator=gen)[:4]
        chosen[t, :len(picks)] = picks
        chosen[t, len(picks):] = causal + torch.arange(4 - len(picks))
    return chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode, rate, block_size, splits", [("hca", 16, 8, None), ("hca", 4, 16, 3),
                                                            ("csa", 4, 8, 2), ("sliding", 4, 8, 2)])
def test_attention_matches_torch(dtype, mode, rate, block_size, splits):
    """Window keys, entries (HCA: every causal one, over entries that span two blocks or share one; CSA: a chosen
    subset in any order, entries it cannot see past it) and sinks in one softmax; with and without key splits."""
    from pressroom.kernels.triton.v4_attention import entry_table, v4_attention
    gen = torch.Generator().manual_seed(rate + block_size)
    tables, window, entries = _paged(LENGTHS, block_size, rate, gen, dtype)
    q, req, pos = _batch(LENGTHS, 2, gen, dtype)
    sinks = torch.randn(HEADS, generator=gen)
    chosen = _random_choice(pos, rate, gen) if mode == "csa" else None
    on = dict(device=DEVICE)
    table, per_block = entry_table(tables.to(**on), rate, block_size)
    packed = None if mode == "sliding" else (entries.to(**on), table, per_block, rate)
    got = v4_attention(q.to(**on), req.to(**on), pos.to(**on), sinks.to(**on), WINDOW, DIM ** -0.5,
                       paged=(window.to(**on), tables.to(**on)), entries=packed,
                       chosen=None if chosen is None else chosen.to(**on), num_splits=splits)
    want = _reference(q, _paged_keys(window, tables, block_size), entries, tables, req, pos, sinks, rate, block_size,
                      chosen, mode == "sliding")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)
    assert torch.all(got[len(LENGTHS):] == 0)  # padding rows read nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode, splits", [("sliding", None), ("hca", 2), ("csa", 3)])
def test_attention_reads_the_window_from_rings_and_the_step(dtype, mode, splits):
    """Ring mode: a request's positions before its first query of the step from its ring (position p at row
    p % rows, rows to spare as for drafts), from there on from the step's own K=V; chunks of several queries
    (one longer than the window) beside decodes, then padding rows."""
    from pressroom.kernels.triton.v4_attention import entry_table, v4_attention
    rate, block_size, rows = 4, 8, WINDOW + 3
    queries = [1, 1, 5, 1, 13, 3]  # each request's queries this step: its last positions
    gen = torch.Generator().manual_seed(len(mode) + (splits or 0))
    tables, _, entries = _paged(LENGTHS, block_size, rate, gen, dtype)
    tokens = sum(queries) + 2
    q = torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype)
    kv = torch.randn(tokens, DIM, generator=gen).to(dtype)
    rings = torch.randn(8, rows, DIM, generator=gen).to(dtype)
    slots = torch.tensor([3, 1, 4, 6, 2, 5])
    loc = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist(), dtype=torch.int32)
    req, pos = token_positions(loc, torch.tensor(LENGTHS), tokens)
    sinks = torch.randn(HEADS, generator=gen)
    chosen = _random_choice(pos, rate, gen) if mode == "csa" else None
    on = dict(device=DEVICE)
    table, per_block = entry_table(tables.to(**on), rate, block_size)
    packed = None if mode == "sliding" else (entries.to(**on), table, per_block, rate)
    got = v4_attention(q.to(**on), req.to(**on), pos.to(**on), sinks.to(**on), WINDOW, DIM ** -0.5,
                       ring=(rings.to(**on), slots.to(**on), loc.to(**on), kv.to(**on)), entries=packed,
                       chosen=None if chosen is None else chosen.to(**on), num_splits=splits)

    def window_keys(t, r, key_pos):
        first = LENGTHS[r] - queries[r]
        return torch.stack([kv[t - (int(pos[t]) - k)] if k >= first else rings[slots[r], k % rows]
                            for k in key_pos.tolist()])

    want = _reference(q, window_keys, entries, tables, req, pos, sinks, rate, block_size, chosen, mode == "sliding")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)
    assert torch.all(got[sum(queries):] == 0)  # padding rows read nothing


@pytest.mark.parametrize("rate, block_size, dtype", [(4, 8, torch.float32), (16, 8, torch.float32),
                                                     (4, 16, torch.bfloat16)])
def test_indexer_chooses_the_best_causal_entries(rate, block_size, dtype):
    """Each query's top-k causal entries by sum_h w_h relu(q_h . k / sqrt(dim)), best first, past its count only
    entries it cannot see (dsa.py's rule: unused); the entries read through the block table (several per block, or
    one window over two blocks)."""
    from pressroom.kernels.triton.v4_attention import choose_entries, entry_table
    gen = torch.Generator().manual_seed(rate)
    tables, _, entries = _paged(LENGTHS, block_size, rate, gen, dtype)
    q, req, pos = _batch(LENGTHS, 1, gen, torch.float32)
    index_q = torch.randn(q.shape[0], INDEX_HEADS, INDEX_DIM, generator=gen)
    index_w = torch.randn(q.shape[0], INDEX_HEADS, generator=gen)
    on = dict(device=DEVICE)
    table, per_block = entry_table(tables.to(**on), rate, block_size)
    got = choose_entries(index_q.to(**on), index_w.to(**on), (entries.to(**on), table, per_block, rate),
                         req.to(**on), pos.to(**on), DIM, TOPK).cpu()
    for t, p in enumerate(pos.tolist()):
        count = max(0, (p + 1) // rate)
        keys = _entry_rows(entries, tables[int(req[t])], rate, block_size, count)[:, DIM:].float()
        scores = index_w[t] @ torch.relu(index_q[t] @ keys.t() * INDEX_DIM ** -0.5)
        want = scores.topk(min(TOPK, count)).indices.tolist()
        assert got[t, :len(want)].tolist() == want
        assert torch.all(got[t, len(want):] >= count)


def _mix_reference(kv_ring, gate_ring, bias, slot: int, pos: int, dim: int, overlap: bool) -> torch.Tensor:
    """The entry of the window `pos` closes, from the ring rows of its positions (CSA: window w - 1's first-half
    features, none before window 0, beside window w's second-half ones), softmax-gated per feature."""
    m, ring = bias.shape[0], kv_ring.shape[1]
    w = pos // m
    rows = (w * m + torch.arange(m)) % ring
    kv, gate = kv_ring[slot, rows, -dim:].float(), gate_ring[slot, rows, -dim:].float() + bias[:, -dim:]
    if overlap and w > 0:
        prev = ((w - 1) * m + torch.arange(m)) % ring
        kv = torch.cat((kv_ring[slot, prev, :dim].float(), kv))
        gate = torch.cat((gate_ring[slot, prev, :dim].float() + bias[:, :dim], gate))
    return (kv * gate.softmax(dim=0)).sum(dim=0)


@pytest.mark.parametrize("rate, dim, overlap, dtype, windows", [
    (16, 32, False, torch.float32, 1), (32, 40, False, torch.bfloat16, 1), (4, 24, True, torch.float32, 2),
    (4, 24, True, torch.bfloat16, 2),
    (4, 24, True, torch.float32, 3), (16, 32, False, torch.float32, 2)])  # rings grown for speculative steps
def test_compressor_mixes_the_windows_decodes_close(rate, dim, overlap, dtype, windows):
    """Decodes that close a window (window 0 too), that close none, and a padding row: the closers' entries as the
    softmax-gated mix of their rings' rows, zeros for the others; rings of `windows` whole windows."""
    from pressroom.kernels.triton.v4_attention import mix_closing_windows
    gen = torch.Generator().manual_seed(rate + dim)
    ring, width = windows * rate, (2 if overlap else 1) * dim
    kv_ring = torch.randn(5, ring, width, generator=gen).to(dtype)
    gate_ring = torch.randn(5, ring, width, generator=gen).to(dtype)
    bias = torch.randn(rate, width, generator=gen)
    slots = torch.tensor([3, 1, 4, 2, 0])
    positions = torch.tensor([rate - 1, 5 * rate - 1, 3 * rate + 1, 2 * rate - 1, 9])
    targets = torch.tensor([7, 2, -1, 11, -1])  # a closer (window 0), a closer, none, a closer, padding
    on = dict(device=DEVICE)
    got = mix_closing_windows(kv_ring.to(**on), gate_ring.to(**on), bias.to(**on), slots.to(**on),
                              positions.to(**on), targets.to(**on), dim, overlap).cpu()
    for t in range(len(slots)):
        want = torch.zeros(dim) if targets[t] < 0 else _mix_reference(kv_ring, gate_ring, bias, int(slots[t]),
                                                                      int(positions[t]), dim, overlap)
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)
