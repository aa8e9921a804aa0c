"""DeepSeek-V4 over two tensor-parallel ranks on the CPU (gloo): the attention heads split (q_b_proj by heads, the
sinks, o_a_proj by its head groups, o_b_proj row-parallel), the query latent, the K=V head, the compressors and
the lightning indexer replicated, the routed experts sliced or dealt out whole (expert parallelism). Two ranks give
the greedy fp32 tokens of one over the tiny V4 (sliding, CSA and HCA layers; hash and score-routed MoE), with
prompts past the sliding window and past index_topk's entries; each rank holds and reads its share of the heads;
a head count or o_groups the ranks do not divide is refused."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from pressroom import LLM, SamplingParams
from pressroom.config import ModelConfig
from pressroom.distributed import parallel_state
from pressroom.model.layers.linear import LinearBase
from pressroom.model.loader import LoadedModel, load_model
from pressroom.model.models.deepseek_v4 import DeepseekV4ForCausalLM, canonical_name

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from test_deepseek_v4 import CSA_RATE, TINY, TOPK, WINDOW, prompts_of, save_tiny  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
# past the window (12) and past index_topk's (5) entries of 4 tokens; one within both; one between
PROMPTS = prompts_of([45, 7, 26, 13], seed=5)
assert max(map(len, PROMPTS)) > max(WINDOW, TOPK * CSA_RATE) and min(map(len, PROMPTS)) < WINDOW
# split by heads (o_a_proj: by head groups): each rank's share is the rank-th chunk along `dim`
HEAD_SPLIT = {"self_attn.q_b_proj.weight": 0, "self_attn.sinks": 0, "self_attn.o_a_proj.weight": 0,
              "self_attn.o_b_proj.weight": 1}


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-deepseek-v4-tp")
    save_tiny(path, None)
    return str(path)


def _generate(model: str, **kw) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


# Each two-rank run spawns two worker processes: CI runs expert parallelism, test-slow the sliced experts too.
@pytest.mark.slow  # two worker processes each, 10 s a case
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_two_ranks_give_the_tokens_of_one(expert_parallel, tiny_v4):
    two = _generate(tiny_v4, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert two == _generate(tiny_v4)


@pytest.mark.slow
def test_chunked_prefill_over_two_ranks(tiny_v4):
    """Prompts cut into chunks beside decodes (each rank's compressor rings carried across them) over small blocks:
    the tokens of one rank run the same way."""
    chunked = dict(max_num_batched_tokens=16, block_size=8)
    assert _generate(tiny_v4, tensor_parallel_size=2, **chunked) == _generate(tiny_v4, **chunked)


def _load(path: str, monkeypatch, rank: int, ranks: int) -> LoadedModel:
    """The model rank `rank` of `ranks` builds and loads (no process group: loading needs no collective), its
    weights left in their plain layout for comparing."""
    monkeypatch.setattr(parallel_state, "_RANK", rank)
    monkeypatch.setattr(parallel_state, "_SIZE", ranks)
    monkeypatch.setattr(LinearBase, "prepack_onednn", lambda self: False)
    return load_model(ModelConfig(model=path, dtype=torch.float32), "cpu")


def _reads(loaded: LoadedModel) -> dict[str, int]:
    """Bytes read by the model's parameter name (the checkpoint names DeepSeek's way)."""
    return {canonical_name(raw): n for raw, n in loaded.reads.by_name.items()}


def _split_dim(name: str) -> int | None:
    return next((d for suffix, d in HEAD_SPLIT.items() if name.endswith(suffix)), None)


def test_each_rank_holds_and_reads_its_share_of_the_heads(tiny_v4, monkeypatch):
    """Rank r holds the r-th share of q_b_proj's rows, the sinks, o_a_proj's rows (its head group) and o_b_proj's
    columns, reads only those of the checkpoint, and holds everything else outside the MoE and the vocabulary
    whole: q_a_proj, kv_proj, the norms, the compressors, the indexer, the hyper-connections."""
    whole = _load(tiny_v4, monkeypatch, 0, 1)
    full = dict(whole.model.named_parameters())
    head_params = [name for name in full if _split_dim(name) is not None]
    assert len(head_params) == len(HEAD_SPLIT) * TINY["num_hidden_layers"]
    replicated = [n for n in full if _split_dim(n) is None and ".mlp." not in n and "embed" not in n
                  and "lm_head" not in n]
    assert any(".compressor.indexer." in n for n in replicated) and any("_hc." in n for n in replicated)
    for rank in range(2):
        loaded = _load(tiny_v4, monkeypatch, rank, 2)
        held = dict(loaded.model.named_parameters())
        for name in head_params:
            assert torch.equal(held[name], full[name].chunk(2, _split_dim(name))[rank]), (rank, name)
        assert sum(held[n].numel() for n in head_params) * 2 == sum(full[n].numel() for n in head_params)
        for name in replicated:
            assert torch.equal(held[name], full[name]), (rank, name)
        reads, whole_reads = _reads(loaded), _reads(whole)
        for name in head_params:
            if not name.endswith("o_b_proj.weight"):  # its columns: a row-major file reads whole rows
                assert reads[name] * 2 == whole_reads[name], name


def _build(monkeypatch, ranks: int, **overrides):
    monkeypatch.setattr(parallel_state, "_RANK", 0)
    monkeypatch.setattr(parallel_state, "_SIZE", ranks)
    return DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY | overrides))


@pytest.mark.parametrize("ranks, overrides, message", [
    (3, {}, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    (2, dict(o_groups=1), r"o_groups \(1\) is not divisible by tensor_parallel_size \(2\)")])
def test_heads_or_groups_the_ranks_do_not_divide_are_refused(ranks, overrides, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        _build(monkeypatch, ranks, **overrides)


@pytest.mark.slow  # three worker processes
def test_the_engine_refuses_it_at_start(tiny_v4):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(tiny_v4, dtype="float32", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=3)
