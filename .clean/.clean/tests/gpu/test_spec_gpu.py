"""Speculative decoding on CUDA: greedy output equals no speculation on a tiny random model, for every
method (ngram, draft_model, dflash2), synchronous and async."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE, random_prompts

from pressroom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    import transformers
    out = []
    for seed in (1234, 99):  # the target, and another random model with its vocabulary as drafter
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**dict(TINY_SHAPE, hidden_size=512, intermediate_size=1024,
                                            num_attention_heads=4, num_key_value_heads=1)), dtype=torch.float32)
        path = str(tmp_path_factory.mktemp(f"spec{seed}"))
        model.save_pretrained(path)
        out.append(path)
    return out


def _random_dflash2(target: str, path: str) -> str:
    from pressroom.model.loader import load_hf_config
    from pressroom.spec_decode.dflash2 import DFlash2Config, DFlash2Drafter, save_drafter
    hf = load_hf_config(target)
    torch.manual_seed(7)
    cfg = DFlash2Config(block_size=4, target_layers=(0, 1), num_heads=4, top_m=4, rank=8)
    save_drafter(DFlash2Drafter(hf.hidden_size, cfg, hf.vocab_size), path)
    return path


def test_greedy_speculation_equals_plain_decoding(dirs, tmp_path):
    target, drafter = dirs
    block_drafter = _random_dflash2(target, str(tmp_path / "dflash2"))
    prompts = [(p * 4)[:48] for p in random_prompts(8, low=6, high=12, seed=3)]  # repetitive: n-gram drafts
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)

    def run(**spec):
        llm = LLM(target, device="cuda", dtype="float32", kv_cache_memory_gib=0.25, max_num_seqs=32,
                  skip_tokenizer_init=True, **spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.engine.stats().spec

    plain, _ = run()
    for config in ({"method": "ngram", "num_speculative_tokens": 4, "adaptive_token_budget": False},
                   {"method": "draft_model", "model": drafter, "num_speculative_tokens": 3,
                    "adaptive_token_budget": False},
                   {"method": "dflash2", "model": block_drafter, "num_speculative_tokens": 4,
                    "adaptive_token_budget": False},
                   {"method": "ngram", "num_speculative_tokens": 4}):
        tokens, stats = run(speculative_config=config)
        assert tokens == plain, config
        if config.get("adaptive_token_budget") is False:  # fixed K: every step verified drafts
            assert stats.num_drafts > 0, config


def test_async_draft_model_equals_sync_and_plain(dirs):
    """Async scheduling (on by default on CUDA with a draft model): verification, drafting and the next
    step's inputs stay on the GPU; greedy output equals sync speculation and no speculation."""
    target, drafter = dirs
    prompts = random_prompts(8, low=4, high=60, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]

    def run(**engine):
        llm = LLM(target, device="cuda", dtype="float32", kv_cache_memory_gib=0.25, max_num_seqs=32,
                  skip_tokenizer_init=True, **engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.kv_cache.usage() == 0.0
        return [list(o.outputs[0].token_ids) for o in outs], llm

    plain, _ = run()
    for draft in (target, drafter):  # accepts every draft / rejects most
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive_token_budget": False}
        sync, _ = run(async_scheduling=False, speculative_config=config)
        async_, llm = run(speculative_config=config)
        assert llm.engine.runner.device_drafting
        assert async_ == sync == plain, draft
        stats = llm.engine.stats().spec
        assert stats.num_draft_tokens > 0
        if draft == target:
            assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_async_draft_model_sampling_runs_and_frees_everything(dirs):
    """The device rejection sampler and the draft's q on the GPU: every request gets its max_tokens."""
    target, drafter = dirs
    llm = LLM(target, device="cuda", dtype="float32", kv_cache_memory_gib=0.25, max_num_seqs=32,
              skip_tokenizer_init=True,
              speculative_config={"method": "draft_model", "model": drafter, "num_speculative_tokens": 3})
    assert llm.engine.runner.device_drafting
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(16, seed=6)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 16
    assert llm.engine.kv_cache.usage() == 0.0


def test_verifications_and_draft_passes_replay_cuda_graphs(dirs):
    """Verification steps (1 + k query tokens per request, padded to the captured length) and the draft
    model's passes replay CUDA graphs; the draft model is the target itself, so every greedy draft must
    survive, and the output equals eager decoding without speculation."""
    target, _ = dirs
    prompts = random_prompts(12, low=4, high=60, seed=8)
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]  # max_tokens cuts some drafts short: shorter queries, padded

    def run(**engine):
        llm = LLM(target, device="cuda", dtype="float32", kv_cache_memory_gib=0.25, max_num_seqs=32,
                  skip_tokenizer_init=True, **engine)
        replayed = []
        for runner in filter(None, (llm.engine.runner, getattr(llm.engine.runner.proposer, "runner", None))):
            if runner.graphs is not None:
                replayed.append(_record_replays(runner.graphs))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm, replayed

    eager, _, _ = run(enforce_eager=True)
    config = {"method": "draft_model", "model": target, "num_speculative_tokens": 3, "adaptive_token_budget": False}
    tokens, llm, (target_keys, draft_keys) = run(speculative_config=config)
    assert tokens == eager
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert 4 in {q for q, _ in target_keys}  # verifications of up to 3 drafts (every decode verifies some)
    assert {q for q, _ in draft_keys} >= {1, 5}  # draft steps, and mirror passes of up to 2 + 3 tokens


def _record_replays(graphs) -> list:
    keys, replay = [], graphs.replay

    def recording(key, *args):
        keys.append(key)
        return replay(key, *args)

    graphs.replay = recording
    return keys
