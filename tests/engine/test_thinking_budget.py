"""thinking_token_budget: the sampler forces the end-of-thinking token(s) once the budget is spent.

Sampler-level tests on fixed logits, then the engine on the tiny llama whose tokenizer has `<think>` and
`</think>` (conftest's think_model_dir). The random model never emits `</think>` by itself here: a logit
bias pushes it away, so the only way it appears is the forced one.
"""
from __future__ import annotations

import pytest
import torch

from pressroom import LLM, SamplingParams
from pressroom.worker.sampler import SamplingRow, forced_token, sample

START, END, END2 = 5, 6, 7


def row(output: list[int], prompt: list[int] | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt or [1, 2], output, None)


# ---- sampler ----

def test_forced_token_counts_from_the_span_start():
    p = dict(thinking_token_budget=3, think_end_token_ids=[END])
    assert forced_token(row([9, 9], **p)) is None                       # no start ids: output starts inside
    assert forced_token(row([9, 9, 9], **p)) == END
    assert forced_token(row([9, 9, 9, END], **p)) is None                # closed
    assert forced_token(row([9, END, 9, 9, 9], **p)) is None             # closed by the model itself
    p = dict(thinking_token_budget=2, think_start_token_ids=[START], think_end_token_ids=[END])
    assert forced_token(row([9, 9], prompt=[1, START], **p)) == END      # opened by the prompt (chat template)
    assert forced_token(row([9, 9], prompt=[1, START, END], **p)) is None  # prompt's span already closed
    assert forced_token(row([9, 9, 9], prompt=[1], **p)) is None         # never opened
    assert forced_token(row([9, START, 9], prompt=[1], **p)) is None     # opened in the output, 1 spent
    assert forced_token(row([9, START, 9, 9], prompt=[1], **p)) == END
    assert forced_token(row([START, 9, 9, END, START, 9, 9], prompt=[1], **p)) == END  # a second span
    assert forced_token(row([], prompt=[1, START], thinking_token_budget=0, think_start_token_ids=[START],
                            think_end_token_ids=[END])) == END  # budget 0: close at once


def test_multi_token_end_marker_is_forced_in_order():
    p = dict(thinking_token_budget=2, think_end_token_ids=[END, END2])
    assert forced_token(row([9, 9], **p)) == END
    assert forced_token(row([9, 9, END], **p)) == END2
    assert forced_token(row([9, 9, END, END2], **p)) is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_forces_the_token_and_reports_raw_logprobs(temperature):
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5, 0.2, 0.1, -2.0, 0.0]])
    r = row([9, 9], thinking_token_budget=2, think_end_token_ids=[END], temperature=temperature, seed=3,
            logprobs=1, logit_bias={END: -50.0})  # even against a bias
    tokens, lps = sample(logits, [r], torch.Generator().manual_seed(0))
    assert tokens == [END]
    ids, values, ranks = lps[0]
    assert ids[0] == END and values[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[END]))
    assert ranks[0] == 8  # the model's own rank for it: the forced token is not made to look likely


def test_rows_without_budget_are_untouched():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5, 0.2, 0.1, -2.0, 0.0]] * 2)
    rows = [row([9], temperature=0.0), row([9], temperature=0.0, thinking_token_budget=1,
                                            think_end_token_ids=[END])]
    tokens, _ = sample(logits, rows)
    assert tokens == [1, END]


# ---- engine ----

@pytest.fixture(scope="module")
def llm(think_model_dir) -> LLM:
    return LLM(think_model_dir, dtype="float32", kv_cache_memory_gib=0.05)


@pytest.fixture(scope="module")
def markers(llm) -> tuple[int, int]:
    tok = llm.get_tokenizer()
    return tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")


def chat_ids(llm: LLM, text: str = "Why is the sky blue?") -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("budget", [0, 1, 5])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_budget_caps_the_thinking_span(llm, markers, budget, temperature):
    start, end = markers
    prompt = chat_ids(llm)
    assert prompt[-2] == start  # the template opened the span
    params = SamplingParams(max_tokens=budget + 6, temperature=temperature, seed=11, ignore_eos=True,
                            thinking_token_budget=budget, logit_bias={end: -100.0, start: -100.0},
                            skip_special_tokens=False)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    assert len(ids) == budget + 6
    assert ids.index(end) == budget and ids.count(end) == 1  # forced once, then the answer goes on
    assert "</think>" in out.text


def test_budget_in_a_batch_with_preemption_is_consistent(think_model_dir, llm, markers):
    """Each of a batch gets its own cap; a tiny KV cache that preempts and recomputes does not move it."""
    _, end = markers
    small = LLM(think_model_dir, dtype="float32", num_gpu_blocks_override=12, block_size=4)
    prompts = [{"prompt_token_ids": chat_ids(llm, f"question {i}")} for i in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, thinking_token_budget=b,
                             logit_bias={end: -100.0}) for b in (2, 4, 7, 20)]
    outs = small.generate(prompts, params, use_tqdm=False)
    for out, b in zip(outs, (2, 4, 7, 20)):
        ids = out.outputs[0].token_ids
        assert len(ids) == 20
        assert (ids.index(end) if end in ids else len(ids)) == b
    assert small.engine.scheduler.num_preemptions > 0


def test_no_budget_means_no_forcing(llm, markers):
    _, end = markers
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias={end: -100.0})
    out = llm.generate([{"prompt_token_ids": chat_ids(llm)}], params, use_tqdm=False)[0].outputs[0]
    assert end not in out.token_ids


def test_budget_needs_markers(tiny_model_dir):
    plain = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.02)
    with pytest.raises(ValueError, match="think_end_token_ids"):
        plain.generate(["hi"], SamplingParams(thinking_token_budget=2), use_tqdm=False)
    with pytest.raises(ValueError, match="think_end_token_ids"):
        plain.generate(["hi"], SamplingParams(thinking_token_budget=2, think_end_token_ids=[10 ** 9]),
                       use_tqdm=False)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "unlimited"
    # explicit ids work on any vocabulary
    out = plain.generate(["hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                thinking_token_budget=1, think_end_token_ids=[42, 43]),
                         use_tqdm=False)[0].outputs[0]
    assert out.token_ids[1:3] == [42, 43]


def test_session_id_reaches_the_request_output(llm):
    engine = llm.engine
    engine.add_request("s1", "Hello", SamplingParams(max_tokens=2), session_id="conv-42")
    engine.add_request("s2", "Hello", SamplingParams(max_tokens=2))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert {o.session_id for o in outs["s1"]} == {"conv-42"}
    assert {o.session_id for o in outs["s2"]} == {None}
