"""Greedy speculation on the CPU's fused decode stack with verifications of 1 + 8 rows (one pass of the 4-bit row
kernel over each unpacked block since issue 45 item 4; before, the byte panels): the tokens are plain decoding's."""
from __future__ import annotations

import pytest
import torch

from pressroom import LLM, SamplingParams
from pressroom.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: no fused decode stack")


@pytest.mark.slow
def test_nine_row_verifications_keep_greedy_decoding_token_for_token(monkeypatch):
    """Slow (two engines of the embedded model, ~30 s on two cores): fp32, n-gram drafts of K = 8 on a prompt
    that repeats itself, so most steps verify 9 rows in one call of the fused stack."""
    prompt = {"prompt_token_ids": [int(t) for t in torch.arange(700, 730).repeat(4)]}
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    plain = LLM(kv_cache_memory_gib=0.05, dtype="float32").generate([prompt], params)[0].outputs[0].token_ids
    spec = LLM(kv_cache_memory_gib=0.05, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 8, "adaptive_token_budget": False})
    rows_per_call: list[int] = []
    run = cpu.decode_stack

    def counted(x, *args, **kwargs):
        rows_per_call.append(x.shape[0])
        return run(x, *args, **kwargs)

    monkeypatch.setattr(cpu, "decode_stack", counted)
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert spec.engine.stats().spec.num_drafts > 0 and 9 in rows_per_call, rows_per_call
