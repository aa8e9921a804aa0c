"""Async scheduling with a draft model: step N+1 is scheduled and prepared before step N's accepted
tokens reach the host; verification and drafting stay on the device. Greedy output equals sync
speculation and no speculation token for token; sampling keeps the target's distribution.

The CPU has nothing to overlap, but the bookkeeping is the one CUDA runs: optimistic booking with
placeholder drafts, positions shifted on the device by the previous step's rejections, the draft
model mirroring each target step in the target's block layout, results one step late.
"""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE, random_prompts
from test_spec_engine import _assert_next3_distribution, small_vocab_model  # noqa: F401 (a fixture)

from pressroom import LLM, LLMEngine, SamplingParams
from pressroom.config import EngineArgs, SpeculativeConfig, resolve_async_scheduling
from pressroom.worker.rejection_sampler import verify, verify_on_device
from pressroom.worker.sampler import SamplingRow


def _draft(model: str, k: int = 3, **extra) -> dict:
    # Fixed K unless asked: the adaptive budget would drop drafts whenever a CPU step is compute-bound.
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "adaptive_token_budget": False,
            **extra}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """Another random model with the target's vocabulary: its drafts are almost always rejected."""
    import transformers
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_SHAPE), dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("stranger"))
    model.save_pretrained(path)
    return path


def _llm(path: str, **engine) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True, **engine)


def _gen(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.kv_cache.usage() == 0.0  # every block back, lookahead included
    return [list(o.outputs[0].token_ids) for o in outs]


def _three_ways(path: str, draft: str, prompts, params, **engine) -> tuple[list, list, list, LLM]:
    plain = _gen(_llm(path, **engine), prompts, params)
    sync = _gen(_llm(path, async_scheduling=False, speculative_config=_draft(draft), **engine), prompts, params)
    llm = _llm(path, async_scheduling=True, speculative_config=_draft(draft), **engine)
    assert llm.engine.runner.device_drafting
    return plain, sync, _gen(llm, prompts, params), llm


@pytest.mark.parametrize("drafter", ["self", "stranger"])
def test_greedy_equals_sync_and_no_speculation(target, stranger, drafter):
    """Prompts of many lengths (chunked prefill), some sharing a prefix (prefix-cache hits: the drafter
    reads its cache there too), max_tokens that end requests mid-draft and at different steps, and stop
    tokens; a drafter that is always right and one that is almost never."""
    draft = target if drafter == "self" else stranger
    shared = random_prompts(1, low=40, high=41, seed=40)[0]
    prompts = random_prompts(5, low=3, high=70, seed=41) + [shared + p for p in random_prompts(3, high=9, seed=42)]
    free = _gen(_llm(target), prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                      detokenize=False))
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True, detokenize=False,
                             stop_token_ids=[free[i][11]] if i % 3 == 0 else [])
              for i in range(len(prompts))]
    plain, sync, async_, llm = _three_ways(target, draft, prompts, params, max_num_batched_tokens=40)
    assert async_ == sync == plain
    assert [len(t) for t in async_] != [5 + 3 * i for i in range(len(prompts))]  # some stop token did end one
    assert llm.engine.stats().prefix_cache_hits > 0
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > 50
    if drafter == "self":  # the target drafting for itself: every draft verified is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 4


def test_preemption_and_adaptive_budget(target, stranger):
    prompts = random_prompts(16, low=20, high=50, seed=42)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, detokenize=False)
    plain = _gen(_llm(target), prompts, params)
    small = _llm(target, num_gpu_blocks_override=40, async_scheduling=True, speculative_config=_draft(target))
    assert _gen(small, prompts, params) == plain
    assert small.engine.stats().num_preemptions > 0
    adaptive = _llm(target, async_scheduling=True, speculative_config=_draft(stranger, adaptive_token_budget=True))
    assert adaptive.engine.scheduler.spec_budget is not None
    assert _gen(adaptive, prompts[:6], params) == plain[:6]  # whatever the budget chose, the output is the same


def test_requests_arriving_mid_run_and_abort_in_flight(target):
    prompts = random_prompts(6, low=4, high=40, seed=43)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, detokenize=False)
    plain = _gen(_llm(target), prompts, params)
    engine = LLMEngine.from_engine_args(EngineArgs(model=target, dtype="float32", kv_cache_memory_gib=0.05,
                                                   skip_tokenizer_init=True, async_scheduling=True,
                                                   speculative_config=_draft(target)))
    engine.add_request("doomed", {"prompt_token_ids": prompts[0]}, params)
    done: dict[str, list[int]] = {}
    for step in range(60):
        if step < len(prompts) * 2 and step % 2 == 0:  # one more request every other step
            engine.add_request(f"r{step // 2}", {"prompt_token_ids": prompts[step // 2]}, params)
        if step == 4:
            engine.abort_request("doomed")  # a step holding its tokens is in flight
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    assert done == {f"r{i}": plain[i] for i in range(len(prompts))}
    engine.step()  # drains the step still in flight
    assert engine.kv_cache.usage() == 0.0


def test_history_reading_requests_verify_in_step_and_agree(target, stranger):
    """Penalties, min_tokens and logprobs need host token histories: such a batch resolves the step in
    flight and verifies on the host, while drafting stays on the device; others share the batch."""
    prompts = random_prompts(6, low=4, high=30, seed=44)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False,
                             repetition_penalty=1.3, min_tokens=4, logprobs=1) if i % 2 else
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]
    for draft in (target, stranger):
        plain, sync, async_, llm = _three_ways(target, draft, prompts, params)
        assert async_ == sync == plain
        assert llm.engine.stats().spec.num_draft_tokens > 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, p in zip(outs, params):
        if p.logprobs is not None:
            ids = o.outputs[0].token_ids
            assert len(o.outputs[0].logprobs) == len(ids) and all(t in lp for t, lp in zip(ids, o.outputs[0].logprobs))


def _alternating_plan(llm) -> None:
    """Half the requests planned one draft, half two: the draft model's second pass covers only some rows,
    the others keep filler drafts and q that must never be verified."""
    sched = llm.engine.scheduler

    def plan(sampling):
        limits = {r.request_id: 1 + int(r.request_id) % 2 for r in sampling}
        for r in sampling:
            r.spec_token_ids = r.spec_token_ids[:limits[r.request_id]]
        return limits

    sched._plan_drafts = plan


def test_requests_planned_no_drafts_fall_behind_and_catch_up(target):
    """The draft model is the target itself, so with greedy sampling every draft survives if (and only
    if) the draft cache holds the right KV. Most steps plan no drafts, for some requests or all of them:
    those requests skip the draft model, and the next step that drafts for one first catches it up from
    the host. A wrong catch-up (positions, tokens, slots) would show as rejected drafts."""
    llm = _llm(target, async_scheduling=True, speculative_config=_draft(target))
    sched, proposer = llm.engine.scheduler, llm.engine.runner.proposer
    steps = iter(range(1 << 20))
    behind_seen = []

    def plan(sampling):
        n = next(steps)
        limits = {r.request_id: 2 if (n + int(r.request_id)) % 5 == 4 else 0 for r in sampling}
        for r in sampling:
            r.spec_token_ids = r.spec_token_ids[:limits[r.request_id]]
        behind_seen.append(max(proposer.behind.values(), default=0))
        return limits

    sched._plan_drafts = plan
    prompts = random_prompts(6, low=4, high=40, seed=21)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _gen(_llm(target), prompts, params)
    before = llm.engine.stats().spec
    assert _gen(llm, prompts, params) == plain
    after = llm.engine.stats().spec
    drafted = after.num_draft_tokens - before.num_draft_tokens
    assert drafted > 40 and after.num_accepted_tokens - before.num_accepted_tokens == drafted
    assert max(behind_seen) >= 4  # requests really fell several tokens behind before catching up


@pytest.mark.parametrize("partial", [False, True])
def test_draft_model_sampling_keeps_the_target_distribution_under_async(small_vocab_model, tmp_path_factory,  # noqa: F811
                                                                        partial):
    """The shared next-three-tokens check, with the rejection sampler and the draft's q on the device;
    `partial`: drafting planned per row (some rows stop after the mirror pass's first draft)."""
    import transformers
    path, model = small_vocab_model
    torch.manual_seed(6)
    config = transformers.LlamaConfig(**dict(TINY_SHAPE, vocab_size=32, initializer_range=0.6))
    draft_dir = str(tmp_path_factory.mktemp("async-draft32"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(draft_dir)
    _assert_next3_distribution(path, model, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2},
                               _alternating_plan if partial else None, async_scheduling=True)


def test_device_verification_matches_the_host_for_greedy_rows():
    torch.manual_seed(0)
    num_drafts = [0, 3, 1, 2, 3]
    logits = torch.randn(sum(1 + k for k in num_drafts), 11)
    target = logits.argmax(-1).tolist()
    drafts, first = [], 0
    for i, k in enumerate(num_drafts):  # drafts that agree with the target for a while, then not
        agree = min(i, k)
        drafts.append(target[first:first + agree] + [(t + 1) % 11 for t in target[first + agree:first + k]])
        first += 1 + k
    params = SamplingParams(temperature=0)
    padded = torch.tensor([d + [0] * (3 - len(d)) for d in drafts])
    tokens, counts = verify_on_device(logits, [params] * len(drafts), num_drafts, padded, None, None)
    first = 0
    for i, (d, k) in enumerate(zip(drafts, num_drafts)):
        rows = [SamplingRow(params, [], [], None)] * (k + 1)
        expected = verify(logits[first:first + k + 1], rows, d, None, None)
        assert tokens[i, :counts[i]].tolist() == expected
        first += 1 + k


def test_synthetic_acceptance_runs_on_the_device(target):
    prompts = random_prompts(4, seed=45)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    plain = _gen(_llm(target), prompts, params)
    none = _llm(target, async_scheduling=True, speculative_config=_draft(
        target, rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.0]))
    assert _gen(none, prompts, params) == plain  # every draft rejected: each step emits the target's argmax
    stats = none.engine.stats().spec
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0


def test_async_default_and_refusals():
    draft, ngram = SpeculativeConfig(method="draft_model", model="x"), SpeculativeConfig(method="ngram")
    assert resolve_async_scheduling(None, "cuda", None)
    assert resolve_async_scheduling(None, "cuda", draft)  # a drafter on the device: on by default
    assert not resolve_async_scheduling(None, "cuda", ngram)  # host-side lookup: synchronous
    assert not resolve_async_scheduling(None, "cuda", SpeculativeConfig(method="dflash2", model="x"))
    assert not resolve_async_scheduling(None, "cpu", draft)  # nothing to overlap on the CPU
    assert resolve_async_scheduling(True, "cpu", draft) and not resolve_async_scheduling(False, "cuda", draft)
    assert not resolve_async_scheduling(False, "cuda", ngram)
    with pytest.raises(ValueError, match="ngram.*synchronous scheduling.*drop async_scheduling=True"):
        resolve_async_scheduling(True, "cuda", ngram)
    with pytest.raises(ValueError, match="dflash2"):
        EngineArgs(model="x", device="cpu", async_scheduling=True,
                   speculative_config={"method": "dflash2", "model": "x"}).create_engine_config()
    config = EngineArgs(model="x", device="cpu", async_scheduling=True,
                        speculative_config={"method": "draft_model", "model": "x"}).create_engine_config()
    assert config.scheduler.async_scheduling
