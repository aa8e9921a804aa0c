"""MLA's fused decode path on CUDA at real widths (DeepSeek-V2-Lite's attention: 16 heads, no q compression, hidden
2048; V3's and V3.2's per-rank shape at TP 8: 16 heads, q_lora_rank 1536, hidden 7168, V3.2's indexer of 64 heads x
128 and index_topk 2048): the kernels launched by one layer's batch-1 decode, counted by the profiler and printed
(pytest -s; before issue 44 and after: 9 -> 7, 11 -> 9, 37 -> 14); the CUDA path against the torch path on the
same weights and cache (fp32); and a decode replayed from a CUDA graph captured with the compile run's metadata, as
the graph runner does, against an eager step."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H100/H200 box)")]

from pressroom.attention.backend import forward_context  # noqa: E402
from pressroom.benchmarks.sparse import BLOCK_SIZE, decode_metadata  # noqa: E402
from pressroom.model.models.llama import RopeTables, rotary_from_config  # noqa: E402

ATTENTION = dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=16384, num_hidden_layers=1)
# kernels one layer's batch-1 decode launches over a 4,000-token context (split-KV, so a merge), cuBLAS's split-K
# reductions and memsets and torch.topk's own kernels (one call: radix select, sort) aside; before issue 44: 9, 11
# and 37. V3.2's 12: 7 GEMMs, the q norm, the prepare launch, the indexer's scores, sparse MLA and its merge (topk's
# indices go to the sparse kernel as they are: kernels/triton/dsa.py's rule; marking the unused ones with -1 took
# three elementwise launches, 15 on an H100 on 2026-12-07)
MOST_LAUNCHES = {"v2_lite": 7, "v3": 9, "v32": 12}
_LIBRARY_HELPERS = ("splitKreduce", "Memset", "topk", "TopK", "Sort", "sort", "radix", "Radix", "Blockwise")


def _config(form: str):
    import transformers
    if form == "v2_lite":
        return transformers.DeepseekV2Config(**ATTENTION, hidden_size=2048, q_lora_rank=None)
    if form == "v3":
        return transformers.DeepseekV3Config(**ATTENTION, hidden_size=7168, q_lora_rank=1536)
    return transformers.DeepseekV32Config(**ATTENTION, hidden_size=7168, q_lora_rank=1536, index_n_heads=64,
                                          index_head_dim=128, index_topk=2048)


def _layer(form: str, device: str, dtype: torch.dtype):
    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.attention.triton_backend import TritonAttentionBackend
    from pressroom.model.models.deepseek import MLAAttention, SparseMLAAttention
    cfg = _config(form)
    torch.manual_seed(0)
    layer = SparseMLAAttention(cfg) if form == "v32" else MLAAttention(cfg)
    for name, p in layer.named_parameters():
        if "norm" in name:  # RMSNorm and the indexer's LayerNorm: near-unit weights, small bias
            p.data.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
        else:
            p.data.normal_(0.0, 0.02)
    layer.to(device=device, dtype=dtype)
    layer.attn.backend = TritonAttentionBackend() if device == "cuda" else TorchAttentionBackend()
    return cfg, layer


class Decode:
    """`batch` decodes over `context` tokens each (a random cache), one layer's inputs for the step."""

    def __init__(self, form: str, batch: int, context: int, device: str, dtype: torch.dtype) -> None:
        from pressroom.attention.triton_backend import TritonMetadataBuilder
        self.cfg, self.layer = _layer(form, device, dtype)
        splits = 1
        if device == "cuda":
            builder = TritonMetadataBuilder(device, 1, -(-context // BLOCK_SIZE))
            splits = builder.num_kv_splits(batch)
        self.meta = decode_metadata(batch, context, torch.device(device), splits)
        blocks = batch * -(-context // BLOCK_SIZE)
        gen = torch.Generator().manual_seed(1)
        self.layer.attn.kv_cache = torch.randn(self.layer.attn.cache_shape(blocks, BLOCK_SIZE), generator=gen
                                               ).to(device=device, dtype=dtype)
        self.x = (torch.randn(batch, self.cfg.hidden_size, generator=gen) * 0.5).to(device=device, dtype=dtype)
        rotary = rotary_from_config(self.cfg, self.cfg.qk_rope_head_dim).to(device)
        self.rope = RopeTables(rotary, *rotary.cos_sin(torch.full((batch,), context - 1, device=device)))

    def step(self) -> torch.Tensor:
        with forward_context(self.meta):
            return self.layer(self.rope, self.x)


@pytest.mark.parametrize("form", ["v2_lite", "v3", "v32"])
def test_launches_per_decode_layer(form):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    decode = Decode(form, 1, 4000, "cuda", torch.bfloat16)
    with torch.inference_mode():
        decode.step()  # compiles; DSA's step plan is made here, as by a step's first layer
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode.step()
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    ours = [k for k in kernels if not any(helper in k for helper in _LIBRARY_HELPERS)]
    print(f"\n{form}: {len(ours)} launches per decode layer ({len(kernels)} with cuBLAS's split-K reductions and "
          "torch.topk's kernels)")
    print("\n".join(f"  {k[:110]}" for k in kernels))
    assert len(ours) <= MOST_LAUNCHES[form], kernels


@pytest.mark.parametrize("form, context", [("v2_lite", 300), ("v3", 300), ("v32", 2600), ("v32", 300)])
def test_the_cuda_path_equals_the_torch_path(form, context):
    """fp32, three decodes: the layer's output and the cache it writes (V3.2: the indexer really selects, 2048 of
    2600 tokens; over 300, CUDA's topk fills 1,748 of its 2,048 places with -inf scores, past the query's
    position: unused by dsa.py's rule)."""
    gpu, cpu = Decode(form, 3, context, "cuda", torch.float32), Decode(form, 3, context, "cpu", torch.float32)
    with torch.inference_mode():
        got, want = gpu.step(), cpu.step()
    torch.testing.assert_close(gpu.layer.attn.kv_cache.cpu(), cpu.layer.attn.kv_cache, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("form", ["v2_lite", "v32"])
def test_a_decode_replays_from_a_graph_captured_after_its_compile_run(form):
    """The graph runner's order: an eager forward (compiling) and the capture share one metadata. After the step's
    inputs move on in place (one more token: longer contexts, new slots, new positions, new x), the replay equals
    an eager step on the same inputs; DSA's token positions are remade inside the graph."""
    decode = Decode(form, 2, 3001, "cuda", torch.bfloat16)
    meta, layer = decode.meta, decode.layer
    with torch.inference_mode():
        decode.step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode.step()
        context = 3002
        meta.seq_lens.fill_(context)
        last = context - 1
        meta.slot_mapping.copy_(meta.block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE)
        cos, sin = decode.rope.rotary.cos_sin(torch.full((2,), last, device="cuda"))
        decode.rope.cos.copy_(cos)
        decode.rope.sin.copy_(sin)
        decode.x.copy_(torch.randn_like(decode.x) * 0.5)
        graph.replay()
        replayed = out.clone()
        meta.plan = None  # an eager step's own metadata starts without one
        eager = decode.step()
    assert layer.attn.kv_cache.isfinite().all()
    torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2)
