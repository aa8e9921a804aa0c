"""`--batch-invariant` on the H200 in bf16: 64 requests, each alone and inside random batches of mixed sizes
and lengths (chunked prefill at several token budgets, CUDA graphs on), give bitwise identical tokens,
logprobs and prompt logprobs; the default mode does not; and the kernels keep a row's bits at real shapes."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import random_prompts

from pressroom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

N = 64
# Llama-3.1-8B's head shape (head_dim 128, GQA 4) and vocabulary at a fifth of its depth and width
SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=7168, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers
    path = tmp_path_factory.mktemp("llama-bi")
    transformers.LlamaConfig(**SHAPE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(N, low=5, high=700, seed=19, vocab=SHAPE["vocab_size"])


def _params(i: int) -> SamplingParams:
    """Greedy, and seeded sampling for every fourth; logprobs of the sampled tokens; the prompt's for every
    third (the LM head over whole chunks)."""
    random_row = i % 4 == 3
    return SamplingParams(temperature=0.8 if random_row else 0.0, seed=1000 + i if random_row else None,
                          max_tokens=24, ignore_eos=True, logprobs=4, detokenize=False,
                          prompt_logprobs=1 if i % 3 == 0 else None)


def _record(output) -> tuple:
    def positions(logprobs):
        return [None if p is None else sorted((t, lp.logprob) for t, lp in p.items()) for p in logprobs or []]
    completion = output.outputs[0]
    return tuple(completion.token_ids), positions(completion.logprobs), positions(output.prompt_logprobs)


def _run(llm: LLM, prompts: list[list[int]], ids: list[int]) -> dict[int, tuple]:
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in ids], [_params(i) for i in ids], use_tqdm=False)
    return {i: _record(o) for i, o in zip(ids, outs)}


def _llm(path: str, invariant: bool, budget: int) -> LLM:
    return LLM(path, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
               kv_cache_memory_gib=4, max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=1024,
               enable_prefix_caching=False, batch_invariant=invariant, seed=5)


def _random_batches(rng: random.Random) -> list[list[int]]:
    ids = list(range(N))
    rng.shuffle(ids)
    batches = []
    while ids:
        size = rng.choice([2, 3, 7, 13, 24, 40])
        batches.append(ids[:size])
        ids = ids[size:]
    return batches


@pytest.fixture(scope="module")
def alone(model_dir, prompts):
    llm = _llm(model_dir, True, budget=8192)
    result = {i: _run(llm, prompts, [i])[i] for i in range(N)}
    llm.shutdown()
    return result


@pytest.mark.parametrize("budget", [96, 512, 8192])
def test_64_requests_are_bitwise_the_same_alone_and_in_random_batches(model_dir, prompts, alone, budget):
    llm = _llm(model_dir, True, budget)
    batched = {}
    for batch in _random_batches(random.Random(budget)):
        batched |= _run(llm, prompts, batch)
    together = _run(llm, prompts, list(range(N)))
    llm.shutdown()
    differing = sorted(i for i in range(N) if batched[i] != alone[i] or together[i] != alone[i])
    assert not differing, f"requests {differing} differ from their runs alone"


def test_the_default_mode_differs(model_dir, prompts, alone):
    """Without the mode the same comparison fails (cuBLAS, split-KV and tile shapes follow the batch)."""
    llm = _llm(model_dir, False, budget=512)
    together = _run(llm, prompts, list(range(N)))
    llm.shutdown()
    assert together != alone


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_matmul_rows_keep_their_bits_at_8b_shapes(n, k):
    from pressroom.kernels.triton.matmul import invariant_matmul
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    x = torch.randn(300, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    alone = torch.cat([invariant_matmul(x[i:i + 1], weight) for i in range(8)])
    for m in (1, 3, 8, 16, 17, 64, 129, 300):
        assert torch.equal(invariant_matmul(x[:m], weight)[:min(m, 8)], alone[:min(m, 8)]), f"M = {m}"
    torch.testing.assert_close(invariant_matmul(x, weight).float(), (x.float() @ weight.float().T),
                               atol=2e-2, rtol=2e-2)


def test_cublas_rows_change_with_the_batch_at_an_8b_shape():
    """What the matmul above fixes: cuBLAS's algorithm for a row alone and for it among many differ."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(4096, 14336, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    x = torch.randn(512, 14336, device="cuda", generator=gen, dtype=torch.bfloat16)
    alone = x[:1] @ weight.T
    assert any(not torch.equal((x[:m] @ weight.T)[:1], alone) for m in (2, 16, 64, 512))


@pytest.mark.parametrize("context", [2048, 700])
def test_attention_of_a_query_is_the_same_whole_chunked_and_decoded(context):
    from pressroom.kernels.triton.attention import paged_attention
    heads, kv_heads, dim, block = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(context)
    blocks = -(-context // block)
    cache = torch.randn(2, blocks + 1, block, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    table = torch.randperm(blocks + 1, device="cuda", generator=gen)[:blocks].int()
    q = torch.randn(context, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)

    def run(runs: list[tuple[int, int]]) -> torch.Tensor:
        """Each (start, end) of the one request's positions as a query of its own in one launch."""
        lens = [e - s for s, e in runs]
        loc = torch.tensor([0, *lens], device="cuda").cumsum(0).int()
        out = torch.zeros(sum(lens), heads, dim, device="cuda", dtype=torch.bfloat16)
        paged_attention(torch.cat([q[s:e] for s, e in runs]), cache, table.expand(len(runs), -1).contiguous(),
                        torch.tensor([e for _, e in runs], device="cuda", dtype=torch.int32), loc, max(lens),
                        dim ** -0.5, out, batch_invariant=True)
        return out

    whole = run([(0, context)])
    cuts = [0, 1, 100, 613, context]
    assert torch.equal(run(list(zip(cuts[:-1], cuts[1:]))), whole)
    tail = list(range(context - 64, context))
    assert torch.equal(run([(p, p + 1) for p in tail]), whole[tail[0]:])
