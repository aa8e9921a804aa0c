"""Calibrating a drafter's confidences, and measuring how well they are calibrated.

A block drafter states, per draft position, how likely the target is to accept that token given the
ones before it were (a conditional probability). Confidence-scheduled verification trusts these
numbers to decide how many drafts each request verifies, so they must mean what they say: of the
drafts stated at 0.7, about 70% should survive. The drafter's raw softmax numbers rarely do.

`ConfidenceCalibrator` learns the map online, per position, by histogram binning: each (position, bin of
stated confidence) keeps decayed counts of verified drafts and accepted ones, and a confidence is
replaced by its bin's observed rate. A bin with few observations leans on a coarser guess: the stated
value rescaled by the position's overall observed-to-stated ratio. `ReliabilityTable` bins predictions
against outcomes (a reliability diagram) and gives the expected calibration error (ECE): the mean gap
between predicted and observed rates, weighted by how many predictions fell in each bin.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NUM_BINS = 10
_BIN_PRIOR = 8.0  # a bin's own rate counts as much as the position-level guess after this many drafts
_RATIO_PRIOR = 4.0  # the position-level ratio starts at 1 (trust the drafter), worth this many drafts


def bin_of(p: float, num_bins: int = NUM_BINS) -> int:
    return min(num_bins - 1, max(0, int(p * num_bins)))


@dataclass(slots=True)
class ReliabilityTable:
    """Predicted probabilities against outcomes, in equal-width bins over [0, 1]."""
    num_bins: int = NUM_BINS
    count: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)  # sum of the predictions in each bin
    observed: list[int] = field(default_factory=list)  # outcomes that happened, per bin

    def __post_init__(self) -> None:
        self.count = self.count or [0] * self.num_bins
        self.predicted = self.predicted or [0.0] * self.num_bins
        self.observed = self.observed or [0] * self.num_bins

    def add(self, p: float, happened: bool) -> None:
        b = bin_of(p, self.num_bins)
        self.count[b] += 1
        self.predicted[b] += p
        self.observed[b] += int(happened)

    @property
    def total(self) -> int:
        return sum(self.count)

    @property
    def ece(self) -> float | None:
        """Expected calibration error: sum over bins of (share of predictions) x |mean predicted - observed rate|."""
        total = self.total
        if not total:
            return None
        return sum(abs(p - o) for p, o, n in zip(self.predicted, self.observed, self.count) if n) / total

    def rows(self) -> list[dict]:
        """The non-empty bins: range, predictions, mean prediction and observed rate."""
        width = 1.0 / self.num_bins
        return [{"bin": [round(b * width, 3), round((b + 1) * width, 3)], "n": n,
                 "predicted": round(self.predicted[b] / n, 4), "observed": round(self.observed[b] / n, 4)}
                for b, n in enumerate(self.count) if n]

    def since(self, before: ReliabilityTable) -> ReliabilityTable:
        """What was added after `before` (an earlier copy of this table)."""
        return ReliabilityTable(self.num_bins, [a - b for a, b in zip(self.count, before.count)],
                                [a - b for a, b in zip(self.predicted, before.predicted)],
                                [a - b for a, b in zip(self.observed, before.observed)])

    @classmethod
    def merged(cls, tables: list[ReliabilityTable]) -> ReliabilityTable:
        """Several engines' tables as one."""
        out = cls(tables[0].num_bins)
        for t in tables:
            out.count = [a + b for a, b in zip(out.count, t.count)]
            out.predicted = [a + b for a, b in zip(out.predicted, t.predicted)]
            out.observed = [a + b for a, b in zip(out.observed, t.observed)]
        return out

    def copy(self) -> ReliabilityTable:
        return ReliabilityTable(self.num_bins, list(self.count), list(self.predicted), list(self.observed))

    def report(self) -> dict:
        ece = self.ece
        return {"ece": None if ece is None else round(ece, 4), "n": self.total, "bins": self.rows()}


@dataclass(slots=True)
class _PositionBins:
    """One draft position's decayed counts: per bin of stated confidence, drafts verified and accepted;
    overall, the stated confidences summed beside the acceptances."""
    trials: list[float]
    hits: list[float]
    stated_sum: float = 0.0
    hit_sum: float = 0.0

    def ratio(self) -> float:
        """Observed over stated, over every verified draft at this position (1 before any)."""
        return (self.hit_sum + _RATIO_PRIOR) / (self.stated_sum + _RATIO_PRIOR)

    def rate(self, p: float) -> float:
        b = bin_of(p, len(self.trials))
        guess = min(1.0, p * self.ratio())
        return (self.hits[b] + _BIN_PRIOR * guess) / (self.trials[b] + _BIN_PRIOR)


class ConfidenceCalibrator:
    """Per-position histogram binning of a drafter's stated conditional confidences, learned online from
    verification outcomes and decayed (the drafter's reliability moves with the traffic)."""

    def __init__(self, max_drafts: int, num_bins: int = NUM_BINS) -> None:
        self.positions = [_PositionBins([0.0] * num_bins, [0.0] * num_bins) for _ in range(max_drafts)]

    def calibrated(self, confidences: list[float]) -> list[float]:
        return [pos.rate(c) for pos, c in zip(self.positions, confidences)]

    def observe(self, confidences: list[float], num_draft: int, num_accepted: int) -> None:
        """Positions 1..accepted were accepted, the next (if drafted) rejected; later ones were not verified
        on their own (their condition failed), so they say nothing about their confidence."""
        for j in range(min(num_accepted + 1, num_draft, len(confidences), len(self.positions))):
            pos, c, hit = self.positions[j], confidences[j], float(j < num_accepted)
            b = bin_of(c, len(pos.trials))
            pos.trials[b] += 1.0
            pos.hits[b] += hit
            pos.stated_sum += c
            pos.hit_sum += hit

    def decay(self, factor: float) -> None:
        for pos in self.positions:
            pos.trials[:] = [t * factor for t in pos.trials]
            pos.hits[:] = [h * factor for h in pos.hits]
            pos.stated_sum *= factor
            pos.hit_sum *= factor
