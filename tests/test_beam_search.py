"""Beam search (vLLM's, in the front end): the search against an exhaustive oracle on a small synthetic model, and
LLM.beam_search against Hugging Face transformers' own beam search on the same weights."""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from pressroom import LLM, BeamSearchParams, SamplingParams
from pressroom.engine import beam_search
from pressroom.engine.beam_search import BeamSearch, beam_search_score
from pressroom.outputs import Logprob

VOCAB, EOS, PROMPT = 4, 2, [1, 3]


def _logprobs(prefix: tuple[int, ...]) -> list[float]:
    """A synthetic model: fixed pseudo-random next-token logprobs for each prefix."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(prefix).encode()))
    return torch.log_softmax(3 * torch.randn(VOCAB, generator=gen, dtype=torch.float64), 0).tolist()


def _step(beams: beam_search.Beams) -> list:
    """The engine's answer for each beam: every token of the small vocabulary, ranked."""
    out = []
    for _, tokens in beams:
        lps = _logprobs(tuple(tokens))
        order = sorted(range(VOCAB), key=lambda t: -lps[t])
        out.append({t: Logprob(lps[t], rank + 1) for rank, t in enumerate(order)})
    return out


def _exhaustive(max_tokens: int, length_penalty: float) -> list[tuple[list[int], float]]:
    """Every sequence the search can return (one that ends with EOS, at any length, or any of max_tokens tokens),
    ranked by vLLM's length-penalized score."""
    found = []
    for n in range(1, max_tokens + 1):
        for tail in itertools.product(range(VOCAB), repeat=n):
            if EOS in tail[:-1] or (n < max_tokens and tail[-1] != EOS):
                continue
            tokens = PROMPT + list(tail)
            cum = sum(_logprobs(tuple(tokens[:i]))[tokens[i]] for i in range(len(PROMPT), len(tokens)))
            found.append((tokens, cum))
    return sorted(found, key=lambda f: beam_search_score(f[0], f[1], EOS, length_penalty), reverse=True)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_a_beam_as_wide_as_every_prefix_finds_the_best_sequences(length_penalty):
    """Beam width 9 keeps all 9 prefixes of two non-EOS tokens, so the search is exhaustive at 3 tokens: its beams
    are the 9 best of all sequences by the length-penalized score (EOS-ended ones of 1-3 tokens among them)."""
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=9, max_tokens=3, length_penalty=length_penalty),
                        EOS, max_model_len=64)
    beam_search.run([search], _step)
    best = search.best()
    expected = _exhaustive(3, length_penalty)[:9]
    assert [b.tokens for b in best] == [tokens for tokens, _ in expected]
    assert [b.cum_logprob for b in best] == pytest.approx([cum for _, cum in expected])
    assert {b.finish_reason for b in best} == {"stop", "length"}  # both kinds compete on the one score
    assert all((b.finish_reason == "stop") == (b.tokens[-1] == EOS) for b in best)


def test_score_is_vllms_length_penalized_cumulative_logprob():
    assert beam_search_score([5, 6, 7], -3.0, EOS, 1.0) == pytest.approx(-1.0)
    assert beam_search_score([5, 6, 7, EOS], -3.0, EOS, 1.0) == pytest.approx(-1.0)  # a final EOS is not counted
    assert beam_search_score([5, 6, 7, 8], -4.0, EOS, 0.5) == pytest.approx(-2.0)
    assert beam_search_score([5, 6], -4.0, EOS, 0.0) == pytest.approx(-4.0)


def test_server_form_drops_the_final_eos_unless_asked():
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    search = BeamSearch(PROMPT, params, EOS, max_model_len=64)
    beam_search.run([search], _step)
    out = search.request_output("r", None, lambda ids: ",".join(map(str, ids)))
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert out.prompt_token_ids == PROMPT and stopped and len(out.outputs) == 2
    for c in stopped:
        assert EOS not in c.token_ids and c.text == ",".join(map(str, c.token_ids)) and c.stop_reason == EOS
        assert len(c.logprobs) == len(c.token_ids)
    kept = BeamSearch(PROMPT, BeamSearchParams(2, 3, include_stop_str_in_output=True), EOS, max_model_len=64)
    beam_search.run([kept], _step)
    assert [c.token_ids[-1] for c in kept.request_output("r", None, str).outputs if c.finish_reason == "stop"] == \
        [EOS] * len(stopped)


def test_a_beam_at_the_context_limit_finishes():
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True), EOS,
                        max_model_len=len(PROMPT) + 2)
    beam_search.run([search], _step)
    assert search.steps == 2 and all(len(b.tokens) == len(PROMPT) + 2 for b in search.best())


@pytest.mark.parametrize("fields, match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), "length_penalty"),
])
def test_bad_params_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**fields)


def test_best_of_is_not_a_sampling_parameter():
    """vLLM 0.32 dropped best_of from SamplingParams (V1): passing it is a TypeError there and here."""
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(n=1, best_of=2)


# ---- the engine, against HF transformers ----

@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    import transformers
    path = tiny_model_dir("llama")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None  # HF's beams never end: ignore_eos on ours
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    yield llm, hf_model
    llm.shutdown()


@torch.inference_mode()
def _hf_logprob_sum(model, prompt: list[int], generated: list[int]) -> float:
    logits = model(input_ids=torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(generated)[:, None]).sum())


PROMPTS = [[1, 4093, 314, 253, 1345], [1, 20, 903, 77, 5012, 8, 42]]


def test_llm_beam_search_equals_hf_beam_search(tiny_pair):
    llm, hf_model = tiny_pair
    width, steps = 4, 5
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                               max_new_tokens=steps, early_stopping=False, pad_token_id=0)
        theirs = [row[len(prompt):].tolist() for row in hf]
        assert [seq.tokens[len(prompt):] for seq in out.sequences] == theirs
        assert all(seq.tokens[:len(prompt)] == prompt for seq in out.sequences)
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            [_hf_logprob_sum(hf_model, prompt, t) for t in theirs], abs=1e-3)
        assert out.sequences[0].text == llm.get_tokenizer().decode(out.sequences[0].tokens)


def test_beam_width_one_is_greedy(tiny_pair):
    llm, _ = tiny_pair
    prompt = {"prompt_token_ids": PROMPTS[0]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    beam = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    assert beam[0].sequences[0].tokens[len(PROMPTS[0]):] == greedy[0].outputs[0].token_ids


def test_beam_width_past_the_engines_logprobs_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        tiny_pair[0].beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))


def _hf_step(model, width: int):
    """A step function whose candidates are HF's: each beam's 2 * width best tokens by HF's logprobs."""
    @torch.inference_mode()
    def step(beams: beam_search.Beams) -> list:
        out = []
        for _, tokens in beams:
            lps = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1], -1)
            values, ids = lps.topk(2 * width)
            out.append({int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(values, ids))})
        return out
    return step


def test_beams_that_end_with_eos_finish_as_with_hfs_candidates(tiny_pair, monkeypatch):
    """EOS set to a token the beams meet (the third best after the prompt): those beams finish there, and the
    search's beams equal a search run on HF's candidates."""
    llm, hf_model = tiny_pair
    prompt = PROMPTS[1]
    eos = list(_hf_step(hf_model, 2)([(None, prompt)])[0])[2]
    monkeypatch.setattr(llm.engine, "eos_token_id", eos)
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0)  # no length penalty: short wins
    ours = llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences
    oracle = BeamSearch(prompt, params, eos, max_model_len=2048)
    beam_search.run([oracle], _hf_step(hf_model, 2))
    theirs = oracle.best()
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    assert [s.cum_logprob for s in ours] == pytest.approx([s.cum_logprob for s in theirs], abs=1e-3)
    assert any(s.finish_reason == "stop" and s.tokens[-1] == eos for s in ours)
