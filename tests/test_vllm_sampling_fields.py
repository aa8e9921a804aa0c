"""vLLM's request fields below the server: allowed_token_ids and bad_words in the sampler, bad words tokenized as
vLLM tokenizes them, truncate_prompt_tokens' rules, and the cache salt in the prefix cache's block keys."""
from __future__ import annotations

import pytest
import torch

from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.request import Request
from pressroom.sampling_params import MAX_NUM_BAD_WORDS, SamplingParams, bad_words_token_ids, truncated_prompt
from pressroom.worker.rejection_sampler import verify
from pressroom.worker.sampler import SamplingRow, needs_host_history, sample

VOCAB = 8
LOGITS = [0.5, 2.0, -1.0, 1.0, -3.0, 1.5, 0.0, -0.5]  # greedy: 1, then 5, then 3


def _greedy(params: SamplingParams, output: list[int] = ()) -> int:
    row = SamplingRow(params, [0], list(output), eos_token_id=None)
    tokens, _ = sample(torch.tensor([LOGITS]), [row])
    return tokens[0]


def test_allowed_token_ids_leave_only_those_tokens():
    assert _greedy(SamplingParams(temperature=0.0)) == 1
    assert _greedy(SamplingParams(temperature=0.0, allowed_token_ids=[2, 3, 6])) == 3
    rows = [SamplingRow(SamplingParams(seed=s, allowed_token_ids=[4, 7]), [0], [], None) for s in range(40)]
    tokens, _ = sample(torch.tensor([LOGITS] * len(rows)), rows)
    assert set(tokens) == {4, 7}  # sampled, never outside the set, however unlikely the allowed ones are


def test_bad_words_mask_a_words_last_token_once_its_prefix_ends_the_output():
    params = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[1], [6, 5]])
    assert _greedy(params) == 5  # a one-token word is always banned
    assert _greedy(params, [6]) == 3  # the output ends with the word's first token: its last is banned
    assert _greedy(params, [6, 2]) == 5  # not right after it: allowed
    assert needs_host_history(params) and needs_host_history(SamplingParams(allowed_token_ids=[1]))


def test_bad_words_see_the_drafts_before_each_verified_position():
    """Speculative verification: the history at draft j's position holds the drafts before it."""
    params = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[1, 5]])
    rows = [SamplingRow(params, [0], [6] + drafts, None) for drafts in ([], [1], [1, 5])]
    logits = torch.zeros(3, VOCAB)
    logits[0, 1] = logits[1, 5] = logits[2, 3] = 9.0  # the target's own choices: 1, then 5, then 3
    logits[1, 2] = 8.0  # its second choice after 1
    assert verify(logits, rows, [1, 5], None, None) == [1, 2]  # unbanned: [1, 5, 3]


def test_bad_words_tokenized_with_and_without_a_leading_space():
    vocab = {"foo": [10], " foo": [11], "a b": [1, 2], " a b": [3, 2], "ab": [4, 5], " ab": [6]}
    out = bad_words_token_ids(["foo", " a b", "ab"], vocab.__getitem__)
    # " a b" is stripped first; " ab" has fewer tokens than "ab", so only "ab" itself is banned (vLLM's rule)
    assert out == [[10], [11], [1, 2], [3, 2], [4, 5]]
    with pytest.raises(ValueError, match="no tokens"):
        bad_words_token_ids(["z"], lambda text: [])
    calls = []
    with pytest.raises(ValueError, match="Too many bad words"):
        bad_words_token_ids([f"w{i}" for i in range(1000)], lambda text: calls.append(text) or [len(calls)])
    assert len(calls) <= 2 * (MAX_NUM_BAD_WORDS + 1)  # stops once over the cap


def test_truncate_prompt_tokens_rules():
    ids = list(range(10))
    assert truncated_prompt(ids, 3, 16) == [7, 8, 9]
    assert truncated_prompt(ids, -1, 4) == [6, 7, 8, 9]  # -1: max_model_len
    assert truncated_prompt(ids, None, 4) == ids
    with pytest.raises(ValueError, match="greater than max_model_len"):
        truncated_prompt(ids, 17, 16)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        truncated_prompt(ids, 0, 16)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def _req(rid: str, salt: str | None) -> Request:
    return Request(rid, list(range(10)), SamplingParams(max_tokens=4), eos_token_id=None, cache_salt=salt)


def test_cache_salt_keeps_prefix_blocks_apart():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    assert kv.allocate_slots(_req("a", "s1"), 10)
    assert kv.get_computed_blocks(_req("b", "s1"))[1] == 8  # equal salts share
    assert kv.get_computed_blocks(_req("c", "s2"))[1] == 0  # a different salt finds nothing
    assert kv.get_computed_blocks(_req("d", None))[1] == 0  # nor does no salt


def test_llm_generate_honours_them_beside_a_plain_request(tiny_model_dir):
    """Offline, under async scheduling, in one batch with a plain request (which alone would sample on the device)."""
    from pressroom import LLM
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05, async_scheduling=True)
    try:
        prompt = {"prompt_token_ids": list(range(100, 140))}
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        plain = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        allowed = greedy.clone(temperature=1.0, seed=5, allowed_token_ids=[7, 70, 700])
        truncated = greedy.clone(truncate_prompt_tokens=9)
        outs = llm.generate([prompt] * 3, [greedy, allowed, truncated], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == plain
        assert set(outs[1].outputs[0].token_ids) <= {7, 70, 700}
        assert outs[2].prompt_token_ids == list(range(131, 140))
    finally:
        llm.shutdown()
