"""Models with recurrent layers through the engine (a tiny random HF Mamba): prefix caching restores a
checkpointed state and computes only the suffix, with the output of a cold run; chunked prefill carries the
state over chunks and checkpoints inside them; checkpoints evicted between two requests never serve a wrong
state; preemption recomputes exactly; what cannot work is refused at start with a sentence."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from pressroom import LLM, SamplingParams

VOCAB = 1000
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory) -> str:
    import transformers
    torch.manual_seed(3)
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2,
                                      conv_kernel=4, expand=2, initializer_range=0.2)
    path = str(tmp_path_factory.mktemp("tiny-mamba"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _llm(path: str, **kwargs) -> LLM:
    # one step holds any of these prompts whole but the 1,000-token ones (the eviction test asserts which
    # checkpoints a step reserves, so neither the step's size nor a long prompt's share may depend on the CPU)
    options = dict(dtype="float32", kv_cache_memory_gib=0.02, skip_tokenizer_init=True, block_size=8,
                   mamba_block_size=40, max_num_batched_tokens=512, long_prefill_token_threshold=0)
    return LLM(path, **(options | kwargs))


def _prompts(seed: int, prefix_len: int, suffix_lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, VOCAB, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in suffix_lens]


def _generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cold(mamba_dir):
    """Outputs with prefix caching off: every token computed."""
    llm = _llm(mamba_dir, enable_prefix_caching=False)
    yield lambda prompts: _tokens(_generate(llm, prompts))
    llm.shutdown()


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 96])
def test_a_shared_1000_token_prefix_is_restored_and_only_the_suffix_computed(mamba_dir, cold,
                                                                             max_num_batched_tokens):
    """The second request's state starts at the checkpoint of token 1,000 (the engine counts 1,000 cached
    tokens); with 96-token steps the first prompt's checkpoints (every 40 tokens) are written inside chunks."""
    first, second = _prompts(1, 1000, [13, 21])
    llm = _llm(mamba_dir, max_num_batched_tokens=max_num_batched_tokens)
    out_first = _generate(llm, [first])[0]
    out_second = _generate(llm, [second])[0]
    assert out_first.num_cached_tokens == 0 and out_second.num_cached_tokens == 1000
    assert _tokens([out_first, out_second]) == cold([first, second])
    llm.shutdown()


def test_checkpoints_evicted_between_two_requests_never_serve_a_wrong_state(mamba_dir, cold):
    """Room for four checkpoints: the first prompt's step reserves them for its first four boundaries (40..160),
    so a request sharing its 200-token prefix restores at 160; requests with other prefixes then take every
    slot over (least recently used first), and the next sharer starts from zeros. Every output is the cold
    run's."""
    first, second, third = _prompts(2, 200, [5, 9, 3])
    others = _prompts(3, 0, [120, 130, 140])
    state_bytes = 2 * (128 * 3 + 128 * 8) * 4
    llm = _llm(mamba_dir, kv_cache_memory_gib=6 * state_bytes / (1 << 30), max_num_seqs=2)
    assert llm.engine.core.kv_cache.states.num_checkpoints == 4
    outs = [_generate(llm, [first])[0], _generate(llm, [second])[0]]
    _generate(llm, others)
    outs.append(_generate(llm, [third])[0])
    assert [o.num_cached_tokens for o in outs] == [0, 160, 0]
    assert _tokens(outs) == cold([first, second, third])
    llm.shutdown()


def test_preempted_requests_recompute_to_the_same_tokens(mamba_dir, cold):
    """Eight blocks for requests that need up to five each: the scheduler preempts and recomputes, states
    included (a readmitted request starts from zeros or from a checkpoint of its own prompt)."""
    prompts = _prompts(4, 0, [20, 25, 30, 18])
    llm = _llm(mamba_dir, num_gpu_blocks_override=8)
    outs = _generate(llm, prompts)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert _tokens(outs) == cold(prompts)
    llm.shutdown()


def test_the_start_up_log_says_what_fits(mamba_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pressroom"):
        llm = _llm(mamba_dir, max_num_seqs=4)
    # per request: 2 layers x (conv [128, 3] + ssm [128, 8]) floats
    state_bytes = 2 * (128 * 3 + 128 * 8) * 4
    match = re.search(r"recurrent state: (\d+) bytes per request; (\d+) live slots .*; (\d+) prefix checkpoints "
                      r"every (\d+) tokens", caplog.text)
    assert match is not None and int(match.group(1)) == state_bytes
    assert int(match.group(2)) == 4 and int(match.group(3)) > 0 and int(match.group(4)) == 40
    llm.shutdown()


def test_a_state_too_large_for_the_budget_and_speculation_are_refused_at_start(mamba_dir):
    with pytest.raises(ValueError, match="holds no request"):
        _llm(mamba_dir, kv_cache_memory_gib=1e-6)
    with pytest.raises(ValueError, match="not supported for models with recurrent layers"):
        _llm(mamba_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 3})


def test_a_prompt_past_the_model_length_is_a_clear_error(mamba_dir):
    llm = _llm(mamba_dir, max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        _generate(llm, _prompts(5, 0, [80]))
    assert _tokens(_generate(llm, _prompts(5, 0, [20]))) and llm.engine.core.scheduler is not None
    llm.shutdown()


def test_a_hybrid_logs_its_capacity_against_the_full_attention_equivalent(tmp_path, caplog):
    """Nemotron-H with one attention layer in four: the log sets KV + state bytes per token against every layer
    holding that attention layer's KV."""
    import transformers
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"], intermediate_size=48,
        ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=6, n_groups=2, chunk_size=16)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="pressroom"):
        llm = _llm(str(tmp_path), max_model_len=512)
    kv = 2 * 2 * 8 * 4  # one attention layer: k and v, 2 heads of 8, fp32
    full = re.search(r"full-attention equivalent .*: ([\d.]+) KV bytes per token; capacity multiplier ([\d.]+)x",
                     caplog.text)
    per_token = float(re.search(r"KV \+ state bytes per token at max_model_len 512: ([\d.]+)", caplog.text).group(1))
    assert full is not None and float(full.group(1)) == 4 * kv
    assert float(full.group(2)) == pytest.approx(4 * kv / per_token, rel=1e-2) and per_token > kv
    llm.shutdown()
