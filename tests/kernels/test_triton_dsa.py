"""DSA's kernels equal their torch references (the CPU through Triton's interpreter; CUDA as they are): each
token's request and position, the lightning indexer's scores over a paged cache, the top-k selection, and
sparse MLA over the chosen positions, which equals dense MLA where every visible token is chosen."""
from __future__ import annotations

import pytest
import torch
from conftest import scattered_paged_layout

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import dsa, mla

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LATENT, ROPE, INDEX_DIM, INDEX_HEADS, HEADS, BLOCK = 32, 8, 16, 4, 4, 8
# (context after this step, query tokens): two decodes, a chunk behind a cached prefix, a fresh prompt
SPECS = [(50, 1), (9, 1), (40, 6), (21, 21)]


class Step:
    def __init__(self, specs=SPECS, seed: int = 0, pad_tokens: int = 2) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_tables, self.seq_lens, self.qsl, num_blocks = scattered_paged_layout(
            specs, BLOCK, gen, spare_blocks=2, spare_columns=2)
        tokens = int(self.qsl[-1]) + pad_tokens
        self.cache = torch.randn(num_blocks, BLOCK, 1, LATENT + ROPE + INDEX_DIM, generator=gen)
        self.index_q = torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen)
        self.index_w = torch.randn(tokens, INDEX_HEADS, generator=gen)
        self.query = torch.randn(tokens, HEADS, LATENT + ROPE, generator=gen)
        self.scale = (LATENT + ROPE) ** -0.5

    def to(self, device: str) -> Step:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def positions(self):
        return dsa.token_positions(self.qsl, self.seq_lens, self.query.shape[0])


def test_token_positions_name_each_tokens_request_and_place():
    req, pos = Step().positions()
    assert req.tolist() == [0, 1] + [2] * 6 + [3] * 21 + [0, 0]
    assert pos.tolist() == [49, 8] + list(range(34, 40)) + list(range(21)) + [-1, -1]


def test_indexer_logits_equal_the_reference():
    step = Step().to(DEVICE)
    req, pos = step.positions()
    actual = dsa.indexer_logits(step.index_q, step.index_w, step.cache, step.block_tables, req, pos, LATENT + ROPE)
    expected = dsa.indexer_logits_reference(step.index_q.cpu(), step.index_w.cpu(), step.cache.cpu(),
                                            step.block_tables.cpu(), req.cpu(), pos.cpu(), LATENT + ROPE)
    assert torch.equal(actual.cpu().isinf(), expected.isinf())  # exactly the invisible positions are -inf
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_the_head_weights_scale_is_folded_in_as_torch_would_apply_it():
    """Weights in the model's dtype and `weight_scale`: the scores of `weights.float() * weight_scale`, bit for bit
    (the model no longer launches the cast and the product)."""
    step = Step().to(DEVICE)
    req, pos = step.positions()
    args = (step.cache, step.block_tables, req, pos, LATENT + ROPE)
    weights = step.index_w.to(torch.bfloat16)
    folded = dsa.indexer_logits(step.index_q, weights, *args, weight_scale=INDEX_HEADS ** -0.5)
    assert torch.equal(folded, dsa.indexer_logits(step.index_q, weights.float() * INDEX_HEADS ** -0.5, *args))


def _marked(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The choice as select_top_k made it before the module's rule: -1 wherever topk took a -inf score."""
    values, chosen = logits.topk(min(top_k, logits.shape[1]), dim=-1)
    return torch.where(values > float("-inf"), chosen, -1)


def test_select_top_k_is_topk_best_first():
    logits = torch.tensor([[0.5, 2.0, 1.0, float("-inf")], [3.0, float("-inf"), float("-inf"), float("-inf")]])
    chosen = dsa.select_top_k(logits, 3)
    assert chosen[0].tolist() == [1, 2, 0]
    assert chosen[1, 0] == 0 and bool((chosen[1, 1:] > 0).all())  # past position 0: unused
    assert dsa.select_top_k(logits, 9).shape == (2, 4)


@pytest.mark.parametrize("top_k", [12, 64])
def test_the_choice_past_each_querys_position_is_only_what_it_cannot_see(top_k):
    """The module's rule on the indexer's real scores (contexts and prompt positions shorter than k, padding rows):
    the positions a query may read are exactly its best min(k, visible) ones, the old choice's (-1 marked) in
    its order; everything else chosen lies past its position."""
    step = Step(pad_tokens=3).to(DEVICE)
    req, pos = step.positions()
    logits = dsa.indexer_logits(step.index_q, step.index_w, step.cache, step.block_tables, req, pos, LATENT + ROPE)
    chosen, marked = dsa.select_top_k(logits, top_k).cpu(), _marked(logits, top_k).cpu()
    for t, last in enumerate(pos.tolist()):
        used = (chosen[t] >= 0) & (chosen[t] <= last)
        assert int(used.sum()) == min(top_k, last + 1)  # no visible position dropped (none at all on padding)
        assert chosen[t][used].tolist() == marked[t][marked[t] >= 0].tolist()
        assert bool((chosen[t][~used] > last).all())


@pytest.mark.parametrize("dtype, top_k, splits", [(torch.float32, 12, 1), (torch.bfloat16, 12, 1),
                                                  (torch.float32, 100, 1), (torch.float32, 100, 3),
                                                  (torch.bfloat16, 100, 2), (torch.float32, 12, 4)])
def test_sparse_mla_equals_the_reference(dtype, top_k, splits):
    """Split runs of the chosen positions merge to the same output (4 splits of 12: some runs empty)."""
    step = Step().to(DEVICE)
    req, pos = step.positions()
    logits = dsa.indexer_logits(step.index_q, step.index_w, step.cache, step.block_tables, req, pos, LATENT + ROPE)
    chosen = dsa.select_top_k(logits, top_k)
    query, cache = step.query.to(dtype), step.cache.to(dtype)
    out = torch.full((query.shape[0], HEADS, LATENT), 7.0, dtype=dtype, device=DEVICE)
    dsa.sparse_mla_attention(query, cache, step.block_tables, req, pos, chosen, step.scale, out, LATENT, splits)
    expected = dsa.sparse_mla_reference(query.cpu(), cache.cpu(), step.block_tables.cpu(), req.cpu(), pos.cpu(),
                                        chosen.cpu(), step.scale, LATENT)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def test_sparse_mla_choosing_every_visible_token_is_dense_mla():
    """With k at least the context, DSA equals dense MLA (the kernel and its reference both)."""
    step = Step(pad_tokens=0).to(DEVICE)
    req, pos = step.positions()
    logits = dsa.indexer_logits(step.index_q, step.index_w, step.cache, step.block_tables, req, pos, LATENT + ROPE)
    chosen = dsa.select_top_k(logits, 64)
    sparse = torch.empty(step.query.shape[0], HEADS, LATENT, device=DEVICE)
    dsa.sparse_mla_attention(step.query, step.cache, step.block_tables, req, pos, chosen, step.scale, sparse, LATENT)
    dense = torch.empty_like(sparse)
    mla.mla_attention(step.query, step.cache, step.block_tables, step.seq_lens, step.qsl, 21, step.scale, dense,
                      LATENT)
    torch.testing.assert_close(sparse.cpu(), dense.cpu(), atol=2e-5, rtol=2e-5)


def test_choose_positions_in_runs_equals_one_pass(monkeypatch):
    """Scores made a few queries at a time (a small SCORE_BYTES) choose what one pass chooses."""
    step = Step().to(DEVICE)
    req, pos = step.positions()
    args = (step.index_q, step.index_w, step.cache, step.block_tables, req, pos, LATENT + ROPE)
    whole = dsa.select_top_k(dsa.indexer_logits(*args), 12)
    width = step.block_tables.shape[1] * BLOCK
    monkeypatch.setattr(dsa, "SCORE_BYTES", 4 * width * 5)  # runs of 5 queries
    assert torch.equal(dsa.choose_positions(*args, 12), whole)


def test_a_lone_decode_splits_its_chosen_positions():
    """Splits until the device's target of programs (two per SM: 264 on an H200), capped; none past it."""
    from pressroom.attention.triton_backend import target_programs
    h200 = 2 * 132
    assert dsa.sparse_splits(1, 1, 2048, 32, h200) == 16  # one token would leave all but one SM idle
    assert dsa.sparse_splits(1, 8, 2048, 32, h200) == 16  # V3.2's 128 heads: 8 head blocks still want 33
    assert dsa.sparse_splits(1, 1, 2048, 32, 8) == 8  # a small device wants fewer
    assert dsa.sparse_splits(512, 1, 2048, 32, h200) == 1
    assert dsa.sparse_splits(1, 1, 40, 32, h200) == 1  # too few positions to cut
    assert target_programs("cpu") == h200  # the interpreter's stand-in device: an H100/H200's SM count


def test_padding_tokens_with_nothing_chosen_get_zeros_through_the_merge():
    step = Step(pad_tokens=3).to(DEVICE)
    req, pos = step.positions()
    chosen = dsa.select_top_k(dsa.indexer_logits(step.index_q, step.index_w, step.cache, step.block_tables, req,
                                                 pos, LATENT + ROPE), 12)
    out = torch.full((step.query.shape[0], HEADS, LATENT), 7.0, device=DEVICE)
    dsa.sparse_mla_attention(step.query, step.cache, step.block_tables, req, pos, chosen, step.scale, out, LATENT, 3)
    assert bool((out[-3:] == 0).all()) and not out.isnan().any()


@pytest.mark.parametrize("dtype, top_k, splits", [(torch.float32, 12, 1), (torch.bfloat16, 64, 3)])
def test_topk_as_it_is_attends_as_the_marked_choice_did(dtype, top_k, splits):
    """Contexts and prompt positions shorter than k, padding rows: the kernel over topk's indices as they are gives,
    bit for bit, what it gave over the old choice (-1 wherever the score was -inf), and the reference over that
    old choice (the outputs before the module's rule)."""
    step = Step(pad_tokens=3).to(DEVICE)
    req, pos = step.positions()
    logits = dsa.indexer_logits(step.index_q, step.index_w, step.cache, step.block_tables, req, pos, LATENT + ROPE)
    query, cache = step.query.to(dtype), step.cache.to(dtype)
    outs = []
    for chosen in (dsa.select_top_k(logits, top_k), _marked(logits, top_k)):
        outs.append(torch.full((query.shape[0], HEADS, LATENT), 7.0, dtype=dtype, device=DEVICE))
        dsa.sparse_mla_attention(query, cache, step.block_tables, req, pos, chosen, step.scale, outs[-1], LATENT,
                                 splits)
    assert torch.equal(outs[0], outs[1])
    everywhere = torch.full_like(pos, 1 << 30).cpu()  # the old rule: every chosen position >= 0 is read
    before = dsa.sparse_mla_reference(query.cpu(), cache.cpu(), step.block_tables.cpu(), req.cpu(), everywhere,
                                      _marked(logits, top_k).cpu(), step.scale, LATENT)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[0].float().cpu(), before, atol=tol, rtol=tol)
    assert bool((outs[0][-3:] == 0).all())  # padding rows attend to nothing
