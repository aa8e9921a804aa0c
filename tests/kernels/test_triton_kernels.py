"""Each Triton kernel equals its torch reference, run on the CPU by Triton's interpreter with tiny shapes.

tests/conftest.py sets TRITON_INTERPRET=1 where CUDA is absent, before these modules define their kernels.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import scattered_paged_layout

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.attention import torch_ref
from pressroom.attention.backend import AttentionMetadata
from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import activation, attention, cache, norm, rotary
from pressroom.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SENTINEL = 123.0

# (context length after this step, query tokens) per request: decodes with contexts of one to three 64-token
# tiles, a padding decode (no context), a prefill chunk behind a 62-token cached prefix (its first query sees
# part of the first tile: the masked / unmasked boundary), a fresh prompt long enough for
# several query blocks, and a padding request with nothing at all.
MIXED = [(37, 1), (150, 1), (1, 1), (0, 1), (74, 12), (34, 34), (0, 0)]
DECODES = [(150, 1), (5, 1), (64, 1), (65, 1), (0, 1), (200, 1), (400, 1)]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


class Batch:
    """A paged batch: requests' blocks scattered through a random cache, q a strided view of a fused qkv."""

    def __init__(self, specs, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 pad_tokens: int = 2, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_tables, self.seq_lens, self.query_start_loc, num_blocks = scattered_paged_layout(
            specs, block_size, gen)
        self.max_query_len = max(q for _, q in specs)
        tokens = int(self.query_start_loc[-1]) + pad_tokens
        self.kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        self.qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
        self.q = self.qkv[:, :heads]
        self.scale = head_dim ** -0.5

    def to(self, device: str) -> Batch:
        for name in ("block_tables", "seq_lens", "query_start_loc", "kv_cache", "qkv"):
            setattr(self, name, getattr(self, name).to(device))
        self.q = self.qkv[:, :self.q.shape[1]]
        return self

    def run(self, num_kv_splits: int) -> torch.Tensor:
        out = torch.full(self.q.shape, SENTINEL, dtype=self.q.dtype, device=self.q.device)
        return attention.paged_attention(self.q, self.kv_cache, self.block_tables, self.seq_lens,
                                         self.query_start_loc, self.max_query_len, self.scale, out, num_kv_splits)

    def reference(self) -> torch.Tensor:
        out = torch.full(self.q.shape, SENTINEL, dtype=torch.float32, device=self.q.device)
        return attention.paged_attention_reference(self.q, self.kv_cache, self.block_tables, self.seq_lens,
                                                   self.query_start_loc, self.scale, out)

    def padding_rows(self) -> torch.Tensor:
        """Rows no real query owns: they must keep what was in `out`."""
        owned = torch.zeros(self.q.shape[0], dtype=torch.bool)
        loc = self.query_start_loc.tolist()
        for b, ctx in enumerate(self.seq_lens.tolist()):
            owned[loc[b]:loc[b + 1]] = ctx > 0
        return ~owned


def _check_attention(batch: Batch, num_kv_splits: int, tol: float) -> None:
    out = batch.run(num_kv_splits)
    _close(out, batch.reference(), tol)
    assert bool((out[batch.padding_rows()] == SENTINEL).all())


@pytest.mark.parametrize("dtype, block_size, heads, kv_heads, head_dim", [
    (torch.float32, 16, 4, 2, 32),
    (torch.float32, 4, 6, 2, 16),  # 3 query heads per kv head: padded to 4 rows
    (torch.bfloat16, 16, 6, 2, 32),
    (torch.bfloat16, 4, 4, 2, 16),
    (torch.float16, 16, 4, 2, 32),
    (torch.float32, 16, 4, 2, 24),  # head_dim not a power of two
])
def test_paged_attention_mixed_batch(dtype, block_size, heads, kv_heads, head_dim):
    batch = Batch(MIXED, heads, kv_heads, head_dim, block_size, dtype).to(DEVICE)
    _check_attention(batch, 1, TOL[dtype])


@pytest.mark.parametrize("dtype, heads, head_dim", [(torch.float32, 4, 32), (torch.bfloat16, 4, 32),
                                                    (torch.float32, 6, 24)])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_paged_attention_decodes_only(dtype, heads, head_dim, splits):
    # Contexts of 5 to 400 tokens: a split reads at least two 64-token tiles, so 16 splits leave most of them
    # unused, and 3 are all used only by the longest; the padding decode (no context) keeps its row.
    batch = Batch(DECODES, heads, 2, head_dim, 16, dtype, pad_tokens=0).to(DEVICE)
    _check_attention(batch, splits, TOL[dtype])


def test_split_kv_refuses_a_batch_with_longer_queries():
    batch = Batch(MIXED, 4, 2, 32, 16, torch.float32).to(DEVICE)
    with pytest.raises(ValueError, match="split-KV serves decode-only batches"):
        batch.run(2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("specs, splits", [(MIXED, 1), (DECODES, 3)])
def test_paged_attention_reads_an_fp8_cache(cache_dtype, specs, splits):
    """bf16 queries over an FP8 cache (scale 1): the kernel widens what it reads exactly as the reference does."""
    batch = Batch(specs, 4, 2, 32, 16, torch.bfloat16, pad_tokens=0 if splits > 1 else 2)
    batch.kv_cache = batch.kv_cache.to(cache_dtype)
    _check_attention(batch.to(DEVICE), splits, TOL[torch.bfloat16])


def test_reference_matches_the_torch_backend():
    """Anchors the kernels' reference to the CPU backend's semantics (decodes first, as the runner orders them)."""
    specs = [(9, 1), (20, 1), (30, 6), (5, 5)]
    batch = Batch(specs, 4, 2, 16, 4, torch.float32, pad_tokens=0)
    tokens = batch.q.shape[0]
    k, v = batch.qkv[:, 4:6], batch.qkv[:, 6:]
    slots = torch.cat([_slots(batch, b, ctx - q, ctx) for b, (ctx, q) in enumerate(specs)])
    meta = AttentionMetadata(num_decodes=2, num_decode_tokens=2, slot_mapping=slots, block_tables=batch.block_tables,
                             seq_lens=batch.seq_lens.long(), query_start_loc=batch.query_start_loc.tolist(),
                             seq_lens_host=batch.seq_lens.tolist())
    expected = torch_ref.TorchAttentionBackend().forward(batch.q, k, v, batch.kv_cache, meta, batch.scale)
    assert tokens == expected.shape[0]
    _close(batch.reference(), expected, 1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_backend_mixed_step_equals_the_reference(splits):
    """The backend's mixed step (decodes first, then prompt chunks, launched separately) writes the new
    keys and values and attends as the reference does over the whole batch."""
    from pressroom.attention.triton_backend import TritonAttentionBackend
    specs = [(37, 1), (150, 1), (400, 1), (74, 12), (34, 34)]
    batch = Batch(specs, 4, 2, 32, 16, torch.float32, pad_tokens=0)
    k, v = batch.qkv[:, 4:6], batch.qkv[:, 6:]
    slots = torch.cat([_slots(batch, b, ctx - q, ctx) for b, (ctx, q) in enumerate(specs)])
    expected_cache = batch.kv_cache.clone()
    torch_ref.write_kv(expected_cache, k, v, slots)
    batch.to(DEVICE)
    meta = AttentionMetadata(num_decodes=3, num_decode_tokens=3, slot_mapping=slots.to(DEVICE),
                             block_tables=batch.block_tables, seq_lens=batch.seq_lens, query_start_loc=[],
                             seq_lens_host=[], query_start_loc_device=batch.query_start_loc,
                             max_query_len=batch.max_query_len, num_kv_splits=splits)
    out = TritonAttentionBackend().forward(batch.q, batch.qkv[:, 4:6], batch.qkv[:, 6:], batch.kv_cache, meta,
                                           batch.scale)
    assert torch.equal(batch.kv_cache.cpu(), expected_cache)
    _close(out, batch.reference(), TOL[torch.float32])


def _slots(batch: Batch, b: int, start: int, end: int) -> torch.Tensor:
    block_size = batch.kv_cache.shape[2]
    pos = torch.arange(start, end)
    return batch.block_tables[b, pos // block_size].long() * block_size + pos % block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_index_copy(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(2, 6, 4, 2, 16, generator=gen).to(dtype)
    qkv = torch.randn(7, 8, 16, generator=gen).to(dtype)  # 4 q heads, then 2 k and 2 v heads
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.tensor([5, 0, -1, 23, 12, -1, 7], dtype=slot_dtype)
    expected = kv_cache.clone()
    real = slots >= 0
    torch_ref.write_kv(expected, k[real], v[real], slots[real].long())
    actual = kv_cache.to(DEVICE)
    cache.write_kv(actual, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_into_an_fp8_cache_rounds_and_saturates(cache_dtype):
    gen = torch.Generator().manual_seed(5)
    kv_cache = torch.zeros(2, 6, 4, 2, 16, dtype=cache_dtype)
    qkv = (torch.randn(5, 6, 16, generator=gen) * 4).to(torch.bfloat16)  # 2 q heads, then 2 k and 2 v heads
    qkv[0, 2, :4] = torch.tensor([1e5, -1e5, 60000.0, -0.0])  # beyond both formats' range: saturate, never NaN
    k, v = qkv[:, 2:4], qkv[:, 4:]
    slots = torch.tensor([3, -1, 17, 8, 22])
    limit = torch.finfo(cache_dtype).max
    expected = torch.zeros(2, 6, 4, 2, 16)
    real = slots >= 0
    torch_ref.write_kv(expected, k[real].float().clamp(-limit, limit), v[real].float().clamp(-limit, limit),
                       slots[real])
    actual = kv_cache.to(DEVICE)
    cache.write_kv(actual, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    written = actual.float().cpu()
    assert not written.isnan().any()
    assert written[0, 0, 3, 0, :2].tolist() == [limit, -limit]
    rounded = expected.to(cache_dtype).float()
    if torch.cuda.is_available():
        assert torch.equal(written, rounded)
    else:  # Triton 3.6's interpreter drops the carry when rounding up to a power of two (1.95 -> 1.0, not 2.0)
        # and rounds ties away from zero: here every value lands in its slot, with its sign, within a binade.
        ratio = written[rounded != 0] / rounded[rounded != 0]
        assert bool(((ratio >= 0.5) & (ratio <= 2.0)).all()) and bool((written[rounded == 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    w = torch.rand(hidden, generator=gen).to(dtype)
    expected = F.rms_norm(x.float(), (hidden,), w.float(), 1e-6).to(dtype)
    _close(norm.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6), expected, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(5, 96, generator=gen).to(dtype), torch.randn(5, 96, generator=gen).to(dtype)
    w = torch.rand(96, generator=gen).to(dtype)
    summed = x + res
    expected = F.rms_norm(summed.float(), (96,), w.float(), 1e-6).to(dtype)
    x_dev, res_dev = x.to(DEVICE), res.to(DEVICE)
    out, new_res = norm.fused_add_rms_norm(x_dev, res_dev, w.to(DEVICE), 1e-6)
    assert out is x_dev and new_res is res_dev
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(res_dev.cpu(), summed)
    else:  # the interpreter casts fp32 to bf16 by truncation, not round-to-nearest-even: 1 ulp off at most
        _close(res_dev, summed, 2 ** -7)
    _close(x_dev, expected, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_in_place_on_a_strided_view(dtype, rotary_dim):
    rope = RotaryEmbedding(32, rotary_dim, 64, 10000.0)
    gen = torch.Generator().manual_seed(2)
    stacked = torch.randn(6, 5, 32, generator=gen).to(dtype)  # 3 q/k heads + 2 untouched "v" heads
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 9, 10, 40, 63]))
    expected = rope.rotate_reference(stacked[:, :3].clone(), cos, sin)
    actual = stacked.to(DEVICE)
    rotary.rotary_(actual[:, :3], cos.to(DEVICE), sin.to(DEVICE), rotary_dim)
    _close(actual[:, :3], expected, TOL[dtype])
    assert torch.equal(actual[:, 3:].cpu(), stacked[:, 3:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 1500])
def test_silu_and_mul(dtype, width):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2 * width, generator=gen).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).to(dtype)
    _close(activation.silu_and_mul(x.to(DEVICE)), expected, TOL[dtype])


def test_available_is_false_without_triton(monkeypatch):
    assert triton_kernels.available()
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert not triton_kernels.available()


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (37, 6, 2), (20, 8, 3)])
def test_fused_moe_equals_the_per_expert_loop(tokens, experts, top_k):
    """Triton's grouped GEMMs (gate/up with SiLU-and-mul, then down weighted by top-k) against FusedMoE's
    torch path on the same weights; ranks owning part of the experts sum to the whole."""
    from pressroom.kernels.triton.fused_moe import fused_moe
    from pressroom.model.layers.fused_moe import FusedMoE, RouterConfig, select_experts
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter = 32, 48
    layer = FusedMoE(experts, hidden, inter)
    layer.w13.data = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    layer.w2.data = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), RouterConfig(top_k=top_k))
    expected = layer(x, weights, ids)
    to = dict(device=DEVICE)
    got = fused_moe(x.to(**to), layer.w13.data.to(**to), layer.w2.data.to(**to), weights.to(**to), ids.to(**to))
    assert torch.allclose(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    half = experts // 2  # two ranks: local ids, -1 for the other rank's experts
    parts = []
    for lo, hi in ((0, half), (half, experts)):
        local = torch.where((ids >= lo) & (ids < hi), ids - lo, -1)
        parts.append(fused_moe(x.to(**to), layer.w13.data[lo:hi].to(**to), layer.w2.data[lo:hi].to(**to),
                               weights.to(**to), local.to(**to)).cpu())
    assert torch.allclose(parts[0] + parts[1], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(1, 128, 8, 16), (37, 6, 2, 16), (100, 5, 3, 32),
                                                             (70, 130, 4, 16), (1, 1, 1, 16), (300, 16, 8, 64)])
def test_the_two_alignments_agree(tokens, experts, top_k, block_m):
    """One Triton program (small steps) and torch's sort (large ones) give each expert the same run of
    slots (in any order inside it), another rank's pairs (-1) none, and mark the same blocks unused."""
    from pressroom.kernels.triton.fused_moe import align_in_one_program, align_with_torch, canonical_layout
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.2, -1, ids).to(DEVICE)
    slots, block_expert = align_with_torch(ids, experts, block_m)
    got_slots, got_block_expert = align_in_one_program(ids, experts, block_m)
    assert torch.equal(got_block_expert, block_expert)
    assert torch.equal(canonical_layout(got_slots, block_expert, block_m),
                       canonical_layout(slots, block_expert, block_m))
    flat = ids.reshape(-1).cpu()
    placed = slots[slots < ids.numel()].cpu()
    assert sorted(placed.tolist()) == [i for i in range(ids.numel()) if flat[i] >= 0]
    for block, expert in enumerate(block_expert.cpu().tolist()):
        rows = slots[block * block_m:(block + 1) * block_m].cpu()
        rows = rows[rows < ids.numel()]
        assert expert >= 0 or len(rows) == 0
        assert all(flat[r] == expert for r in rows.tolist())


def test_every_routing_edge_case_through_the_kernels():
    """All tokens to one expert, experts that receive nothing, top-k equal to the number of experts and a
    single token; launches with K tiles that divide the width (no masks) and that do not."""
    from pressroom.kernels.triton.fused_moe import MoeLaunch, fused_moe
    from pressroom.model.layers.fused_moe import FusedMoE
    gen = torch.Generator().manual_seed(7)
    experts, hidden, inter = 4, 32, 48
    layer = FusedMoE(experts, hidden, inter)
    layer.w13.data = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    layer.w2.data = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    cases = {"one expert": torch.full((9, 1), 2), "all experts": torch.arange(4).repeat(5, 1),
             "one token": torch.tensor([[3, 0]])}
    for name, ids in cases.items():
        x = torch.randn(ids.shape[0], hidden, generator=gen)
        weights = torch.rand(ids.shape, generator=gen)
        expected = layer(x, weights, ids)
        for launch in (MoeLaunch(16, 32, 16, 4, 2), MoeLaunch(32, 64, 64, 4, 2)):
            got = fused_moe(x.to(DEVICE), layer.w13.data.to(DEVICE), layer.w2.data.to(DEVICE),
                            weights.to(DEVICE), ids.to(DEVICE), launch)
            assert torch.allclose(got.cpu(), expected, atol=1e-4, rtol=1e-4), (name, launch)


def test_a_committed_sweep_picks_the_launch_for_the_nearest_token_count(tmp_path, monkeypatch):
    import json
    from dataclasses import asdict

    from pressroom.kernels.triton import fused_moe as moe
    monkeypatch.setattr(moe, "SWEEP_DIR", tmp_path)
    path = moe.sweep_path(128, 768, 2048, 8, torch.bfloat16, "NVIDIA H200")
    assert path.name == "E128_N768_H2048_K8_bfloat16_NVIDIA_H200.json"
    small, large = moe.MoeLaunch(16, 32, 128, 4, 4), moe.MoeLaunch(64, 128, 64, 8, 3)
    path.write_text(json.dumps({"best": {"1": asdict(small), "256": asdict(large)}}))
    table = moe.load_sweep(path)
    assert table == {1: small, 256: large}
    assert [moe.nearest_launch(table, n) for n in (1, 100, 128, 129, 4096)] == [small, small, small, large, large]
    assert moe.load_sweep(tmp_path / "absent.json") == {}


@pytest.mark.parametrize("experts, top_k, scoring, renormalize, bias, scaling", [
    (8, 2, "softmax", True, False, 1.0), (60, 4, "softmax", False, False, 1.0), (6, 6, "softmax", True, False, 1.0),
    (16, 8, "sigmoid", True, True, 2.5), (12, 1, "sigmoid", False, False, 1.0)])
def test_one_launch_router_equals_select_experts(experts, top_k, scoring, renormalize, bias, scaling):
    """The CUDA router kernel against the torch router: the same experts per token (top-k equal to the
    number of experts included) and the same weights."""
    from pressroom.kernels.triton.fused_moe import route_topk
    from pressroom.model.layers.fused_moe import RouterConfig, select_experts_torch
    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(5, experts, generator=gen)
    correction = torch.rand(experts, generator=gen) if bias else None
    cfg = RouterConfig(top_k=top_k, scoring=scoring, renormalize=renormalize, routed_scaling_factor=scaling)
    expected_w, expected_ids = select_experts_torch(logits, cfg, correction)
    weights, ids = route_topk(logits.to(DEVICE), top_k, scoring == "sigmoid", renormalize, scaling,
                              None if correction is None else correction.to(DEVICE))
    ids, order = ids.cpu().sort(dim=-1)
    expected_ids, expected_order = expected_ids.sort(dim=-1)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(weights.cpu().gather(1, order), expected_w.gather(1, expected_order), atol=1e-6)


def test_the_committed_sweeps_name_their_shapes_and_load():
    import json

    import torch as t

    from pressroom.kernels.triton import fused_moe as moe
    files = sorted(f for f in moe.SWEEP_DIR.glob("*.json") if "_fp8_" not in f.name)  # fused_moe_fp8's own
    assert {f.name.split("_bfloat16")[0] for f in files} >= {"E128_N768_H2048_K8", "E8_N14336_H4096_K2"}
    for f in files:
        report = json.loads(f.read_text())
        s = report["shape"]
        assert moe.sweep_path(s["experts"], s["inter"], s["hidden"], s["top_k"], getattr(t, report["dtype"]),
                              report["gpu"], s.get("shared", 0)) == f
        table = moe.load_sweep(f)
        assert 1 in table and all(launch.gemv or launch.block_m in (16, 32, 64, 128) for launch in table.values())
        assert all(report["best_us"][n] <= report["default_us"][n] for n in report["best"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads, k_heads, head_dim", [(4, 2, 32), (9, 3, 48)])
def test_qk_rms_norm_equals_two_rms_norms(dtype, q_heads, k_heads, head_dim):
    """Qwen3's q and k norms in one launch over a strided view of the fused qkv, against F.rms_norm."""
    gen = torch.Generator().manual_seed(q_heads)
    qkv = torch.randn(5, q_heads + 2 * k_heads, head_dim, generator=gen).to(dtype)
    q_w, k_w = torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) + 0.5
    qk = qkv[:, :q_heads + k_heads]
    expected = torch.cat((F.rms_norm(qk[:, :q_heads].float(), (head_dim,), q_w, 1e-6),
                          F.rms_norm(qk[:, q_heads:].float(), (head_dim,), k_w, 1e-6)), dim=1)
    got = norm.qk_rms_norm(qk.to(DEVICE), q_w.to(DEVICE), k_w.to(DEVICE), q_heads, 1e-6)
    assert got.is_contiguous() and got.shape == qk.shape
    _close(got.cpu(), expected.to(dtype), TOL[dtype])


def test_the_router_picks_distinct_experts_from_nan_scores():
    """Garbage activations (NaN, inf: dummy weights can make them) still route each token to top_k
    distinct, real experts, and an id past the experts is dropped by the alignment, never written."""
    from pressroom.kernels.triton.fused_moe import align_in_one_program, align_with_torch, route_topk
    logits = torch.tensor([[float("nan")] * 8, [float("-inf")] * 8, [1.0, float("inf"), 0, 0, 0, 0, 0, 0]])
    for sigmoid in (False, True):
        _, ids = route_topk(logits.to(DEVICE), 3, sigmoid, True, 1.0)
        ids = ids.cpu()
        assert ((ids >= 0) & (ids < 8)).all() and all(len(set(row.tolist())) == 3 for row in ids)
    ids = torch.tensor([[0, 9], [1, 2]])  # 9: not an expert of this layer
    for align in (align_in_one_program, align_with_torch):
        slots, block_expert = align(ids.to(DEVICE), 4, 16)
        used = slots.view(-1, 16)[block_expert >= 0].cpu()  # unused blocks are never read
        assert sorted(used[used < 4].tolist()) == [0, 2, 3]
