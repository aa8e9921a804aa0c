"""DeepSeek-V4 on CUDA through the engine (Triton attention and lightning indexer, the compressor's decodes on the
device, the Triton experts with V4's clamped SwiGLU), against HF transformers on the same tiny random weights
(fp32, HF on the CPU): greedy tokens for 64 new tokens equal HF's, prompt logprobs within 1e-3, prompts of mixed
lengths in one batch; eager, and with decode steps replayed from CUDA graphs; a second pass from the prefix cache
(compressor states restored half-way through an HCA window)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))

from conftest import record_mtp_drafts  # noqa: E402
from test_deepseek_v4 import CSA_RATE, GREEDY_TOKENS, check_against_hf, prompts_of, save_tiny  # noqa: E402

from pressroom import LLM, SamplingParams  # noqa: E402

HCA_RATE, CHECKPOINT = 32, 48  # an HCA window spans two blocks of 16; checkpoints fall half-way through one
LENGTHS = [5, 11, 40, 150, 97, 260]


@pytest.fixture(scope="module")
def tiny_v4_wide(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-deepseek-v4-gpu")  # no tokenizer: the GPU image lacks the embedded model
    save_tiny(path, None, seed=11, compress_rates={"compressed_sparse_attention": CSA_RATE,
                                                               "heavily_compressed_attention": HCA_RATE})
    return str(path)


@pytest.mark.parametrize("graphs", [False, True])
def test_tiny_v4_matches_hf_on_cuda(tiny_v4_wide, graphs):
    import transformers
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_v4_wide, dtype=torch.float32)
    llm = LLM(tiny_v4_wide, device="cuda", dtype="float32", skip_tokenizer_init=True, enforce_eager=not graphs,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3, block_size=16, mamba_block_size=CHECKPOINT)
    assert bool(llm.engine.core.cuda_graphs) == graphs
    prompts = prompts_of(LENGTHS, seed=12)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_against_hf(hf_model, prompt, out, with_prompt_logprobs=True)
    # again without prompt logprobs: compressor states restored from checkpoints, entries read from cached blocks
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // CHECKPOINT * CHECKPOINT for n in LENGTHS]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    llm.shutdown()


@pytest.mark.parametrize("graphs", [False, True])
def test_v4_mtp_and_partly_accepted_drafts_keep_greedy_output_on_cuda(tmp_path, monkeypatch, graphs):
    """Speculation on CUDA: the MTP layer drafting (its first draft as HF's modules compute it), and drafts the
    target accepts in part, verified through the compressors' rings (decodes on the device, verify steps eager;
    with graphs on, plain decode steps replayed); greedy output equal to plain decoding."""
    from test_deepseek_v4_mtp import MTP, NGRAM, TINY, _generate, _prompts, reference_first_draft, save_tiny_with_mtp

    from pressroom.spec_decode.ngram import NgramProposer
    hf_model, mtp = save_tiny_with_mtp(tmp_path, seed=3)
    engine = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, enforce_eager=not graphs,
                  max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    prompts = _prompts(5, [6, 30, 70, 150])
    plain_llm = LLM(str(tmp_path), **engine)
    plain = _generate(plain_llm, prompts, 40)
    plain_llm.shutdown()
    seen = record_mtp_drafts(monkeypatch)
    llm = LLM(str(tmp_path), speculative_config=MTP, **engine)
    assert _generate(llm, prompts, 40) == plain
    firsts = [(tokens, d) for tokens, d in seen if any(len(tokens) == len(p) + 1 and tokens[:len(p)] == p
                                                       for p in prompts)]
    assert len(firsts) == len(prompts)
    for tokens, drafts in firsts:
        assert drafts[0] == reference_first_draft(hf_model, mtp, tokens)
    llm.shutdown()

    def spoiled_truth(self, token_ids, max_drafts):
        prompt, out = next((p, o) for p, o in zip(prompts, plain) if token_ids[:len(p)] == p)
        done = len(token_ids) - len(prompt)
        drafts = out[done:done + min(self.k, max_drafts)]
        if done % 4 < len(drafts):
            drafts[done % 4] = (drafts[done % 4] + 1) % TINY["vocab_size"]
        return drafts

    monkeypatch.setattr(NgramProposer, "lookup", spoiled_truth)
    llm = LLM(str(tmp_path), speculative_config=NGRAM, **engine)
    assert _generate(llm, prompts, 40) == plain
    stats = llm.engine.stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.shutdown()
