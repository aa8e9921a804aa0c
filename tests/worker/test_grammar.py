"""Grammar masks in the runner (worker/grammar.py) with real xgrammar grammars on SmolLM2's tokenizer: a draft
the grammar forbids is rejected by verification (greedy and sampled, on the host and batched on the device),
never emitted; a finished grammar allows only EOS; filling a request's draft rows leaves its matcher as it was."""
from __future__ import annotations

import pytest
import torch

from pressroom.core.structured_outputs import GrammarCompiler
from pressroom.sampling_params import SamplingParams, StructuredOutputsParams
from pressroom.worker.grammar import RequestGrammar, constrain
from pressroom.worker.rejection_sampler import verify, verify_on_device
from pressroom.worker.sampler import SamplingRow

VOCAB, EOS = 49152, 2
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer):
    grammars = GrammarCompiler(lambda: smollm_tokenizer, VOCAB, EOS)
    yield grammars
    grammars.shutdown()


def _grammar(compiler, **kind) -> RequestGrammar:
    return RequestGrammar.start(compiler.compile(StructuredOutputsParams(**kind)).result(), EOS, len(PROMPT))


def _allowed(compiler, tokens: list[int]) -> bool:
    """Whether a fresh matcher accepts every token in turn."""
    m = _grammar(compiler, regex=r"[0-9]{4}").matcher
    return all(m.accept_token(t) for t in tokens)


def _logits_preferring(drafts: list[int], gen: torch.Generator) -> torch.Tensor:
    """[k + 1, vocab]: each draft is its row's clear favourite (the last row's favourite: token 0)."""
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=gen)
    for j, d in enumerate(drafts):
        logits[j, d] = 30.0
    return logits


def test_forbidden_drafts_are_rejected_never_emitted(compiler, smollm_tokenizer):
    four_digits = smollm_tokenizer.encode("1234")
    letters = smollm_tokenizer.encode("ab")  # the grammar forbids them
    drafts = four_digits[:1] + letters + four_digits[1:2]  # one allowed draft, then forbidden ones
    gen = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        rows = [SamplingRow(params, PROMPT, [], EOS)] * (len(drafts) + 1)
        for trial in range(20):
            grammar = _grammar(compiler, regex=r"[0-9]{4}")
            logits = _logits_preferring(drafts, gen)
            constrain(logits, [(grammar, PROMPT, drafts)])
            tokens = verify(logits, rows, drafts, None, torch.Generator().manual_seed(trial))
            assert tokens[0] == drafts[0] and len(tokens) == 2, tokens  # the allowed draft, then a correction
            assert _allowed(compiler, tokens)


def test_forbidden_drafts_are_rejected_on_the_device_too(compiler, smollm_tokenizer):
    """A batch: a constrained row whose second draft is forbidden beside an unconstrained row with the same
    logits, whose drafts are all accepted."""
    digits, letters = smollm_tokenizer.encode("12"), smollm_tokenizer.encode("ab")
    drafts = [digits[0], letters[0], digits[-1]]
    gen = torch.Generator().manual_seed(1)
    row_logits = _logits_preferring(drafts, gen)
    logits = torch.cat([row_logits, row_logits])
    grammar = _grammar(compiler, regex=r"[0-9]{4}")
    constrain(logits, [(grammar, PROMPT, drafts), (None, PROMPT, drafts)])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    tokens, counts = verify_on_device(logits, params, [3, 3], torch.tensor([drafts, drafts]), None, gen)
    assert counts.tolist() == [2, 4]
    assert tokens[0, 0] == drafts[0] and _allowed(compiler, tokens[0, :2].tolist())


def test_filling_draft_rows_leaves_the_matcher_as_it_was(compiler, smollm_tokenizer):
    grammar = _grammar(compiler, choice=["yes", "no"])
    drafts = smollm_tokenizer.encode("yes")
    once, again = torch.zeros(1 + len(drafts), VOCAB), torch.zeros(1 + len(drafts), VOCAB)
    constrain(once, [(grammar, PROMPT, drafts)])
    constrain(again, [(grammar, PROMPT, drafts)])
    assert torch.equal(once, again)
    assert grammar.matcher.accept_token(smollm_tokenizer.encode("no")[0])  # still at the start


def test_a_finished_grammar_allows_only_eos(compiler, smollm_tokenizer):
    grammar = _grammar(compiler, choice=["yes"])
    answer = smollm_tokenizer.encode("yes")
    logits = torch.zeros(1, VOCAB)
    constrain(logits, [(grammar, PROMPT + answer, ())])  # complete: EOS is the grammar's stop token
    assert (logits[0] > -1e30).nonzero().flatten().tolist() == [EOS]
    logits = torch.zeros(1, VOCAB)
    constrain(logits, [(grammar, PROMPT + answer + [EOS], ())])  # terminated (ignore_eos runs on): EOS again
    assert (logits[0] > -1e30).nonzero().flatten().tolist() == [EOS]
