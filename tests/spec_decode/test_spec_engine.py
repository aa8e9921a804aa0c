"""Speculative decoding through the engine: greedy output equals no speculation, sampled output keeps
the target's distribution, and stops, max_tokens, logprobs, seeds and the prefix cache behave."""
from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TINY_SHAPE, random_prompts

from pressroom import LLM, SamplingParams

# Fixed K: these tests check verification itself, so every draft must be verified; the adaptive
# budget (on by default) would drop drafts whenever a CPU step is compute-bound.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_token_budget": False}


def _gen(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _repetitive_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds continuations (code edits, lists)."""
    return [(p * 4)[:40 + 3 * i] for i, p in enumerate(random_prompts(n, low=6, high=14, seed=21))]


@pytest.mark.slow
def test_greedy_equals_no_speculation_on_the_embedded_model():
    prompts = _repetitive_prompts(6) + random_prompts(2, seed=22)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = _gen(LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1), prompts, params)
    spec_llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1, speculative_config=NGRAM)
    assert _gen(spec_llm, prompts, params) == plain
    stats = spec_llm.engine.stats().spec
    assert stats.num_drafts > 20 and stats.num_accepted_tokens > stats.num_drafts  # mean acceptance length > 2
    assert spec_llm.engine.kv_cache.usage() == 0.0
    adaptive = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1,
                   speculative_config=dict(NGRAM, adaptive_token_budget=True))
    assert _gen(adaptive, prompts, params) == plain  # whatever the budget chose, the output is the same
    assert adaptive.engine.scheduler.spec_budget is not None


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def test_stops_max_tokens_logprobs_and_prefix_cache(tiny):
    prompts = _repetitive_prompts(6)
    free = _gen(LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05), prompts,
                SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    spec = LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05, speculative_config=NGRAM)
    stops = [t[9] for t in free]
    params = [SamplingParams(temperature=0, max_tokens=7 + i, stop_token_ids=[stops[i]], ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    outs = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (o, f) in enumerate(zip(outs, free)):
        ids = list(o.outputs[0].token_ids)
        cut = f.index(stops[i]) + 1 if stops[i] in f[:7 + i] else 7 + i  # stop token or max_tokens mid-draft
        assert ids == f[:cut]
        assert len(o.outputs[0].logprobs) == len(ids) and all(t in lp for t, lp in zip(ids, o.outputs[0].logprobs))
    # The prefix cache only ever holds verified tokens: a prompt that extends an earlier output reuses it.
    follow = prompts[0] + free[0][:20]
    again = _gen(spec, [follow], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert again == free[0][20:28]
    assert spec.engine.kv_cache.usage() == 0.0


def test_seeded_sampling_repeats_and_preemption_keeps_greedy(tiny):
    spec = LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05, speculative_config=NGRAM)
    prompts = _repetitive_prompts(4)
    params = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=20, ignore_eos=True) for i in range(4)]
    assert _gen(spec, prompts, params) == _gen(spec, prompts, params)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    many = _repetitive_prompts(16)
    small = LLM(tiny, dtype="float32", num_gpu_blocks_override=30, speculative_config=NGRAM)
    assert _gen(small, many, greedy) == _gen(LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05), many, greedy)
    assert small.engine.stats().num_preemptions > 0


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """32-token vocabulary, so the exact distribution of three generated tokens can be enumerated."""
    import transformers
    torch.manual_seed(5)
    config = transformers.LlamaConfig(**dict(TINY_SHAPE, vocab_size=32, initializer_range=0.6))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("vocab32"))
    model.save_pretrained(path)
    return path, model


@torch.inference_mode()
def _exact_next3(model, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) at temperature 1, as a [32, 32, 32] tensor."""
    vocab = 32
    p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    seqs2 = torch.tensor([prompt + [a] for a in range(vocab)])
    p2 = torch.softmax(model(seqs2).logits[:, -1], -1)  # [t1, t2]
    seqs3 = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(vocab), repeat=2)])
    p3 = torch.softmax(model(seqs3).logits[:, -1], -1).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def _assert_next3_distribution(path: str, model, speculative_config: dict, setup=None, **engine) -> None:
    """4,000 samples of the next three tokens after a prompt holding every token twice (so each
    sampled token has a 2-token draft to verify), against the exact distribution. An exact
    sampler's 4,000-sample total variation over these marginals stays near 0.03; the bound is 0.07;
    accepting drafts without the test shifts t2 and t3 by far more."""
    prompt = list(range(32)) * 2
    exact = _exact_next3(model, prompt)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True,
              speculative_config={**speculative_config, "adaptive_token_budget": False}, **engine)
    if setup is not None:
        setup(llm)
    n = 4000
    outs = _gen(llm, [prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, detokenize=False))
    counts = torch.zeros(32, 32, 32)
    for t in outs:
        counts[t[0], t[1], t[2]] += 1
    empirical = counts / n

    def tv(a, b):
        return 0.5 * float((a - b).abs().sum())

    stats = llm.engine.stats().spec
    assert stats.num_drafts > n * 0.9 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert tv(empirical.sum((1, 2)), exact.sum((1, 2))) < 0.07  # t1 (no draft involved: a control)
    assert tv(empirical.sum((0, 2)), exact.sum((0, 2))) < 0.07  # t2: the verified draft or its resample
    assert tv(empirical.sum((0, 1)), exact.sum((0, 1))) < 0.07  # t3: bonus token or next step


def test_sampled_tokens_keep_the_target_distribution(small_vocab_model):
    """n-gram drafts (a deterministic proposal, q one-hot)."""
    path, model = small_vocab_model
    _assert_next3_distribution(path, model, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1})


def test_draft_model_greedy_equals_no_speculation(tiny_model_dir):
    target, other = tiny_model_dir("llama"), tiny_model_dir("qwen2")  # same tokenizer, other weights
    prompts = random_prompts(6, low=5, high=40, seed=31)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _gen(LLM(target, dtype="float32", kv_cache_memory_gib=0.05), prompts, params)
    for draft in (target, other):
        llm = LLM(target, dtype="float32", kv_cache_memory_gib=0.05,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                      "adaptive_token_budget": False})
        assert _gen(llm, prompts, params) == plain
        stats = llm.engine.stats().spec
        if draft == target:  # the target drafting for itself: every draft is accepted
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        assert llm.engine.kv_cache.usage() == 0.0


def _count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_budget_plans_drafts_so_the_draft_model_skips_unwanted_passes(tiny, async_scheduling):
    """When the adaptive budget plans no drafts (here: a draft pass priced at a second), the draft model
    runs no drafting passes (sync: none at all but the probes; async: only the mirror pass each step,
    whose first draft is free), and the output stays the target's. Fixed K is the control."""
    prompts = random_prompts(4, low=5, high=30, seed=33)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _gen(LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05), prompts, params)
    passes = {}
    for adaptive in (False, True):
        llm = LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05, async_scheduling=async_scheduling,
                  speculative_config={"method": "draft_model", "model": tiny, "num_speculative_tokens": 3,
                                      "adaptive_token_budget": adaptive})
        if adaptive:
            budget = llm.engine.scheduler.spec_budget
            assert budget.draft_costs is not None and (budget.first_draft_costs is not None) == async_scheduling
            budget.draft_costs = [(1, 1.0), (1024, 1.0)]
        target = _count_forwards(llm.engine.model)
        draft = _count_forwards(llm.engine.runner.proposer.runner.model)
        assert _gen(llm, prompts, params) == plain
        passes[adaptive] = (draft[0], target[0])
    fixed_draft, fixed_target = passes[False]
    planned_draft, planned_target = passes[True]
    assert fixed_draft >= 2 * fixed_target  # K = 3: catch-up or mirror plus two more passes a step
    assert planned_draft <= (planned_target if async_scheduling else planned_target // 4)


def test_draft_model_sampling_keeps_the_target_distribution(small_vocab_model, tmp_path_factory):
    """As the n-gram test, with a different random 32-token model drafting 2 tokens from its own q."""
    import transformers
    path, model = small_vocab_model
    torch.manual_seed(6)
    config = transformers.LlamaConfig(**dict(TINY_SHAPE, vocab_size=32, initializer_range=0.6))
    draft_dir = str(tmp_path_factory.mktemp("draft32"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(draft_dir)
    _assert_next3_distribution(path, model, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2})


def test_dflash2_with_selector_sampling_keeps_the_target_distribution(small_vocab_model, tmp_path):
    """As above, with a random DFlash2 drafter: the selector samples a 2-token path over each slot's
    top-4 candidates and hands its conditionals q to verification."""
    from pressroom.spec_decode.dflash2 import DFlash2Config, DFlash2Drafter, save_drafter
    path, model = small_vocab_model
    torch.manual_seed(8)
    cfg = DFlash2Config(block_size=2, target_layers=(0, 1), num_heads=2, conv_kernel_size=2, conv_group_size=16,
                        top_m=4, rank=8)
    drafter_dir = str(tmp_path / "dflash2")
    save_drafter(DFlash2Drafter(TINY_SHAPE["hidden_size"], cfg, 32), drafter_dir)
    _assert_next3_distribution(path, model, {"method": "dflash2", "model": drafter_dir, "num_speculative_tokens": 2})


@pytest.mark.slow
def test_committed_dflash2_drafter_serves_the_embedded_model():
    """dflash2 with no "model" loads the drafter committed for SmolLM2; on held-out chat prompts it keeps
    greedy output identical and gets drafts accepted (an untrained drafter gets almost none)."""
    import json
    from pathlib import Path
    data = Path(__file__).parents[2] / "benchmarks" / "data" / "chat_heldout.jsonl"
    texts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()[:4]]
    plain_llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1)
    prompts = [plain_llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=40)
    spec_llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1,
                   speculative_config={"method": "dflash2", "num_speculative_tokens": 8,
                                       "adaptive_token_budget": False})
    plain = _gen(plain_llm, prompts, params)
    assert _gen(spec_llm, prompts, params) == plain
    stats = spec_llm.engine.stats().spec
    assert stats.num_accepted_tokens > 0.3 * stats.num_drafts  # mean acceptance length above 1.3
    # The default configuration (adaptive budget: block passes and LM-head slots profiled at start-up).
    adaptive = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1,
                   speculative_config={"method": "dflash2"})
    budget = adaptive.engine.scheduler.spec_budget
    assert budget.block_costs is not None
    assert _gen(adaptive, prompts, params) == plain
    assert budget.log_slowdown[0] != 0.0  # the synchronous decode steps reported their wall time


def test_dflash2_without_a_drafter_needs_one_for_other_targets(tiny):
    with pytest.raises(ValueError, match="train-drafter"):
        LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05, speculative_config={"method": "dflash2"})


def test_draft_model_cache_shares_the_kv_memory(tiny):
    """The draft model's cache has as many blocks as the target's, so both come out of the KV memory: a
    draft model as large as the target halves the blocks (on CUDA the draft cache used to be allocated
    on top of a profile that had already given everything to the target)."""
    plain = LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05)
    spec = LLM(tiny, dtype="float32", kv_cache_memory_gib=0.05,
               speculative_config={"method": "draft_model", "model": tiny, "num_speculative_tokens": 2})
    blocks = plain.engine.runner.kv_caches[0].shape[1]
    assert spec.engine.runner.kv_caches[0].shape[1] in (blocks // 2, blocks // 2 + 1)
