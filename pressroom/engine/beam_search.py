"""Beam search in the front end, as vLLM runs it: each step asks the engine for one token of every live beam with
2 * beam_width logprobs (the beams share their prompt's prefix, which prefix caching serves from the cache), grows
each beam by each candidate, moves the beams that end with EOS to the finished ones and keeps the best beam_width
of the rest. After max_tokens steps the finished and the live beams are ranked by vLLM's length-penalized score.

`BeamSearch` is one prompt's search and knows nothing of the engine; `run` and `run_async` drive several of them,
one engine batch a step, through the step function their caller gives (LLM.beam_search, the server's
/v1/completions with use_beam_search).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pressroom.engine.llm_engine import ERROR, MAX_LOGPROBS
from pressroom.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pressroom.sampling_params import BeamSearchParams, SamplingParams

# (its search's context, token ids) of each live beam -> the engine's candidates after each (None: that beam can go
# no further)
Beams = list[tuple[Any, list[int]]]
Step = Callable[[Beams], list[PositionLogprobs | None]]
AsyncStep = Callable[[Beams], Awaitable[list[PositionLogprobs | None]]]


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` holds the prompt's and the generated ids; `logprobs`, for each generated token,
    the candidates of the step that chose it; `text` is filled in when the beam is returned."""
    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best beams, at most beam_width, best first."""
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float = 1.0) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the length to the power length_penalty, the
    length counting the prompt and not a final EOS (Hugging Face's rule, as vLLM adapted it)."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam asks of the engine each step: one token and its 2 * beam_width best alternatives."""
    return SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                          detokenize=False)


def candidates_of(out: RequestOutput) -> PositionLogprobs | None:
    """A step request's candidates (None where it ended without a token); a RuntimeError if the engine failed."""
    first = out.outputs[0]
    if first.finish_reason == ERROR:
        raise RuntimeError("The engine failed while running a beam-search step; the search was ended.")
    return first.logprobs[0] if first.logprobs else None


class BeamSearch:
    """One prompt's search: its live beams, each asked for one more token a step, and its finished beams.
    `context`: what the caller's step needs to run this prompt's beams (its LoRA adapter, its cache salt)."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int, context: Any = None) -> None:
        if 2 * params.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2}: each step asks for 2 * beam_width "
                             f"logprobs, and the engine returns at most {MAX_LOGPROBS}; got {params.beam_width}.")
        self.params, self.eos_token_id, self.max_model_len = params, eos_token_id, max_model_len
        self.context = context
        self.prompt_ids = list(prompt_ids)
        self.live = [BeamSearchSequence(list(prompt_ids), [])]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def prompts(self) -> Beams:
        """This step's prompts: (the context, the token ids) of each live beam."""
        return [(self.context, beam.tokens) for beam in self.live]

    def advance(self, candidates: list[PositionLogprobs | None]) -> None:
        """One step: `candidates[i]` are the engine's tokens after live beam i."""
        grown = []
        for beam, position in zip(self.live, candidates, strict=True):
            for token, logprob in (position or {}).items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position],
                                           beam.cum_logprob + logprob.logprob)
                if token == self.eos_token_id and not self.params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", token
                    self.finished.append(child)
                else:
                    grown.append(child)
        grown.sort(key=self.score, reverse=True)
        self.live = grown[:self.params.beam_width]
        self.steps += 1
        full = [beam for beam in self.live if len(beam.tokens) >= self.max_model_len]  # no room for another token
        if full:
            self.live = [beam for beam in self.live if len(beam.tokens) < self.max_model_len]
            self.finished += full

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def best(self) -> list[BeamSearchSequence]:
        """The best beam_width beams, finished or not (those cut short by max_tokens finish with "length")."""
        for beam in self.finished + self.live:
            beam.finish_reason = beam.finish_reason or "length"
        return sorted(self.finished + self.live, key=self.score, reverse=True)[:self.params.beam_width]

    def request_output(self, request_id: str, prompt: str | None, decode: Callable[[list[int]], str]
                       ) -> RequestOutput:
        """The best beams as a finished RequestOutput (the server's form, vLLM's): each beam a CompletionOutput of
        its generated tokens, a final EOS dropped from them unless include_stop_str_in_output, and from its text."""
        outputs = []
        for i, beam in enumerate(self.best()):
            generated = beam.tokens[len(self.prompt_ids):]
            visible = generated[:-1] if beam.finish_reason == "stop" else generated
            kept = generated if self.params.include_stop_str_in_output else visible
            outputs.append(CompletionOutput(i, decode(visible), kept, beam.cum_logprob, beam.logprobs[:len(kept)],
                                            beam.finish_reason, beam.stop_reason))
        return RequestOutput(request_id, prompt, self.prompt_ids, outputs, True)


def run(searches: list[BeamSearch], step: Step) -> None:
    """Runs `searches` to their end, the live beams of all of them sent to the engine as one batch a step."""
    while active := [s for s in searches if not s.done]:
        _advance(active, step([p for s in active for p in s.prompts()]))


async def run_async(searches: list[BeamSearch], step: AsyncStep) -> None:
    while active := [s for s in searches if not s.done]:
        _advance(active, await step([p for s in active for p in s.prompts()]))


def _advance(active: list[BeamSearch], candidates: list[PositionLogprobs | None]) -> None:
    at = 0
    for search in active:
        n = len(search.live)
        search.advance(candidates[at:at + n])
        at += n
