"""DeepSeek V2 / V3 / V3.2 over two tensor-parallel ranks on the CPU (gloo): the attention heads split, the latent
path and V3.2's indexer replicated, the experts sliced or dealt out whole (expert parallelism). Two ranks give
the greedy fp32 tokens of one, with prompts longer than V3.2's index_topk (32) so its sparse attention selects;
each rank holds and reads half of the attention heads' weights; a head count the ranks do not divide is refused."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts, tiny_config

from pressroom import LLM, SamplingParams
from pressroom.config import ModelConfig
from pressroom.distributed import parallel_state
from pressroom.model.layers.linear import LinearBase
from pressroom.model.loader import LoadedModel, load_model

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
# lengths 68, 12, 11, 7 and 32: one past V3.2's index_topk of 32, one at it
PROMPTS = random_prompts(5, high=70, seed=3)
# rows split by heads across the ranks: each rank's share is the rank-th chunk along `dim`
HEAD_SPLIT = {"q_b_proj.weight": 0, "kv_b_proj.weight": 0, "o_proj.weight": 1}


def _generate(model: str, **kw) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


# Each two-rank run spawns two worker processes (20 s in CI on two cores): CI's two-rank DeepSeek-style run is
# V4's with expert parallelism (test_deepseek_v4_tensor_parallel.py); V2, V3 and V3.2 run with test-slow.
@pytest.mark.slow
@pytest.mark.parametrize("arch, expert_parallel", [
    ("deepseek_v3", False), ("deepseek_v3", True), ("deepseek_v2", False), ("deepseek_v2", True),
    ("deepseek_v32", False), ("deepseek_v32", True)])
def test_two_ranks_give_the_tokens_of_one(arch, expert_parallel, tiny_model_dir):
    model = tiny_model_dir(arch)
    two = _generate(model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert two == _generate(model)


@pytest.mark.slow
def test_per_head_caching_over_two_ranks(tiny_model_dir, monkeypatch):
    """PRESSROOM_MLA_DISABLE=1 (each rank's heads expanded from the latent and cached per head) gives the latent
    cache's tokens of one rank."""
    model = tiny_model_dir("deepseek_v2")
    one = _generate(model)
    monkeypatch.setenv("PRESSROOM_MLA_DISABLE", "1")  # the worker processes inherit it
    assert _generate(model, tensor_parallel_size=2) == one


def _load(path: str, monkeypatch, rank: int, ranks: int) -> LoadedModel:
    """The model rank `rank` of `ranks` builds and loads (no process group: loading needs no collective), its
    weights left in their plain layout for comparing."""
    monkeypatch.setattr(parallel_state, "_RANK", rank)
    monkeypatch.setattr(parallel_state, "_SIZE", ranks)
    monkeypatch.setattr(LinearBase, "prepack_onednn", lambda self: False)
    return load_model(ModelConfig(model=path, dtype=torch.float32), "cpu")


def _attention(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if ".self_attn." in name}


def _share(model, name: str, whole: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank `rank`'s share of parameter `name` of the one-rank model: a chunk of a head-split one; of the fused input
    projection, its q_proj rows chunked (V2) over the latent rows whole; any other whole."""
    dim = next((d for suffix, d in HEAD_SPLIT.items() if name.endswith(suffix)), None)
    if dim is not None:
        return whole.chunk(ranks, dim)[rank]
    if name.endswith("fused_qkv_a_proj.weight"):
        fused = model.get_submodule(name.removesuffix(".weight"))
        pieces = whole.split(fused.sizes)
        return torch.cat([p.chunk(ranks)[rank] if part.by_heads else p for p, part in zip(pieces, fused.parts)])
    return whole


@pytest.mark.parametrize("arch, ranks", [("deepseek_v32", 2), ("deepseek_v3", 4),
                                         pytest.param("deepseek_v2", 2, marks=pytest.mark.slow)])
def test_each_rank_holds_and_reads_its_share_of_the_heads(arch, ranks, tiny_model_dir, monkeypatch):
    """Rank r holds the r-th share of q_b_proj's (V2: q_proj's, in the fused input projection) and kv_b_proj's rows
    and of o_proj's columns (the rope rows reordered within each head, as one rank does), reads only those rows of
    the checkpoint, and holds the latent projections, their norms and the indexer whole. Four ranks: one head
    each."""
    path = tiny_model_dir(arch)
    whole = _load(path, monkeypatch, 0, 1)
    full = _attention(whole.model)
    head_params = [name for name in full if name.endswith(tuple(HEAD_SPLIT))]
    layers = tiny_config(arch).num_hidden_layers
    assert len(head_params) == (3 if tiny_config(arch).q_lora_rank else 2) * layers
    split_reads = [n for n in whole.reads.by_name if n.endswith(("q_b_proj.weight", "self_attn.q_proj.weight",
                                                                  "kv_b_proj.weight"))]
    assert len(split_reads) == 2 * layers
    for rank in range(ranks):
        loaded = _load(path, monkeypatch, rank, ranks)
        held = _attention(loaded.model)
        for name, param in held.items():
            assert torch.equal(param, _share(whole.model, name, full[name], rank, ranks)), (rank, name)
        assert sum(held[n].numel() for n in head_params) * ranks == sum(full[n].numel() for n in head_params)
        for name in split_reads:
            assert loaded.reads.by_name[name] * ranks == whole.reads.by_name[name], name


def test_a_head_count_the_ranks_do_not_divide_is_refused(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        _load(tiny_model_dir("deepseek_v3"), monkeypatch, 0, 3)


@pytest.mark.slow  # three worker processes
def test_the_engine_refuses_it_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(tiny_model_dir("deepseek_v3"), dtype="float32", device="cpu", tensor_parallel_size=3)


@pytest.fixture(scope="module")
def fp8_blocks(tmp_path_factory) -> str:
    """A tiny DeepSeek-V3 with every projection in DeepSeek's FP8 128x128 blocks (weight_scale_inv), shaped so two
    ranks split inputs at block edges: o_proj's 4 heads x 64, the MLPs' and experts' 256 intermediate features."""
    import transformers
    from fp8_checkpoint import write_fp8_checkpoint
    cfg = tiny_config("deepseek_v3")
    cfg.update(dict(v_head_dim=64, intermediate_size=256, moe_intermediate_size=256))
    torch.manual_seed(43)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape) * 0.5)
    root = tmp_path_factory.mktemp("deepseek-fp8-tp")
    model.save_pretrained(root / "src")
    write_fp8_checkpoint(root / "src", root / "fp8", "block")
    config = json.loads((root / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    return str(root / "fp8")


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_blocks_kept_in_fp8_over_two_ranks(fp8_blocks, expert_parallel, monkeypatch):
    """Each rank keeps its rows (q_b_proj, by heads) and columns (o_proj, the MLPs' down projections) in FP8 with
    their scales; the tokens are one rank's."""
    from pressroom.kernels import fp8
    loaded = _load(fp8_blocks, monkeypatch, 1, 2).model
    attn = loaded.model.layers[0].self_attn
    assert attn.q_b_proj.weight.dtype == attn.o_proj.weight.dtype == fp8.FP8
    assert attn.o_proj.weight.shape[1] == 128 and attn.o_proj.weight_scale.shape[1] == 1
    monkeypatch.undo()
    assert _generate(fp8_blocks, tensor_parallel_size=2, enable_expert_parallel=expert_parallel) == \
        _generate(fp8_blocks)
