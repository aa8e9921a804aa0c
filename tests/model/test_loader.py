"""HF-directory loading: sharded safetensors, dummy weights, and errors."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import random_prompts

from pressroom import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir, tmp_path):
    import transformers
    single = tiny_model_dir("qwen2")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{single}/{name}", sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, seed=4)]
    a = LLM(single, dtype="float32", kv_cache_memory_gib=0.05).generate(prompts, GREEDY, use_tqdm=False)
    b = LLM(str(sharded), dtype="float32", kv_cache_memory_gib=0.05).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_dummy_weights_need_no_checkpoint(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory_gib=0.05)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    assert llm.engine.model.model.embed_tokens.weight.abs().max() > 0


def test_the_cpu_default_dtype_follows_the_cpu(tiny_model_dir):
    from pressroom.platforms.cpu import cpu_info
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory_gib=0.05)
    expected = torch.bfloat16 if cpu_info().native_bf16 else torch.float32
    assert llm.engine.model.lm_head.weight.dtype == expected


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tiny_model_dir("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    tensors = load_file(f"{src}/model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        LLM(str(tmp_path), kv_cache_memory_gib=0.05)


def test_unsupported_architecture_is_named(tmp_path):
    import transformers
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path), load_format="dummy")


def test_fp32_linear_is_prepacked_and_gives_a_row_the_same_bits_in_any_batch():
    """fp32 CPU weights go to oneDNN's blocked layout (faster than torch's BLAS at decode-sized batches on an
    AVX2 EPYC); a row's output does not depend on the rows beside it, which keeps batched greedy output equal
    to the same request alone."""
    from pressroom.model.layers.linear import MergedColumnParallelLinear
    gen = torch.Generator().manual_seed(0)
    layer = MergedColumnParallelLinear(96, [64, 64])
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)
    x = torch.randn(33, 96, generator=gen)
    plain = x.double() @ layer.weight.data.double().t()
    if not layer.prepack_onednn():
        pytest.skip("this torch build has no oneDNN prepacking")
    assert layer.onednn is not None and layer.weight.numel() == 0
    batched = layer(x)
    assert torch.allclose(batched.double(), plain, atol=1e-5)
    for rows in (1, 3, 8, 17):
        assert torch.equal(layer(x[:rows]), batched[:rows])


def test_onednn_prepacked_linear_matches_plain_with_bias():
    from pressroom.model.layers.linear import QKVParallelLinear
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True)
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
    layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    plain = layer(x)
    if not layer.prepack_onednn():
        pytest.skip("this torch build has no oneDNN prepacking")
    assert layer.weight.numel() == 0  # the plain copy is dropped
    assert torch.allclose(layer(x).float(), plain.float(), atol=0.05, rtol=0.02)


# ---- tensor parallelism: each rank reads only its slices of the checkpoint ----

def _load_as(monkeypatch, path: str, rank: int, size: int, eager: bool = False, expert_parallel: bool = False):
    """`load_model` as rank `rank` of `size` runs it (loading needs no process group, so in this process), with
    the plain weights kept (no oneDNN prepacking) to compare. eager: every tensor read whole, then narrowed by
    the weight loaders, as before lazy loading."""
    from pressroom.config import ModelConfig
    from pressroom.distributed import parallel_state
    from pressroom.model import gguf_file, loader
    monkeypatch.setattr(parallel_state, "_RANK", rank)
    monkeypatch.setattr(parallel_state, "_SIZE", size)
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", expert_parallel)
    monkeypatch.setattr(loader, "_prepack", lambda model: None)
    with monkeypatch.context() as patch:
        if eager:
            for module, name in ((loader, "iter_safetensors"), (gguf_file, "iter_gguf_weights")):
                lazy = getattr(module, name)
                patch.setattr(module, name, lambda *a, lazy=lazy: ((n, w.load()) for n, w in lazy(*a)))
        return loader.load_model(ModelConfig(model=path, dtype=torch.float32), "cpu")


def _checkpoint_bytes(path: str) -> int:
    if path.endswith(".gguf"):
        from pressroom.model import gguf_file
        return sum(info.n_bytes for info in gguf_file._open(path).tensors)  # the file's tensor table
    from safetensors import safe_open
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return sum(f.get_slice(n)[:].nbytes for n in f.keys())


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_each_rank_reads_only_its_slices_of_the_checkpoint(source, tiny_model_dir, embedded_path, monkeypatch):
    """At TP=2 a sharded tensor's bytes are read once over the two ranks (each its slice), a replicated one (the
    norms) by both; what rank 1 (the one at nonzero offsets) loads equals what it loads reading every tensor
    whole, as before. The tiny Llama splits evenly; the embedded Q4_1 GGUF (Q4 projections, a Q8_0 tied
    embedding, llama.cpp's permuted q/k rows) splits its 3 KV heads 2:1."""
    path = tiny_model_dir("llama") if source == "safetensors" else embedded_path
    ranks = [_load_as(monkeypatch, path, rank, 2) for rank in range(2)]
    eager = _load_as(monkeypatch, path, 1, 2, eager=True)
    eager_params = dict(eager.model.named_parameters())
    for name, param in ranks[1].model.named_parameters():
        assert torch.equal(param, eager_params[name]), name
    whole = eager.reads.by_name  # every tensor read whole
    total = sum(whole.values())
    assert total == _checkpoint_bytes(path)
    replicated = {name for name in whole if "norm" in name}
    reads = [r.reads.by_name for r in ranks]
    for name, n_bytes in whole.items():
        read = [r.get(name, 0) for r in reads]
        if name in replicated:
            assert read == [n_bytes, n_bytes], name
        else:
            assert sum(read) == n_bytes and min(read) > 0, (name, read, n_bytes)
    half = (total - sum(whole[name] for name in replicated)) / 2 + sum(whole[name] for name in replicated)
    assert all(abs(r.reads.total - half) < 0.05 * total for r in ranks), ([r.reads.total for r in ranks], half)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_rank_reads_no_expert_it_does_not_hold(expert_parallel, tiny_model_dir, monkeypatch):
    """Expert parallelism: each expert's matrices are read by the rank that holds the expert, and not at all by
    the other; sliced experts: each rank reads half of every expert."""
    path = tiny_model_dir("qwen2_moe")
    whole = _load_as(monkeypatch, path, 0, 1).reads.by_name
    ranks = [_load_as(monkeypatch, path, r, 2, expert_parallel=expert_parallel).reads.by_name for r in range(2)]
    experts = [name for name in whole if ".experts." in name]
    assert len(experts) == 6 * 3  # one sparse layer: 6 experts' gate, up and down
    for name in experts:
        read = [r.get(name, 0) for r in ranks]
        assert sorted(read) == ([0, whole[name]] if expert_parallel else [whole[name] // 2] * 2), (name, read)
