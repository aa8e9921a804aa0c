"""The kernel that prepares MLA's absorbed query and cache entry equals the sequence it replaces (the latent's
RMSNorm, the rope parts' rotation, two concatenations): on the CPU through Triton's interpreter with tiny shapes,
on CUDA as it is, with DeepSeek-V2-Lite's real widths on CUDA only."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernels cannot be checked")

from pressroom.kernels import triton as triton_kernels
from pressroom.kernels.triton import norm, rotary
from pressroom.kernels.triton.mla_prepare import IndexerInputs, mla_prepare, mla_prepare_into_cache
from pressroom.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not triton_kernels.available(),
                                reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


class Inputs:
    """The kernel's inputs as the model hands them over: q and kv strided views of wider projections, q_latent
    a bmm's output, cos and sin the fp32 tables of rope positions."""

    def __init__(self, tokens: int, heads: int, nope: int, rank: int, rope: int, dtype: torch.dtype,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(tokens, heads + 1, nope + rope + 3, generator=gen).to(dtype)[:, :heads, :nope + rope]
        self.q_latent = torch.randn(heads, tokens, rank, generator=gen).to(dtype)
        self.kv = torch.randn(tokens, rank + rope + 5, generator=gen).to(dtype)[:, :rank + rope]
        self.weight = (1 + 0.5 * torch.randn(rank, generator=gen)).to(dtype)
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        self.cos, self.sin = RotaryEmbedding(rope, rope, 4096, 10000.0).cos_sin(positions)
        self.rank, self.rope = rank, rope

    def to(self, device: str) -> Inputs:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_prepare(self.q, self.q_latent, self.kv, self.weight, EPS, self.cos, self.sin)

    def replaced_sequence(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What MLAAttention ran on CUDA before the kernel: Triton's RMSNorm and rotary passes, torch's cats."""
        latent, k_pe = self.kv.split([self.rank, self.rope], dim=-1)
        latent = norm.rms_norm(latent.contiguous(), self.weight, EPS)
        heads = self.q.shape[1]
        pe = torch.cat((self.q[..., -self.rope:], k_pe.unsqueeze(1)), dim=1).contiguous()
        pe = rotary.rotary_(pe, self.cos, self.sin, self.rope)
        return (torch.cat((self.q_latent.transpose(0, 1), pe[:, :heads]), dim=-1),
                torch.cat((latent, pe[:, heads]), dim=-1))

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain torch: fp32 math, one rounding to the inputs' dtype."""
        x = self.kv[:, :self.rank].float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight.float()
        query = torch.cat((self.q_latent.transpose(0, 1).float(), _rotated(self.q[..., -self.rope:], self)), dim=-1)
        entry = torch.cat((normed, _rotated(self.kv[:, self.rank:].unsqueeze(1), self)[:, 0]), dim=-1)
        return query.to(self.q.dtype), entry.to(self.kv.dtype)


def _rotated(x: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    half = inputs.rope // 2
    cos, sin = inputs.cos.float().unsqueeze(1), inputs.sin.float().unsqueeze(1)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _assert_close(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], tol: float) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape and a.is_contiguous()
        torch.testing.assert_close(a.float().cpu(), e.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens, heads", [(1, 2), (3, 4), (5, 3)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_equals_the_torch_reference(tokens, heads, dtype, tol):
    inputs = Inputs(tokens, heads, 8, 32, 16, dtype).to(DEVICE)
    _assert_close(inputs.run(), inputs.reference(), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_sequence_it_replaces(dtype):
    """Bit for bit under the interpreter (same fp32 operations, one rounding each); within a rounding on CUDA,
    where the compiler may order the norm's sum differently."""
    inputs = Inputs(4, 3, 8, 32, 16, dtype, seed=1).to(DEVICE)
    _assert_close(inputs.run(), inputs.replaced_sequence(), 0.0 if DEVICE == "cpu" else 1e-2)


def test_a_rank_not_a_power_of_two_and_no_tokens():
    inputs = Inputs(2, 4, 8, 24, 16, torch.float32, seed=2).to(DEVICE)
    _assert_close(inputs.run(), inputs.reference(), 1e-6)
    empty = Inputs(0, 4, 8, 32, 16, torch.float32).to(DEVICE)
    query, entry = empty.run()
    assert query.shape == (0, 4, 48) and entry.shape == (0, 48)


def test_refuses_tables_narrower_than_the_rope_part():
    inputs = Inputs(2, 2, 8, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="kv"):
        mla_prepare(inputs.q, inputs.q_latent, inputs.kv, inputs.weight, EPS, inputs.cos[:, :4], inputs.sin[:, :4])


class Indexed(Inputs):
    """DSA's inputs: also the indexer key as wk made it (a strided view) and its LayerNorm's weight and bias."""

    def __init__(self, tokens: int, heads: int, dtype: torch.dtype, dim: int = 24, seed: int = 4) -> None:
        super().__init__(tokens, heads, 8, 32, 16, dtype, seed)
        gen = torch.Generator().manual_seed(seed + 100)
        self.key = (3 * torch.randn(tokens, dim + 7, generator=gen) + 1).to(dtype)[:, 2:dim + 2]
        self.key_weight = (1 + 0.5 * torch.randn(dim, generator=gen)).to(dtype)
        self.key_bias = (0.3 * torch.randn(dim, generator=gen)).to(dtype)

    def index_key(self) -> IndexerInputs:
        return IndexerInputs(self.key, self.key_weight, self.key_bias, EPS)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_prepare(self.q, self.q_latent, self.kv, self.weight, EPS, self.cos, self.sin, self.index_key())

    def replaced_sequence(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What SparseMLAAttention ran before: the entry as above, then nn.LayerNorm, rotary_ and a cat."""
        query, entry = super().replaced_sequence()
        normed = torch.nn.functional.layer_norm(self.key, (self.key.shape[-1],), self.key_weight, self.key_bias, EPS)
        key = rotary.rotary_(normed.unsqueeze(1).contiguous(), self.cos, self.sin, self.rope)[:, 0]
        return query, torch.cat((entry, key), dim=-1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_indexer_key_joins_the_entry(dtype, tol):
    """DSA's entry: the latent's and shared key's parts as before, then the indexer key normed and rotated."""
    inputs = Indexed(3, 4, dtype).to(DEVICE)
    query, entry = inputs.run()
    want_query, want_entry = inputs.replaced_sequence()
    assert entry.shape == (3, 32 + 16 + 24)
    _assert_close((query, entry), (want_query, want_entry), tol)
    _assert_close(Inputs.run(inputs), (query, entry[:, :48].contiguous()), 0.0)  # the rest as without the key


@pytest.mark.parametrize("index_heads", [3, 20])
def test_the_indexer_queries_are_rotated_in_place_as_rotary_would(index_heads):
    """Programs after the entry's rotate the indexer's queries in place: rotary.py's pass, bit for bit under the
    interpreter (two blocks of heads at 20); the query and entry are unchanged by them."""
    inputs = Indexed(3, 4, torch.bfloat16).to(DEVICE)
    gen = torch.Generator().manual_seed(9)
    queries = torch.randn(3, index_heads, 24, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    want = rotary.rotary_(queries.clone(), inputs.cos, inputs.sin, inputs.rope)
    key = inputs.index_key()
    query, entry = mla_prepare(inputs.q, inputs.q_latent, inputs.kv, inputs.weight, EPS, inputs.cos, inputs.sin,
                               IndexerInputs(key.key, key.weight, key.bias, key.eps, queries=queries))
    torch.testing.assert_close(queries.cpu(), want.cpu(), atol=0.0 if DEVICE == "cpu" else 1e-2, rtol=0)
    _assert_close((query, entry), inputs.run(), 0.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_entries_go_into_their_cache_slots(cache_dtype):
    """mla_prepare_into_cache writes each entry where write_kv would (FP8: saturated, as write_kv does); a
    negative slot (a padding row) is written nowhere; the query is mla_prepare's."""
    from pressroom.kernels.triton.cache import write_kv
    inputs = Indexed(4, 3, torch.float32, seed=6).to(DEVICE)
    inputs.kv[1, 0] = 1e6  # past FP8's largest value: saturates rather than becoming NaN
    slots = torch.tensor([9, 2, -1, 14], device=DEVICE)
    width = 32 + 16 + 24
    cache = torch.full((4, 4, 1, width), 5.0, device=DEVICE).to(cache_dtype)
    query = mla_prepare_into_cache(inputs.q, inputs.q_latent, inputs.kv, inputs.weight, EPS, inputs.cos,
                                   inputs.sin, inputs.index_key(), cache, slots)
    want_query, entry = inputs.run()
    want = torch.full((1, 4, 4, 1, width), 5.0, device=DEVICE).to(cache_dtype)
    write_kv(want, entry.unsqueeze(1), None, slots)
    assert torch.equal(query, want_query)
    assert torch.equal(cache.float(), want[0].float())
    assert (cache.view(-1, width)[[0, 1, 3]].float() == 5.0).all()  # untouched slots, the padding row's included


def test_refuses_a_cache_of_another_width():
    inputs = Indexed(2, 2, torch.float32)
    with pytest.raises(ValueError, match=r"\[blocks, block_size, 1, 72\]"):
        mla_prepare_into_cache(inputs.q, inputs.q_latent, inputs.kv, inputs.weight, EPS, inputs.cos, inputs.sin,
                               inputs.index_key(), torch.zeros(2, 4, 1, 48), torch.tensor([0, 1]))


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_layers_one_kernel_path_equals_its_reference_path(arch):
    """MLAAttention's CUDA branch (run here through the interpreter) against its CPU path, with and without
    q_lora_rank: the kernel gets the layer's own tensors (strided views of the fused input projection's output)."""
    from conftest import tiny_config

    from pressroom.model.models.deepseek import MLAAttention
    from pressroom.model.models.llama import RopeTables, rotary_from_config
    cfg = tiny_config(arch)
    torch.manual_seed(0)
    attn = MLAAttention(cfg)
    for p in attn.parameters():
        p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)  # norm weights near 1, projections small
    rotary_emb = rotary_from_config(cfg, cfg.qk_rope_head_dim)
    rope = RopeTables(rotary_emb, *rotary_emb.cos_sin(torch.tensor([0, 7, 300])))
    x = torch.randn(3, cfg.hidden_size)
    expected = attn.absorbed_query_and_key(rope, *attn.inputs(x)[1:3])
    attn, x = attn.to(DEVICE), x.to(DEVICE)
    rope = RopeTables(rotary_emb.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    _, q, kv, _ = attn.inputs(x)
    assert kv.stride(0) == attn.fused_qkv_a_proj.out_features  # a view of the one GEMM's output, not a copy
    _assert_close(attn.absorbed_query_and_key_in_one_kernel(rope, q, kv), expected, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real widths need CUDA (the interpreter takes long)")
@pytest.mark.parametrize("tokens", [1, 7, 512])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_at_deepseek_v2_lite_widths(tokens, dtype, tol):
    """16 heads, kv_lora_rank 512, rope 64, nope 128: against the reference and the sequence it replaces."""
    inputs = Inputs(tokens, 16, 128, 512, 64, dtype, seed=3).to(DEVICE)
    out = inputs.run()
    _assert_close(out, inputs.reference(), tol)
    _assert_close(out, inputs.replaced_sequence(), tol)
