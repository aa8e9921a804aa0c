"""MLA's fused decode path on the CPU: the one GEMM of the attention input (q_a_proj or q_proj, kv_a_proj_with_mqa and
V3.2's indexer key) equals the separate projections, loads from the checkpoint's own tensors (whole, or a rank's
heads of q_proj under tensor parallelism), and goes back to them for HF; W_UV writes o_proj's input in place; and
V3.2's CUDA path (one prepare launch that also writes the cache, one set of token positions a step), run here
through Triton's interpreter, equals the torch path."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import scattered_paged_layout, tiny_config

from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.distributed import parallel_state
from pressroom.model.models.deepseek import (
    LatentInputProjection,
    MLAAttention,
    SparseMLAAttention,
    SparsePlan,
    input_parts,
    sparse_plan,
)
from pressroom.model.models.llama import RopeTables, rotary_from_config

ARCHS = ["deepseek_v2", "deepseek_v3", "deepseek_v32"]


def _config(arch: str, bias: bool = False):
    cfg = tiny_config(arch)
    cfg.attention_bias = bias
    return cfg


def _bare(cfg, arch: str) -> MLAAttention:
    """The layer as the loader builds it, before any weight arrives."""
    return SparseMLAAttention(cfg) if arch == "deepseek_v32" else MLAAttention(cfg)


def _layer(cfg, arch: str) -> MLAAttention:
    torch.manual_seed(0)
    layer = _bare(cfg, arch)
    for name, p in layer.named_parameters():
        p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)  # norm weights near 1, the rest small
    return layer


def _checkpoint_parts(cfg, arch: str, seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """Random tensors for each part the fused layer stacks, as a checkpoint ships them (weight, bias if any)."""
    gen = torch.Generator().manual_seed(seed)
    parts = {}
    for part in input_parts(cfg, indexer=arch == "deepseek_v32"):
        tensors = {"weight": torch.randn(part.rows, cfg.hidden_size, generator=gen) * 0.1}
        if part.bias:
            tensors["bias"] = torch.randn(part.rows, generator=gen)
        parts[part.name] = tensors
    return parts


def _load(layer: LatentInputProjection, parts: dict[str, dict[str, torch.Tensor]]) -> None:
    for name, tensors in parts.items():
        for kind, tensor in tensors.items():
            param = getattr(layer, kind)
            param.weight_loader(param, tensor, name)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_one_gemm_equals_the_separate_projections(arch, bias):
    """Each view of the fused output is x @ W_part^T (+ b_part) of its own checkpoint tensor; with attention_bias,
    q_a_proj and kv_a_proj_with_mqa bring theirs and the parts without one (q_proj, wk) add zeros."""
    cfg = _config(arch, bias)
    fused = _bare(cfg, arch).fused_qkv_a_proj
    parts = _checkpoint_parts(cfg, arch)
    _load(fused, parts)
    x = torch.randn(5, cfg.hidden_size)
    outs = fused.parts_of(fused(x))
    assert [p.name for p in fused.parts] == list(parts)
    assert len(outs) == len(parts) == (3 if arch == "deepseek_v32" else 2)
    for out, tensors in zip(outs, parts.values(), strict=True):
        torch.testing.assert_close(out, F.linear(x, tensors["weight"], tensors.get("bias")), atol=1e-5, rtol=1e-5)
    assert (fused.bias is not None) == bias


def test_a_part_of_another_shape_or_name_is_refused():
    cfg = _config("deepseek_v3")
    fused = _layer(cfg, "deepseek_v3").fused_qkv_a_proj
    with pytest.raises(ValueError, match=r"has shape \(7, 64\) where the model config implies \(40, 64\)"):
        fused.weight_loader(fused.weight, torch.zeros(7, 64), "kv_a_proj_with_mqa")
    with pytest.raises(ValueError, match="'q_proj' is none of the projections this layer stacks"):
        fused.weight_loader(fused.weight, torch.zeros(7, 64), "q_proj")


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_under_tensor_parallelism_each_rank_holds_its_heads_q_rows_over_the_whole_latent_rows(arch, monkeypatch):
    """Two ranks: V2's q_proj is split by heads (rank r: the r-th half of its rows), kv_a_proj_with_mqa (and V3's
    q_a_proj) whole; each rank's GEMM gives its heads' queries and the same latent as one rank."""
    cfg = _config(arch)
    parts = _checkpoint_parts(cfg, arch)
    x = torch.randn(3, cfg.hidden_size)
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_RANK", rank)
        monkeypatch.setattr(parallel_state, "_SIZE", 2)
        fused = MLAAttention(cfg).fused_qkv_a_proj
        _load(fused, parts)
        rows = [t["weight"].chunk(2)[rank] if p.by_heads else t["weight"] for p, t in zip(fused.parts, parts.values())]
        assert fused.parts[0].by_heads == (arch == "deepseek_v2")
        assert torch.equal(fused.weight, torch.cat(rows))
        for out, want in zip(fused.parts_of(fused(x)), rows, strict=True):
            torch.testing.assert_close(out, F.linear(x, want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_name_map_loads_the_checkpoints_parts_and_gives_them_back(arch, tiny_model_dir):
    """The checkpoint's q_a_proj / q_proj, kv_a_proj_with_mqa (and V3.2's indexer.wk) load into fused_qkv_a_proj,
    each under its own name as the shard id; the model expects those names, never the fused one; the bench's HF copy
    splits the fused weight back into the checkpoint's tensors (rope rows interleaved again), bit for bit."""
    from safetensors.torch import load_file

    from pressroom.benchmarks.gpu import hf_state_dict
    from pressroom.config import ModelConfig
    from pressroom.model.loader import load_model
    path = tiny_model_dir(arch)
    model = load_model(ModelConfig(model=path, dtype=torch.float32), "cpu").model
    prefix = "model.layers.1.self_attn."
    names = [p.name for p in model.input_parts()]
    assert names == (["q_proj"] if arch == "deepseek_v2" else ["q_a_proj"]) + ["kv_a_proj_with_mqa"] + \
        (["indexer.wk"] if arch == "deepseek_v32" else [])
    for name in names:
        assert model.checkpoint_target(f"{prefix}{name}.weight") == (f"{prefix}fused_qkv_a_proj.weight", name)
    assert model.checkpoint_parts(f"{prefix}fused_qkv_a_proj.weight") == [f"{prefix}{n}.weight" for n in names]
    expected = model.expected_weights()
    assert f"{prefix}kv_a_proj_with_mqa.weight" in expected and not any("fused" in n for n in expected)
    checkpoint = load_file(f"{path}/model.safetensors")
    state = hf_state_dict(model)
    for name in names:
        assert torch.equal(state[f"{prefix}{name}.weight"], checkpoint[f"{prefix}{name}.weight"]), name


def test_a_checkpoint_that_left_any_part_unquantized_keeps_the_whole_fused_layer_dense():
    """modules_to_not_convert naming any part (kv_a_proj_with_mqa, V3.2's indexer.wk) covers fused_qkv_a_proj, as q_proj
    covers qkv_proj: one matrix has one format."""
    from pressroom.model.quantization.base import excluded
    fused = "model.layers.3.self_attn.fused_qkv_a_proj"
    assert excluded(fused, ["kv_a_proj_with_mqa"]) and excluded(fused, ["model.layers.*.self_attn.indexer.wk"])
    assert excluded(fused, ["q_a_proj"]) and not excluded(fused, ["o_proj", "q_b_proj"])


def test_w_uv_writes_o_projs_input_in_place():
    """output(): the batched GEMM's rows land in o_proj's input [tokens, heads * v_dim] as the transposing copy put
    them."""
    cfg = _config("deepseek_v3")
    layer = _layer(cfg, "deepseek_v3")
    mixed = torch.randn(4, layer.num_heads, layer.rank)
    w_uv = layer.kv_b_proj.weight.view(layer.num_heads, layer.nope + layer.v_dim, layer.rank)[:, layer.nope:]
    before = torch.bmm(mixed.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(4, -1)
    assert torch.equal(layer.output(mixed), layer.o_proj(before))


def _meta(specs, block_size: int, gen: torch.Generator, index_dtype: torch.dtype, num_tokens: int,
          device: str = "cpu"):
    tables, seq_lens, qsl, num_blocks = scattered_paged_layout(specs, block_size, gen)
    slots = []
    for b, (context, queries) in enumerate(specs):
        for pos in range(context - queries, context):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * (num_tokens - len(slots))  # padding rows, as CUDA graphs run them
    meta = AttentionMetadata(num_decodes=1, num_decode_tokens=1, slot_mapping=torch.tensor(slots, device=device),
                             block_tables=tables.to(device, index_dtype), seq_lens=seq_lens.to(device, index_dtype),
                             query_start_loc=qsl.tolist(), seq_lens_host=seq_lens.tolist(),
                             query_start_loc_device=qsl.to(device), max_query_len=max(q for _, q in specs))
    return meta, num_blocks


def test_sparse_attentions_cuda_path_equals_its_torch_path():
    """V3.2's CUDA branch (through the interpreter on the CPU; as it is where CUDA is): the prepare kernel writes each
    entry (latent, shared key and the indexer key normed and rotated) into the cache and rotates the indexer's
    queries, the indexer scores with its head weights' scale folded in, and the sparse kernel attends over the
    chosen tokens: the cache and the attention's mix of latents equal the torch path's (fp32), for a decode past
    index_topk, a prompt chunk and a padding row."""
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = _config("deepseek_v32")
    layer = _layer(cfg, "deepseek_v32")
    specs, block_size, tokens = [(45, 1), (12, 5)], 8, 7
    meta_cpu, num_blocks = _meta(specs, block_size, torch.Generator().manual_seed(3), torch.int64, tokens - 1)
    meta_gpu, _ = _meta(specs, block_size, torch.Generator().manual_seed(3), torch.int32, tokens, device)
    past = torch.randn(layer.attn.cache_shape(num_blocks, block_size), generator=torch.Generator().manual_seed(4))
    rotary = rotary_from_config(cfg, cfg.qk_rope_head_dim)
    cos, sin = rotary.cos_sin(torch.tensor([44, 7, 8, 9, 10, 11, 0]))
    x = torch.randn(tokens, cfg.hidden_size)

    gpu_layer = copy.deepcopy(layer).to(device)
    gpu_layer.attn.kv_cache = past.to(device)
    rope = RopeTables(rotary.to(device), cos.to(device), sin.to(device))
    q_resid, q, kv, index_key = gpu_layer.inputs(x.to(device))
    with forward_context(meta_gpu):
        mixed = gpu_layer._sparse_on_gpu(rope, q, kv, index_key, q_resid, x.to(device), meta_gpu)

    layer.attn.kv_cache = past.clone()
    real = tokens - 1  # the torch path has no padding rows
    cpu_rope = RopeTables(rotary_from_config(cfg, cfg.qk_rope_head_dim), cos[:real], sin[:real])
    q_resid, q, kv, index_key = layer.inputs(x[:real])
    index_q, index_w = layer.indexer.queries(q_resid, x[:real], cpu_rope)
    query, key = layer.absorbed_query_and_key(cpu_rope, q, kv)
    entry = torch.cat((key, layer.indexer.keys(index_key, cpu_rope)), dim=-1)
    want = layer._sparse_on_cpu(query, entry, index_q, index_w, meta_cpu)

    torch.testing.assert_close(gpu_layer.attn.kv_cache.cpu(), layer.attn.kv_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[:real].cpu(), want, atol=1e-4, rtol=1e-4)
    assert isinstance(meta_gpu.plan, SparsePlan) and meta_gpu.plan.tokens == tokens


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_dense_mlas_cuda_path_writes_its_cache_in_the_prepare_launch(arch):
    """Dense MLA's CUDA branch: the prepare kernel writes each entry into its cache slot and the Triton backend
    attends over the cache as it is (no write_kv launch); the cache and the mix of latents equal the torch path's
    (the torch backend's write and attention), decode and prompt chunk alike (fp32)."""
    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.attention.triton_backend import TritonAttentionBackend
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = _config(arch)
    layer = _layer(cfg, arch)
    specs, block_size, tokens = [(30, 1), (12, 5)], 8, 6
    meta_cpu, num_blocks = _meta(specs, block_size, torch.Generator().manual_seed(3), torch.int64, tokens)
    meta_gpu, _ = _meta(specs, block_size, torch.Generator().manual_seed(3), torch.int32, tokens, device)
    past = torch.randn(layer.attn.cache_shape(num_blocks, block_size), generator=torch.Generator().manual_seed(4))
    rotary = rotary_from_config(cfg, cfg.qk_rope_head_dim)
    cos, sin = rotary.cos_sin(torch.tensor([29, 7, 8, 9, 10, 11]))
    x = torch.randn(tokens, cfg.hidden_size)

    gpu_layer = copy.deepcopy(layer).to(device)
    gpu_layer.attn.kv_cache, gpu_layer.attn.backend = past.to(device), TritonAttentionBackend()
    rope = RopeTables(rotary.to(device), cos.to(device), sin.to(device))
    _, q, kv, _ = gpu_layer.inputs(x.to(device))
    with forward_context(meta_gpu):
        mixed = gpu_layer.attn.forward_cached(gpu_layer._prepare_into_cache(rope, q, kv))

    layer.attn.kv_cache, layer.attn.backend = past.clone(), TorchAttentionBackend()
    _, q, kv, _ = layer.inputs(x)
    query, key = layer.absorbed_query_and_key(RopeTables(rotary_from_config(cfg, cfg.qk_rope_head_dim), cos, sin), q,
                                              kv)
    with forward_context(meta_cpu):
        want = layer.attn(query, key.unsqueeze(1))
    torch.testing.assert_close(gpu_layer.attn.kv_cache.cpu(), layer.attn.kv_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed.cpu(), want, atol=1e-4, rtol=1e-4)


def test_a_steps_token_positions_are_made_once(monkeypatch):
    """The first sparse layer of a step makes the token positions, the others read the same tensors; a forward
    of another token count remakes them, and so does the first layer of a CUDA graph's capture after the eager
    compile run with the same metadata (else the graph would replay the compile run's positions); another
    backend's plan is never overwritten."""
    from pressroom.model.models import deepseek
    gen = torch.Generator().manual_seed(5)
    meta, _ = _meta([(20, 1), (9, 3)], 8, gen, torch.int32, 4)
    first = sparse_plan(meta, 4)
    assert sparse_plan(meta, 4) is first and not first.captured
    assert first.token_pos.tolist() == [19, 6, 7, 8]
    monkeypatch.setattr(deepseek, "_capturing", lambda: True)
    in_graph = sparse_plan(meta, 4)
    assert in_graph is not first and in_graph.captured and sparse_plan(meta, 4) is in_graph
    assert sparse_plan(meta, 6).token_pos.tolist() == [19, 6, 7, 8, -1, -1]
    meta.plan = [0]
    with pytest.raises(ValueError, match="already holds another plan"):
        sparse_plan(meta, 4)
