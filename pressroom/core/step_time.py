"""The step-time bound: while decodes run, a step's prompt tokens are limited so that its estimated time on the
device stays within `SchedulerConfig.step_time_factor` times that of the step its decodes alone would make.

Why: a step is one forward pass, and every running stream waits for it. A step of decodes alone is memory-bound (its
time is the weights' and the KV cache's reads); a prompt chunk is compute-bound (its time grows with its tokens). A
16k-token wave of new prompts in one step took ~400 ms on an H200 against a 23.5 ms median inter-token latency
(docs/BENCHMARKS.md, issue 44): every running stream stalled for it. The token budget (max_num_batched_tokens,
counted as cost with prefill_cost_context) bounds a step's tokens, not its time beside decodes; this bounds the time.

The rule, one step at a time (`StepTimeBound`):
- no decodes running: no limit (a lone wave of prompts gets the whole token budget, as before; a wave larger than
  the budget is bounded from its second step on, where its first prompts decode);
- decodes running: the step's estimate with every prompt chunk added stays within factor x the decodes' own
  estimate; a chunk that would pass it is cut to the most tokens that fit;
- but a step always gets at least `StepTimeModel.floor_tokens` prompt tokens (where prompts wait), so prompts
  progress in every step whatever the decodes: the engine's model sets it where a step of the model's matmuls turns
  compute-bound on the device, the tokens that ride along with the weight reads a step pays anyway.

The estimates come from a `StepTimeModel` the engine gives the scheduler (engine/step_cost.py's `StepTimer`: the
model's FLOPs and bytes from its shape, over the share of the device's data sheet an engine reaches, then over what
`StepTimeFit` learns from the engine's own step times); the scheduler only sums each request's share of a step into a
`StepLoad`, which is what such an estimate reads of a step.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class StepLoad:
    """A step's requests summed as its cost estimate reads them. A request's share: n new tokens after c computed
    ones, of which s rows are sampled (go through the LM head); its new tokens attend over its context at the
    step's end, c + n (vLLM's count)."""
    tokens: int = 0  # new tokens (query rows) of every request
    sampled: int = 0  # rows through the LM head
    attended: int = 0  # query-context pairs, sum of n (c + n): attention's FLOPs
    context: int = 0  # KV-cache tokens read, sum of (c + n)

    @classmethod
    def of(cls, shares: Iterable[tuple[int, int, int]]) -> StepLoad:
        """The load of requests' shares, (new tokens, computed tokens, sampled rows) each."""
        tokens = sampled = attended = context = 0
        for n, computed, rows in shares:
            end = computed + n
            tokens, sampled, attended, context = tokens + n, sampled + rows, attended + n * end, context + end
        return cls(tokens, sampled, attended, context)

    def plus(self, num_tokens: int, num_computed: int, num_sampled: int) -> StepLoad:
        """This load with one more request's share."""
        share = StepLoad.of(((num_tokens, num_computed, num_sampled),))
        return StepLoad(self.tokens + share.tokens, self.sampled + share.sampled, self.attended + share.attended,
                        self.context + share.context)


class StepTimeModel(Protocol):
    """A step's estimated seconds on the device (engine/step_cost.py's StepTimer implements it)."""

    @property
    def floor_tokens(self) -> int:
        """Prompt tokens a step with decodes gets whatever the bound says."""
        ...

    def seconds(self, load: StepLoad) -> float:
        ...


class StepTimeBound:
    """One step's limit, renewed by `begin` at each step: `fit` says how much of a prompt chunk the step still
    holds, `take` books the chunk scheduled."""

    def __init__(self, model: StepTimeModel, factor: float) -> None:
        if factor <= 1:
            raise ValueError(f"step_time_factor must exceed 1 (a step holds its decodes), got {factor}.")
        self.model, self.factor = model, factor
        self.load = StepLoad()
        self.limit: float | None = None  # seconds; None: no decodes, no limit
        self.prompt_tokens = 0  # the step's prompt tokens booked so far

    def begin(self, decodes: Iterable[tuple[int, int]]) -> None:
        """A new step whose decodes are (tokens, computed) each (a token, or one plus its drafts, every one
        sampled): its limit is factor x their estimate (none without decodes)."""
        load = StepLoad.of((tokens, computed, tokens) for tokens, computed in decodes)
        self.load, self.prompt_tokens = load, 0
        self.limit = self.factor * self.model.seconds(load) if load.tokens else None

    @property
    def full(self) -> bool:
        """No prompt token fits any more (the floor taken and the limit reached): admission can stop."""
        return self.fit(1, 0) == 0

    def fit(self, n: int, computed: int) -> int:
        """The most of a prompt chunk of n tokens after `computed` ones that the step holds: all of it without a
        limit; else the most within the limit, and at least what is left of the floor."""
        if self.limit is None or n <= 0:
            return n
        floor = min(n, max(0, self.model.floor_tokens - self.prompt_tokens))
        if self._within(n, computed):
            return n
        lo, hi = 0, n  # _within(lo) holds (or lo == 0), _within(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._within(mid, computed):
                lo = mid
            else:
                hi = mid
        return max(lo, floor)

    def take(self, n: int, computed: int) -> None:
        """Books a prompt chunk of n tokens after `computed` ones (its last row sampled, as a chunk's is)."""
        if n > 0:
            self.load = self.load.plus(n, computed, 1)
            self.prompt_tokens += n

    def _within(self, n: int, computed: int) -> bool:
        return self.model.seconds(self.load.plus(n, computed, 1)) <= self.limit


# The fit's prior: worth this many steps of each term (the rates an engine reaches: 1 s of estimate is 1 s of step,
# no fixed cost), forgotten at this rate per step (a card's rates hold; a workload's mix drifts), used from this many
# steps on; a fitted coefficient never below this (a noisy fit must not call the card 10x faster than that).
FIT_PRIOR_STEPS = 4.0
FIT_DECAY = 0.995
FIT_MIN_STEPS = 16
FIT_MIN_RATE = 0.1
FIT_OUTLIER = 10.0  # a step this many times its estimate is left out of the fit


class StepTimeFit:
    """Measured step times against an estimate's two terms: seconds ~ c + a * memory + b * compute, where memory
    and compute are the step's bytes and FLOPs at the bandwidth and matmul rate an engine reaches (the data sheet's
    times engine/step_cost.py's shares). Weighted least
    squares with exponential forgetting, pulled toward (0, 1, 1) by a prior worth FIT_PRIOR_STEPS steps per term.

    Why: the data sheet's rates are not what an engine reaches, and not in the same proportion: on an H100 a step of
    ~1,000 prompt tokens beside 64 decodes took 4.33x the decode step where the data sheet's estimate said 3x
    (docs/BENCHMARKS.md, 2026-12-07), so the bound held the tail to 4.5x the median, not 3x. The engine's own steps
    say what its kernels reach on its card."""

    def __init__(self) -> None:
        self.gram = np.zeros((3, 3))  # sum of w x x^T over x = (1, memory, compute)
        self.moment = np.zeros(3)  # sum of w x y
        self.steps = 0
        self.coefficients: tuple[float, float, float] | None = None  # (c, a, b) once FIT_MIN_STEPS steps are in

    def observe(self, memory_s: float, compute_s: float, seconds: float) -> None:
        x = np.array([1.0, memory_s, compute_s])
        self.gram = FIT_DECAY * self.gram + np.outer(x, x)
        self.moment = FIT_DECAY * self.moment + x * seconds
        self.steps += 1
        if self.steps >= FIT_MIN_STEPS:
            self.coefficients = self._solve()

    def predict(self, memory_s: float, compute_s: float) -> float | None:
        """The fitted step time; None before the fit has enough steps."""
        if self.coefficients is None:
            return None
        c, a, b = self.coefficients
        return c + a * memory_s + b * compute_s

    def _solve(self) -> tuple[float, float, float]:
        weight = self.gram[0, 0]  # the forgotten count of steps
        scale = np.maximum(np.diag(self.gram) / weight, 1e-30)  # each term's mean square: the prior's units
        ridge = np.diag(FIT_PRIOR_STEPS * scale)
        prior = np.array([0.0, 1.0, 1.0])
        c, a, b = np.linalg.solve(self.gram + ridge, self.moment + ridge @ prior)
        return max(0.0, float(c)), max(FIT_MIN_RATE, float(a)), max(FIT_MIN_RATE, float(b))
