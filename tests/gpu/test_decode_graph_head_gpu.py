"""Decode graphs that run the LM head and the greedy argmax (worker/cuda_graphs.py's DecodeHead) on CUDA.

A tiny random Llama: greedy tokens equal an eager run's and those of the path without the head (the LM head
run eagerly over the selected rows, DECODE_HEAD_MAX_BYTES = 0); all-greedy decode steps take the graph's
argmax (no eager LM head, no sampler call); mixed batches of greedy and sampled requests, and requests with
logprobs, give what they give without the head; in bf16 the argmax over the head's own dtype picks what the
sampler's fp32 argmax picks, ties included; a byte cap leaves the larger graphs without the head. Token ids
only: the GPU machine has no tokenizer files."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE, random_prompts

from pressroom import LLM, SamplingParams
from pressroom.worker import cuda_graphs, model_runner
from pressroom.worker.sampler import greedy_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

SHAPE = dict(TINY_SHAPE, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1)
VOCAB = SHAPE["vocab_size"]
MAX_SEQS = 64  # decode graphs of 1, 2, 4, 8, 16, ..., 56, 64 requests
NEW = 40


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    import transformers
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE), dtype=torch.float32)
    out = str(tmp_path_factory.mktemp("head"))
    model.save_pretrained(out)
    return out


def _llm(path: str, monkeypatch, head_bytes: int | None = None, **kwargs) -> LLM:
    """An engine whose decode graphs keep up to `head_bytes` of logits (None: the default; 0: no head)."""
    # one step prefills every prompt below, so the decode steps that follow are the same in every engine
    kwargs = {"dtype": "float32", "kv_cache_memory_gib": 0.25, "max_num_seqs": MAX_SEQS,
              "max_num_batched_tokens": 16384, **kwargs}
    with monkeypatch.context() as m:
        if head_bytes is not None:
            m.setattr(cuda_graphs, "DECODE_HEAD_MAX_BYTES", head_bytes)
        return LLM(path, device="cuda", skip_tokenizer_init=True, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


class _Calls:
    """Counts, while installed, the eager LM head's calls and the device sampler's (both pass through)."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.model, self.heads, self.samples = llm.engine.runner.model, 0, 0
        head, sample = self.model.compute_logits, model_runner.sample_on_device

        def counting_head(hidden):
            self.heads += 1
            return head(hidden)

        def counting_sample(*args):
            self.samples += 1
            return sample(*args)

        self.model.compute_logits = counting_head
        monkeypatch.setattr(model_runner, "sample_on_device", counting_sample)

    def remove(self) -> None:
        del self.model.compute_logits  # the spy's reference cycle would hold the engine's memory


def _record_replays(graphs) -> list[tuple]:
    """(key, tokens) of each replay, the replay itself unchanged."""
    seen, replay = [], graphs.replay

    def recording(key, input_ids, *args):
        seen.append((key, input_ids.shape[0]))
        return replay(key, input_ids, *args)

    graphs.replay = recording
    return seen


def test_greedy_equals_eager_and_the_path_without_the_head(path, monkeypatch):
    prompts = random_prompts(37, low=4, high=200, seed=3)  # 37 decodes pad to the graph of 40
    eager = _tokens(_generate(_llm(path, monkeypatch, enforce_eager=True), prompts, _greedy()))

    llm = _llm(path, monkeypatch)
    graphs = llm.engine.runner.graphs
    assert graphs.head_rows == MAX_SEQS and graphs.logits.shape == (MAX_SEQS, VOCAB)
    assert sorted(graphs.argmax) == [(1, s) for s in graphs.shapes[1]]
    calls, replays = _Calls(llm, monkeypatch), _record_replays(graphs)
    with_head = _tokens(_generate(llm, prompts, _greedy()))
    assert with_head == eager
    assert len(replays) >= NEW - 2  # the decode steps replayed graphs ...
    assert calls.heads <= 2 and calls.samples <= 2  # ... and took their argmax: only prefill steps ran the head
    # the graph's argmax is the sampler's greedy choice over the fp32 logits of the same replay
    (key, t) = replays[-1]
    assert torch.equal(graphs.argmax[key][:t], greedy_tokens(graphs.logits[:t].float()))
    calls.remove()
    del graphs.replay, graphs
    llm.shutdown()

    llm = _llm(path, monkeypatch, head_bytes=0)
    assert llm.engine.runner.graphs.logits is None and not llm.engine.runner.graphs.argmax
    calls = _Calls(llm, monkeypatch)
    assert _tokens(_generate(llm, prompts, _greedy())) == eager
    assert calls.heads >= NEW - 2  # today's path: the LM head eagerly at every decode step
    calls.remove()
    llm.shutdown()


def _mixed(n: int) -> list[SamplingParams]:
    """Greedy and unseeded sampled requests (the device sampler's one noise draw), the sampled ones shorter:
    the last steps are all greedy again."""
    return [_greedy() if i % 2 else SamplingParams(temperature=0.9, top_p=0.95, max_tokens=NEW // 2,
                                                   ignore_eos=True, detokenize=False) for i in range(n)]


def _reporting(n: int) -> list[SamplingParams]:
    """Steps sampled on the host: greedy with logprobs, plain greedy, seeded sampled with logprobs."""
    kinds = [dict(temperature=0, logprobs=3), dict(temperature=0), dict(temperature=0.8, seed=7, logprobs=2)]
    return [SamplingParams(max_tokens=NEW, ignore_eos=True, detokenize=False, **kinds[i % 3]) for i in range(n)]


def _logprobs(outs) -> list[list[dict]]:
    return [o.outputs[0].logprobs or [] for o in outs]


def test_mixed_batches_and_logprobs_give_what_they_give_without_the_head(path, monkeypatch):
    prompts = random_prompts(21, low=4, high=120, seed=5)
    results = {}
    for head_bytes in (None, 0):
        llm = _llm(path, monkeypatch, head_bytes=head_bytes)
        assert (llm.engine.runner.graphs.logits is not None) == (head_bytes is None)
        calls = _Calls(llm, monkeypatch)
        mixed = _generate(llm, prompts, _mixed(len(prompts)))
        mixed_heads = calls.heads
        reporting = _generate(llm, prompts, _reporting(len(prompts)))
        results[head_bytes] = (_tokens(mixed), _tokens(reporting), _logprobs(reporting), mixed_heads)
        calls.remove()
        llm.shutdown()
    (mixed, reporting, lps, heads), (mixed0, reporting0, lps0, heads0) = results[None], results[0]
    assert heads <= 2 < NEW - 2 <= heads0  # with the head, decode steps reuse the graph's logits
    assert mixed == mixed0
    assert reporting == reporting0
    for seq, seq0 in zip(lps, lps0):
        assert len(seq) == len(seq0)
        for pos, pos0 in zip(seq, seq0):
            assert pos.keys() == pos0.keys()  # the same top tokens
            for tok in pos:
                assert pos[tok].rank == pos0[tok].rank
                assert pos[tok].logprob == pytest.approx(pos0[tok].logprob, abs=1e-4)


def test_bf16_argmax_in_the_graph_is_the_fp32_argmax(path, monkeypatch):
    """40 requests fill the graph of 40, so the head's GEMM has the same rows on both paths: the tokens are
    bit-identical, though the graph takes the argmax over bf16 and today's path over its fp32 copy."""
    ties = (torch.randn(64, VOCAB, device="cuda") * 3).to(torch.bfloat16)  # bf16: many exact ties
    ties[5, 10] = ties[5, 900] = ties[5].max() + 1
    assert torch.equal(ties.argmax(dim=-1), greedy_tokens(ties.float())) and int(ties[5].argmax()) == 10
    prompts = random_prompts(40, low=4, high=100, seed=8)
    runs = []
    for head_bytes in (None, 0):
        llm = _llm(path, monkeypatch, head_bytes=head_bytes, dtype="bfloat16")
        graphs = llm.engine.runner.graphs
        assert (graphs.logits is not None) == (head_bytes is None)
        replays = _record_replays(graphs)
        runs.append(_tokens(_generate(llm, prompts, _greedy())))
        assert {key for key, _ in replays} == {(1, 40)}
        if head_bytes is None:  # the last replay's argmax, over bf16, against the sampler's over fp32
            assert graphs.logits.dtype == torch.bfloat16
            assert torch.equal(graphs.argmax[1, 40], greedy_tokens(graphs.logits[:40].float()))
        del graphs.replay, graphs
        llm.shutdown()
    assert runs[0] == runs[1]


def test_a_byte_cap_leaves_larger_graphs_without_the_head(path, monkeypatch):
    """Graphs of up to 16 requests run the head, larger ones return hidden states only; a batch that shrinks
    from 37 requests crosses from one to the other with the same tokens as an eager run."""
    prompts = random_prompts(37, low=4, high=200, seed=12)
    params = [_greedy(8 + i) for i in range(len(prompts))]
    eager = _tokens(_generate(_llm(path, monkeypatch, enforce_eager=True), prompts, params))
    llm = _llm(path, monkeypatch, head_bytes=16 * VOCAB * 4 + 100)
    graphs = llm.engine.runner.graphs
    assert graphs.head_rows == 16 and graphs.logits.shape == (16, VOCAB)
    assert sorted(graphs.argmax) == [(1, s) for s in graphs.shapes[1] if s <= 16]
    replays = _record_replays(graphs)
    assert _tokens(_generate(llm, prompts, params)) == eager
    sizes = {key[1] for key, _ in replays}
    assert min(sizes) <= 16 < max(sizes)  # both kinds of graph replayed
    del graphs.replay, graphs
    llm.shutdown()
