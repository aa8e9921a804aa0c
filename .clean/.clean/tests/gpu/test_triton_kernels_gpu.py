"""The Triton kernels against their torch references at real model shapes (Llama-3.1-8B, SmolLM2, Qwen3-30B-A3B
and Mixtral-8x7B experts) on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton kernels at real shapes")]

if torch.cuda.is_available():
    from pressroom.attention import torch_ref
    from pressroom.kernels.triton import activation, attention, cache, fused_moe, norm, rotary
    from pressroom.model.layers.rotary import RotaryEmbedding

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SENTINEL = 123.0
LLAMA_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128}
SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64}


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _serving_mix(seed: int = 0) -> list[tuple[int, int]]:
    """(context length, query tokens): 64 decodes with contexts up to 4k, two 512-token chunks behind 1k cached."""
    gen = torch.Generator().manual_seed(seed)
    decodes = [(int(n), 1) for n in torch.randint(1, 4097, (64,), generator=gen)]
    return decodes + [(1536, 512), (1536, 512)]


class Batch:
    """A paged batch on the GPU: blocks scattered through the cache, q a strided view of a fused qkv."""

    def __init__(self, specs, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16,
                 seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        needed = [-(-ctx // block_size) for ctx, _ in specs]
        num_blocks = sum(needed) + 8
        order = torch.randperm(num_blocks, device="cuda", generator=gen).int()
        self.block_tables = torch.zeros(len(specs), max(needed) + 1, dtype=torch.int32, device="cuda")
        used = 0
        for b, n in enumerate(needed):
            self.block_tables[b, :n] = order[used:used + n]
            used += n
        self.seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32, device="cuda")
        lens = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32)
        self.query_start_loc = lens.cumsum(0).int().cuda()
        self.max_query_len = int(lens.max())
        tokens = int(lens.sum())
        self.kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device="cuda", generator=gen,
                                    dtype=dtype)
        self.qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device="cuda", generator=gen, dtype=dtype)
        self.q = self.qkv[:, :heads]
        self.scale = head_dim ** -0.5

    def run(self, num_kv_splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.full_like(self.q, SENTINEL) if out is None else out
        return attention.paged_attention(self.q, self.kv_cache, self.block_tables, self.seq_lens,
                                         self.query_start_loc, self.max_query_len, self.scale, out, num_kv_splits)

    def reference(self) -> torch.Tensor:
        out = torch.full(self.q.shape, SENTINEL, dtype=torch.float32, device="cuda")
        return attention.paged_attention_reference(self.q, self.kv_cache, self.block_tables, self.seq_lens,
                                                   self.query_start_loc, self.scale, out)


def test_paged_attention_llama_8b_serving_mix():
    batch = Batch(_serving_mix(), **LLAMA_8B, dtype=torch.bfloat16)
    _close(batch.run(1), batch.reference(), TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [1, 8])
def test_paged_attention_llama_8b_decodes(splits):
    batch = Batch([(ctx, 1) for ctx, _ in _serving_mix(1)[:64]], **LLAMA_8B, dtype=torch.bfloat16)
    _close(batch.run(splits), batch.reference(), TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [1, 8])
def test_paged_attention_llama_8b_over_an_fp8_cache(splits):
    mix = _serving_mix(2)
    batch = Batch(mix if splits == 1 else mix[:64], **LLAMA_8B, dtype=torch.bfloat16)
    batch.kv_cache = batch.kv_cache.to(torch.float8_e4m3fn)
    _close(batch.run(splits), batch.reference(), TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_smollm2_shapes(dtype, splits):
    # token 3 is a padding decode (no context): its row must keep what `out` held
    specs = [(700, 1), (1, 1), (2049, 1), (0, 1)] + ([(300, 200), (129, 129), (0, 0)] if splits == 1 else [])
    batch = Batch(specs, **SMOLLM2, dtype=dtype)
    out = batch.run(splits)
    _close(out, batch.reference(), TOL[dtype])
    assert bool((out[3] == SENTINEL).all())


@pytest.mark.parametrize("captured, query_len, splits, lengths, starts", [
    # varlen: the query split over the same 43 tokens changes too
    ([(100, 1), (3000, 1), (40, 40), (17, 1)], 64, 1, [2500, 7, 4, 1000], [0, 1, 2, 3, 43]),
    # decodes with split-KV: the splits in use follow the new lengths
    ([(100, 1), (3000, 1), (40, 1), (17, 1)], 1, 4, [2500, 7, 300, 1000], [0, 1, 2, 3, 4]),
])
def test_paged_attention_replays_in_a_cuda_graph_for_other_lengths(captured, query_len, splits, lengths, starts):
    """The launch reads lengths only on the device: a graph captured for one batch serves another of its size."""
    batch = Batch(captured, **LLAMA_8B, dtype=torch.bfloat16, seed=1)
    batch.max_query_len = query_len  # the bound captured; later batches stay within it
    out = torch.zeros_like(batch.q)
    batch.run(splits, out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch.run(splits, out)
    # The same tensors with new values: other lengths, blocks and queries.
    batch.seq_lens.copy_(torch.tensor(lengths))
    batch.query_start_loc.copy_(torch.tensor(starts))
    batch.block_tables.random_(0, batch.kv_cache.shape[1])
    batch.qkv.normal_()
    graph.replay()
    _close(out, batch.reference(), TOL[torch.bfloat16])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_llama_8b(slot_dtype):
    kv_cache = torch.randn(2, 512, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(1088, 48, 128, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(512 * 16, device="cuda")[:1088].to(slot_dtype)
    slots[::7] = -1
    expected = kv_cache.clone()
    real = slots >= 0
    torch_ref.write_kv(expected, k[real], v[real], slots[real].long())
    cache.write_kv(kv_cache, k, v, slots)
    assert torch.equal(kv_cache, expected)


def test_write_kv_llama_8b_into_an_fp8_cache():
    """Rounded as torch rounds (nearest even) and saturated at 448, never NaN."""
    kv_cache = torch.zeros(2, 512, 16, 8, 128, device="cuda", dtype=torch.float8_e4m3fn)
    qkv = torch.randn(1088, 48, 128, device="cuda", dtype=torch.bfloat16) * 64  # some beyond 448
    k, v = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(512 * 16, device="cuda")[:1088]
    expected = torch.zeros(2, 512, 16, 8, 128, device="cuda")
    torch_ref.write_kv(expected, k.float().clamp(-448, 448), v.float().clamp(-448, 448), slots)
    cache.write_kv(kv_cache, k, v, slots)
    assert torch.equal(kv_cache.float(), expected.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_hidden_4096(dtype):
    x = torch.randn(1088, 4096, device="cuda", dtype=dtype)
    w = torch.rand(4096, device="cuda", dtype=dtype)
    _close(norm.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (4096,), w.float(), 1e-5).to(dtype), TOL[dtype])


def test_fused_add_rms_norm_hidden_4096():
    x = torch.randn(1088, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    summed = x + res
    expected = F.rms_norm(summed.float(), (4096,), w.float(), 1e-5).to(torch.bfloat16)
    norm.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, summed)
    _close(x, expected, TOL[torch.bfloat16])


def test_rotary_llama_8b_q_and_k_of_a_fused_qkv():
    rope = RotaryEmbedding(128, 128, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}).cuda()
    qkv = torch.randn(1088, 48, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope.cos_sin(torch.randint(0, 8192, (1088,), device="cuda"))
    expected = rope.rotate_reference(qkv[:, :40].float(), cos, sin)
    untouched = qkv[:, 40:].clone()
    rotary.rotary_(qkv[:, :40], cos, sin, 128)
    _close(qkv[:, :40], expected, TOL[torch.bfloat16])
    assert torch.equal(qkv[:, 40:], untouched)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_intermediate_14336(dtype):
    x = torch.randn(1088, 2 * 14336, device="cuda", dtype=dtype)
    gate, up = x.float().chunk(2, dim=-1)
    _close(activation.silu_and_mul(x), (F.silu(gate) * up).to(dtype), TOL[dtype])


def _moe_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Each expert over its tokens in fp32 from the same bf16 weights; the SiLU-and-mul product rounded to
    the model's dtype where the kernel stores it."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        rows, which = (ids == expert).nonzero(as_tuple=True)
        gate, up = (x[rows].float() @ w13[expert].float().T).chunk(2, dim=-1)
        mid = (F.silu(gate) * up).to(x.dtype).float()
        out.index_add_(0, rows, (mid @ w2[expert].float().T) * weights[rows, which, None])
    return out


# (experts, hidden, intermediate, top_k): Qwen3-30B-A3B and Mixtral-8x7B
@pytest.mark.parametrize("shape", [(128, 2048, 768, 8), (8, 4096, 14336, 2)])
@pytest.mark.parametrize("tokens", [1, 64, 1024])  # 1024 x 8 pairs: torch's sort aligns them
def test_fused_moe_at_real_shapes(shape, tokens):
    experts, hidden, inter, top_k = shape
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    top = torch.randn(tokens, experts, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    got = fused_moe.fused_moe(x, w13, w2, weights, top.indices, all_local=True)
    expected = _moe_reference(x, w13, w2, weights, top.indices)
    assert (got.float() - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("tokens", [1, 8, 512])
def test_the_two_alignments_agree_at_qwen3_moe_shape(tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, 128, device="cuda", generator=gen).topk(8, dim=-1).indices
    for block_m in (16, 64):
        slots, block_expert = fused_moe.align_in_one_program(ids, 128, block_m)
        expected_slots, expected_block_expert = fused_moe.align_with_torch(ids, 128, block_m)
        assert torch.equal(block_expert, expected_block_expert)
        assert torch.equal(fused_moe.canonical_layout(slots, block_expert, block_m),
                           fused_moe.canonical_layout(expected_slots, block_expert, block_m))


def test_qk_rms_norm_qwen3_moe_shape():
    """32 q heads and 4 k heads of 128 over the fused qkv's view, as Qwen3-30B-A3B's attention has them."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(64, 32 + 8, 128, device="cuda", generator=gen).bfloat16()
    q_w, k_w = (torch.rand(2, 128, device="cuda", generator=gen) + 0.5).unbind(0)
    qk = qkv[:, :36]
    expected = torch.cat((F.rms_norm(qk[:, :32].float(), (128,), q_w, 1e-6),
                          F.rms_norm(qk[:, 32:].float(), (128,), k_w, 1e-6)), dim=1)
    _close(norm.qk_rms_norm(qk, q_w, k_w, 32, 1e-6), expected, TOL[torch.bfloat16])
