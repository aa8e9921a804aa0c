"""Admission by cost (docs/LIMITS.md): what one request may ask of the server, and the judge of it.

A request is measured (`RequestCost`: protocol.py's `cost()` reads its body, `tokens_cost()` its prompts once
tokenized) and `judge` refuses the first limit it is over, naming the field and the `pressroom serve` flag that
raises the limit. The defaults are far past what clients send and short of what would stall the engine's step or
the API process for everyone else. Most count a cost times n: each of a request's n samples repeats it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from pressroom.core.structured_outputs import GRAMMAR_COMPILE_MAX_BYTES, GRAMMAR_COMPILE_TIMEOUT_S, MAX_SOURCE_CHARS


def _limit(default: int, what: str, note: str = "") -> Any:
    """A limit: its default, what it counts (said in its 400), and a note its flag's help adds."""
    return field(default=default, metadata={"what": what, "help": f"{what}; {note}" if note else what})


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionLimits:
    """Every admission limit and its default, each one a `pressroom serve` flag (`flag(name)`)."""
    max_n: int = _limit(128, "samples per request", "OpenAI's bound")
    # A request's stop strings become one automaton (some 220 bytes and 1.2 us to build per character), and each
    # sample carries its own copy of them to the engine core.
    max_stop_strings: int = _limit(1_000, "stop strings per request")
    max_stop_chars: int = _limit(20_000, "characters of a request's stop strings, summed")
    max_stop_chars_x_n: int = _limit(200_000, "characters of a request's stop strings, summed, times n")
    # Each sample's bias is sent to the core and added at every step.
    max_logit_bias_x_n: int = _limit(300_000, "logit_bias entries times n")
    # Each prompt (completions' prompt list, embeddings' inputs, the texts of /score and /rerank) is an engine
    # request: OpenAI's bound on embeddings inputs.
    max_prompts_per_request: int = _limit(2_048, "prompts, inputs or texts per request")
    # Each sequence (prompt x sample) is an engine request with its own detokenizer and output stream.
    max_sequences_per_request: int = _limit(1_024, "prompts times n per request")
    # 2^22 tokens: a whole 32k context at n=128, or 2,048 inputs of 2k tokens. Each sample carries its own copy
    # of the prompt's token ids to the engine core (about 36 bytes a token once there: 150 MB at the limit).
    max_prompt_tokens_x_n: int = _limit(1 << 22, "prompt tokens, summed over the prompts, times n")
    # The same budget for what may be generated: max_tokens (else what is left of the context) of every prompt,
    # times n; each token is sampled, detokenized and stop-checked per sample.
    max_output_tokens_x_n: int = _limit(1 << 22, "output tokens, summed over the prompts, times n",
                                        "a prompt's output tokens are its max_tokens, else the rest of the context")
    # The grammar source xgrammar parses (a schema's JSON text, the regex, the EBNF, the choices as one); its
    # nesting, width and repetitions are limited in core/structured_outputs.py, and its parse and compile run in
    # the grammar sandbox's worker processes under the two caps below (over either, the worker is replaced).
    max_grammar_chars: int = _limit(MAX_SOURCE_CHARS, "characters of a structured output's grammar")
    max_grammar_compile_seconds: int = _limit(int(GRAMMAR_COMPILE_TIMEOUT_S),
                                              "seconds a grammar's parse and compile may take")
    max_grammar_compile_mib: int = _limit(GRAMMAR_COMPILE_MAX_BYTES >> 20,
                                          "MiB a grammar's parse and compile may map, past its worker's start")

    def __post_init__(self) -> None:
        for f in fields(self):
            if type(getattr(self, f.name)) is not int or getattr(self, f.name) < 1:
                raise ValueError(f"{flag(f.name)} must be a positive integer, got {getattr(self, f.name)!r}.")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdmissionLimits:
        """From `pressroom serve`'s flags (`add_limit_args`)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def flag(name: str) -> str:
    """The `pressroom serve` flag of the limit `name`."""
    return "--" + name.replace("_", "-")


def add_limit_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag per limit, its default and help read from AdmissionLimits."""
    for f in fields(AdmissionLimits):
        parser.add_argument(flag(f.name), type=int, default=f.default, metavar="N", help=f.metadata["help"])


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestCost:
    """What one request asks for; a `*_param` is the request field to name when that part is over its limit. The
    tokens are known once the prompts are tokenized (None before)."""
    n: int = 1
    prompts: int = 1
    prompts_param: str = "prompt"
    generates: bool = True  # False: pooling, whose prompts are prefilled only (no sequences to decode)
    stop_strings: int = 0
    stop_chars: int = 0
    logit_bias_entries: int = 0
    grammar_chars: int = 0
    grammar_param: str = "structured_outputs"
    prompt_tokens: int | None = None  # summed over the prompts
    output_tokens: int | None = None  # max_tokens (else the rest of the context), summed over the prompts
    output_param: str = "max_tokens"


class OverLimit(ValueError):
    """A request over an admission limit; `param`: the request field that makes it so (the server's 400 names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def judge(cost: RequestCost, limits: AdmissionLimits) -> None:
    """Raises OverLimit for the first limit `cost` is over (the message names it, its value and its flag)."""
    n = cost.n
    _at_most(limits, "max_n", n, "n", f"n={n}")
    _at_most(limits, "max_prompts_per_request", cost.prompts, cost.prompts_param, f"{cost.prompts} prompts")
    if cost.generates:
        _at_most(limits, "max_sequences_per_request", cost.prompts * n,
                 "n" if cost.prompts == 1 else cost.prompts_param,
                 f"{cost.prompts} prompts x n={n} = {cost.prompts * n} sequences")
    _at_most(limits, "max_stop_strings", cost.stop_strings, "stop", f"{cost.stop_strings} stop strings")
    _at_most(limits, "max_stop_chars", cost.stop_chars, "stop", f"the stop strings' {cost.stop_chars} characters")
    _at_most(limits, "max_stop_chars_x_n", cost.stop_chars * n, "stop",
             f"the stop strings' {cost.stop_chars} characters x n={n} = {cost.stop_chars * n}")
    _at_most(limits, "max_logit_bias_x_n", cost.logit_bias_entries * n, "logit_bias",
             f"{cost.logit_bias_entries} logit_bias entries x n={n} = {cost.logit_bias_entries * n}")
    _at_most(limits, "max_grammar_chars", cost.grammar_chars, cost.grammar_param,
             f"the structured output's grammar of {cost.grammar_chars} characters")
    if cost.prompt_tokens is not None:
        _at_most(limits, "max_prompt_tokens_x_n", cost.prompt_tokens * n, cost.prompts_param,
                 f"{cost.prompt_tokens} prompt tokens x n={n} = {cost.prompt_tokens * n}")
    if cost.output_tokens is not None:
        _at_most(limits, "max_output_tokens_x_n", cost.output_tokens * n, cost.output_param,
                 f"{cost.output_tokens} output tokens ({cost.output_param} over {cost.prompts} prompt"
                 f"{'s' if cost.prompts != 1 else ''}) x n={n} = {cost.output_tokens * n}")


def _at_most(limits: AdmissionLimits, name: str, value: int, param: str, measure: str) -> None:
    limit = getattr(limits, name)
    if value > limit:
        what = AdmissionLimits.__dataclass_fields__[name].metadata["what"]
        raise OverLimit(f"{measure}: over the limit of {limit} ({what}); the server's {flag(name)} raises it.", param)
