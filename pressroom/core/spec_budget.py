"""Adaptive speculative token budget: how many drafts each request verifies this step.

Verifying a draft costs a token of the step (more time once the step is compute-bound) and pays
off only if it survives. With per-position acceptance estimates a_1, a_2, ... (conditional: a_j is
the chance the j-th draft is accepted given the ones before it were), the j-th draft of a request
survives with probability s_j = a_1 * ... * a_j, and a step of N base tokens (one per decode, plus
prefill chunks) emits sum(1 + sum_j s_j) tokens in T(N + drafts) seconds, T read off a step-cost
curve profiled at start-up. Drafts are added greedily, best survival first, while tokens per
second still rise: a memory-bound step (T flat) takes every likely draft, a compute-bound one (T
proportional to tokens) takes drafts only when s_j > N * dT / T, so at high concurrency none. Each
verified draft also attends to its request's whole context, priced per context token (measured).
The shared estimates, over all requests, are counts of drafts verified and accepted per position,
decayed each step (so they forget with time, not with traffic, and a high-concurrency step's many
observations do not wash out the past), with an optimistic bonus that shrinks as a position is
observed: a position the budget stopped drafting is not stuck at a low guess forever. Each request
also keeps its own moving average (its content, e.g. code being copied, moves it away from the rest),
blended in as it observes more.

Those estimates come from verified drafts, and `choose` verifies the likely ones (a block drafter's
confidences tell it which): drafts it drops never teach them, so they run high for what `plan` asks,
the tokens a planned draft will bring. `plan` also counts how many planned drafts `choose` kept, per
position (decayed counts, starting from all kept), and multiplies that in: a drafter run every step for
drafts that are then dropped stops being run.

The curves are profiled at start-up, once, on a machine that may be busy then and not later, and they leave
out what a step spends around the model (scheduling, sampling, the drafter's path selection). Where steps run
synchronously the engine reports each one's wall time (`observe_step`); `plan` scales what it expects of
plain steps and of speculative ones (drafting or verifying) by what such steps took against the curves.

`choose` runs once the drafts exist (their cost is spent). `plan` runs before drafting, so a drafter
that pays per draft (a draft model: one forward pass per draft position, over the requests drafting
that deep) can draft only what will be verified: it also counts that cost, from a draft step curve.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from dataclasses import dataclass, field

import numpy as np

from pressroom.core.spec_calibration import ConfidenceCalibrator

_EMA = 0.1  # weight of each new observation of one request's own acceptance
_OWN_PRIOR = 16  # a request's own estimate counts as much as the shared one after this many observations
_PRIOR = 0.7  # the guess before any observation, worth _PRIOR_WEIGHT of them
_PRIOR_WEIGHT = 4.0
_DECAY = 0.99  # per step, on the shared counts: about the last 100 steps count
_EXPLORE = 0.3  # optimism: rate + _EXPLORE / sqrt(1 + observations) while planning
_PROBE_EVERY = 16  # a request whose drafts were skipped this many steps in a row verifies one (to keep learning)
_PROBE_EVERY_MAX = 512  # each probe that was not worth it doubles the wait, up to this (probes cost at high load)
# The shared estimates learn from any request's probe, so a batch needs about as many probes per step at
# any size: past this many requests, each one's wait grows with the batch.
_PROBE_ROWS = 16
_STEP_EMA = 0.05  # weight of each step's measured/expected time ratio (the noise of one step is large)


@dataclass(slots=True)
class _Counts:
    """Shared per-position acceptance: decayed counts of verified drafts and of accepted ones."""
    trials: list[float]
    hits: list[float]

    @classmethod
    def empty(cls, k: int) -> _Counts:
        return cls([0.0] * k, [0.0] * k)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Positions 1..accepted were accepted, the next (if drafted) rejected; later ones unobserved."""
        for j in range(min(num_accepted + 1, num_draft)):
            self.trials[j] += 1.0
            self.hits[j] += float(j < num_accepted)

    def decay(self, factor: float) -> None:
        for counts in (self.trials, self.hits):
            counts[:] = [c * factor for c in counts]

    def assume(self, rates: list[float], weight: float = 1e6) -> None:
        """As if `weight` drafts had been verified at each position with these acceptance rates."""
        self.trials = [weight] * len(rates)
        self.hits = [r * weight for r in rates]

    @property
    def rates(self) -> list[float]:
        return [(h + _PRIOR_WEIGHT * _PRIOR) / (t + _PRIOR_WEIGHT) for h, t in zip(self.hits, self.trials)]

    @property
    def optimistic(self) -> list[float]:
        return [min(1.0, r + _EXPLORE / (1.0 + t) ** 0.5) for r, t in zip(self.rates, self.trials)]


@dataclass(slots=True)
class _Estimates:
    """One request's own per-position acceptance: moving averages over its verified drafts."""
    rates: list[float]
    seen: list[int] = field(default_factory=list)  # observations per position (own estimates blend in)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Positions 1..accepted were accepted, the next (if drafted) rejected; later ones unobserved."""
        for j in range(min(num_accepted + 1, num_draft)):
            hit = 1.0 if j < num_accepted else 0.0
            self.rates[j] += _EMA * (hit - self.rates[j])
            self.seen[j] += 1


class AdaptiveBudget:
    def __init__(self, max_drafts: int, verify_costs: list[tuple[int, float]],
                 decode_costs: list[tuple[int, float]] | None = None, attention_cost: float = 0.0,
                 draft_costs: list[tuple[int, float]] | None = None,
                 first_draft_costs: list[tuple[int, float]] | None = None,
                 block_costs: list[tuple[int, float]] | None = None) -> None:
        """Step costs measured at start-up, (tokens in a step, seconds) at a short context: steps that
        verify drafts, and (optional) plain decode steps, which may run a cheaper path. `attention_cost`:
        seconds per query token per context token it attends to, added on top of the curves.
        `draft_costs` (optional, for `plan`): one drafter forward pass over that many single-token rows;
        `first_draft_costs`: where the first draft position costs a pass of another shape (a draft model
        mirroring the target under async scheduling runs two tokens per request it drafts for), its curve."""
        self.k = max_drafts
        self.costs = sorted(verify_costs)
        self.decode_costs = sorted(decode_costs) if decode_costs and len(decode_costs) > 1 else None
        self.draft_costs = sorted(draft_costs) if draft_costs and len(draft_costs) > 1 else None
        self.first_draft_costs = sorted(first_draft_costs) if first_draft_costs and len(first_draft_costs) > 1 else None
        # A block drafter's own pass over that many requests (dflash2): paid once per drafting request,
        # whatever its depth, on top of the per-position `draft_costs`.
        self.block_costs = sorted(block_costs) if block_costs and len(block_costs) > 1 else None
        self.attention_cost = attention_cost
        # the curves as arrays, each built once: `plan` reads them every step (rebuilding them took most of its time)
        self._arrays: dict[int, tuple[list, tuple[np.ndarray, np.ndarray]]] = {}
        self.shared = _Counts.empty(max_drafts)
        # What a drafter's stated confidences turn out to mean (spec_calibration.py): a drafter that says 0.9
        # where 0.6 survive is planned with 0.6 there.
        self.calibrator = ConfidenceCalibrator(max_drafts)
        self.own: dict[str, _Estimates] = {}
        self.skipped: dict[str, int] = {}  # consecutive steps a request's drafts were all dropped
        self.probe_every: dict[str, int] = {}  # per request, skipped steps before its next probe
        # A new request's first wait: the longest any request has reached since drafts last paid on their
        # merit (short requests that each started from _PROBE_EVERY would probe a stream of them often).
        self.first_wait = _PROBE_EVERY
        self.probing: set[str] = set()  # requests `plan` gave a probe draft, for `choose` to keep
        self.planned: dict[str, int] = {}  # the last plan's drafts, for `choose` to report how many it kept
        self.kept = _Counts.empty(max_drafts)  # per position: planned drafts, and those `choose` verified
        # log(measured / expected seconds) of synchronous steps, plain [0] and speculative [1] (observe_step)
        self.log_slowdown = [0.0, 0.0]

    # ---- learning ----

    def tick(self) -> None:
        """Once per step: the shared counts fade."""
        self.shared.decay(_DECAY)
        self.kept.decay(_DECAY)
        self.calibrator.decay(_DECAY)

    def observe(self, req_id: str, num_draft: int, num_accepted: int, confidences: list[float] | None = None) -> None:
        """A verified draft: `confidences`, the drafter's own per-token estimates for it, if it gave any."""
        self.shared.observe(num_draft, num_accepted)
        if confidences:
            self.calibrator.observe(confidences, num_draft, num_accepted)
        own = self.own.get(req_id)
        if own is None:  # (not setdefault: the shared rates are computed only for a new request)
            own = self.own[req_id] = _Estimates(self.shared.rates, [0] * self.k)
        own.observe(num_draft, num_accepted)

    def observe_step(self, seconds: float, tokens: int, verified: bool, planned: dict[str, int],
                     context: int) -> None:
        """A synchronous step's wall time: `tokens` computed (with `verified` drafts among them or not), the
        drafts `planned` for the next step made in it, its queries attending to `context` tokens in all."""
        expected = self.expected_seconds(tokens, verified, planned, context)
        if seconds > 0 and expected > 0:
            kind = int(verified or any(planned.values()))
            self.log_slowdown[kind] += _STEP_EMA * (math.log(seconds / expected) - self.log_slowdown[kind])

    def expected_seconds(self, tokens: int, verified: bool, planned: dict[str, int], context: int) -> float:
        """What the curves say such a step costs: the model's pass and the drafting it does."""
        curve = self.costs if verified or self.decode_costs is None else self.decode_costs
        seconds = self.step_time(tokens, curve) + self.attention_cost * context
        depths = [n for n in planned.values() if n]
        if depths and self.draft_costs is not None:
            for j in range(max(depths)):  # one pass per position, over the requests drafting that deep
                seconds += self.step_time(sum(n > j for n in depths), self._first_or_draft(j))
            if self.block_costs is not None:
                seconds += self.step_time(len(depths), self.block_costs)
        return seconds

    def _first_or_draft(self, position: int) -> list[tuple[int, float]]:
        return self.first_draft_costs if position == 0 and self.first_draft_costs is not None else self.draft_costs

    def forget(self, req_id: str) -> None:
        self.own.pop(req_id, None)
        self.skipped.pop(req_id, None)
        self.probe_every.pop(req_id, None)
        self.probing.discard(req_id)
        self.planned.pop(req_id, None)

    def calibrated(self, confidences: list[float]) -> list[float]:
        """A drafter's confidences replaced by the acceptance observed where it said as much (per position)."""
        return self.calibrator.calibrated(confidences[:self.k])

    def acceptance(self, req_id: str) -> list[float]:
        """Per-position conditional acceptance to plan with for this request: its own moving average
        blended with the shared (optimistic) estimate, its own weighing more as it observes more."""
        return self._acceptance_matrix([req_id])[0].tolist()

    # ---- choosing ----

    def step_time(self, tokens: int, curve: list[tuple[int, float]] | None = None) -> float:
        """Linear interpolation of a profiled curve (extrapolated from its end points)."""
        curve = curve or self.costs
        i = min(max(bisect.bisect_left(curve, (tokens,)), 1), len(curve) - 1)
        (x0, y0), (x1, y1) = curve[i - 1], curve[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def choose(self, drafts: dict[str, int], base_tokens: int, contexts: dict[str, int] | None = None,
               base_context: int = 0, confidences: dict[str, list[float]] | None = None) -> dict[str, int]:
        """How many of its offered drafts each request verifies, for a step of `base_tokens` without drafts
        whose queries attend to `base_context` tokens in all; `contexts`: each request's context length.
        `confidences` (confidence-scheduled verification): a drafter's own per-token estimates for this
        very draft, used instead of the acceptance history where given."""
        contexts, confidences = contexts or {}, confidences or {}
        attn = self.attention_cost
        survival: dict[str, list[float]] = {}
        heap = []
        history = self._acceptance_matrix(list(drafts)).tolist()
        for (rid, offered), rates in zip(drafts.items(), history):
            stated = confidences.get(rid)
            survival[rid] = s = _survival(self.calibrated(stated) if stated else rates, offered)
            if s:
                heapq.heappush(heap, (-s[0], rid))
        chosen = {rid: 0 for rid in drafts}
        tokens, emitted, context = base_tokens, float(base_tokens), float(base_context)
        rate = emitted / (self.step_time(tokens) + attn * context)
        while heap:
            neg, rid = heapq.heappop(heap)
            more = context + contexts.get(rid, 0)
            better = (emitted - neg) / (self.step_time(tokens + 1) + attn * more)
            if better <= rate:
                continue  # not this one; a less likely draft with a shorter context may still pay
            tokens, emitted, context, rate = tokens + 1, emitted - neg, more, better
            chosen[rid] += 1
            if chosen[rid] < len(survival[rid]):
                heapq.heappush(heap, (-survival[rid][chosen[rid]], rid))
        if self.decode_costs is not None and tokens > base_tokens:
            plain = base_tokens / (self.step_time(base_tokens, self.decode_costs) + attn * base_context)
            if plain >= rate:  # verifying runs a slower path than plain decodes: not worth it here
                chosen = {rid: 0 for rid in drafts}
        chosen = self._probe(chosen, drafts)
        for rid, kept in chosen.items():
            planned = self.planned.pop(rid, 0)
            for j in range(planned):
                self.kept.trials[j] += 1.0
                self.kept.hits[j] += float(j < kept)
        return chosen

    def plan(self, allowed: dict[str, int], base_tokens: int, contexts: dict[str, int] | None = None,
             base_context: int = 0) -> dict[str, int]:
        """How many drafts each request should have drafted for the next step (at most `allowed`), before
        any drafting. Candidates (request, position) in order of survival: the best prefix of that order,
        counting verification as `choose` does plus one draft step per position over the requests
        drafting that deep. A prefix, not one draft at a time: at high concurrency a draft step is worth
        running for many requests or for none, and single additions would never open it. A second order,
        position by position (every request's first draft, then every second one, ...), is tried too and
        the better kept: by survival alone, a few requests whose estimates run high put their deeper
        drafts among the others' first ones and open a draft step for just those few. Call once per
        step: a request planned no drafts for long gets one (its probe), as in `choose`."""
        contexts = contexts or {}
        rids = list(allowed)
        if not rids:
            return {}
        survival = np.cumprod(self._acceptance_matrix(rids), axis=1) * self._kept_rates()  # [requests, K]
        limit = np.array([allowed[r] for r in rids])
        row, depth = np.nonzero(np.arange(self.k)[None, :] < limit[:, None])  # one candidate each
        gain = survival[row, depth]
        context = np.array([contexts.get(r, 0) for r in rids], dtype=float)[row]
        name = np.argsort(np.argsort(np.array(rids)))[row]  # ties go by request id, deterministically
        best_n, best_rate, best_order = 0, 0.0, None
        orders = [np.lexsort((name, depth, -gain))]
        if len(rids) > 1:  # one request's drafts come in the same order either way
            orders.append(np.lexsort((name, -gain, depth)))
        for order in orders:
            n, rate = self._best_prefix(gain[order], depth[order], context[order], base_tokens, base_context)
            if rate > best_rate:
                best_n, best_rate, best_order = n, rate, order
        counts = np.bincount(row[best_order[:best_n]], minlength=len(rids)) if best_n else np.zeros(len(rids), int)
        planned = self._probe_planned({rid: int(c) for rid, c in zip(rids, counts)}, allowed)
        self.planned = {rid: n for rid, n in planned.items() if n}
        return planned

    def _kept_rates(self) -> np.ndarray:
        """Per position, the share of planned drafts `choose` verified (all, before any were planned)."""
        return (np.array(self.kept.hits) + _PRIOR_WEIGHT) / (np.array(self.kept.trials) + _PRIOR_WEIGHT)

    def _acceptance_matrix(self, rids: list[str]) -> np.ndarray:
        """`acceptance` of each request, [requests, K]: the shared estimate, and the own ones blended in, each
        built as one array (a loop of small arrays per request took most of `plan`'s time at 256 requests)."""
        shared = np.array(self.shared.optimistic)
        out = np.tile(shared, (len(rids), 1))
        owns = [self.own.get(rid) for rid in rids]
        rows = [i for i, own in enumerate(owns) if own is not None]
        if rows:
            rates = np.array([owns[i].rates for i in rows])
            seen = np.array([owns[i].seen for i in rows], dtype=float)
            out[rows] = (seen * rates + _OWN_PRIOR * shared) / (seen + _OWN_PRIOR)
        return out

    def _best_prefix(self, gain: np.ndarray, depth: np.ndarray, context: np.ndarray, base_tokens: int,
                     base_context: int) -> tuple[int, float]:
        """The best prefix of the candidates (survival, draft position, context of each, in order) and its
        tokens per second (0 drafts: plain decoding's), from the rates of every prefix at once."""
        attn = self.attention_cost
        plain_slowdown, spec_slowdown = (math.exp(x) for x in self.log_slowdown)
        plain = base_tokens / ((self.step_time(base_tokens, self.decode_costs) + attn * base_context) * plain_slowdown)
        if not len(gain):
            return 0, plain
        m = np.arange(1, len(gain) + 1)
        emitted = base_tokens + np.cumsum(gain)
        seconds = _interp(self._as_arrays(self.costs), base_tokens + m) + attn * (base_context + np.cumsum(context))
        if self.draft_costs is not None:
            rows = _rank_within(depth)  # requests drafting this candidate's position, itself included
            step = _marginal(self._as_arrays(self.draft_costs), rows)
            first = depth == 0
            if self.first_draft_costs is not None:
                step[first] = _marginal(self._as_arrays(self.first_draft_costs), rows[first])
            if self.block_costs is not None:  # a request's first position also opens its block pass
                step[first] += _marginal(self._as_arrays(self.block_costs), rows[first])
            seconds += np.cumsum(step)
        rates = emitted / (seconds * spec_slowdown)
        best = int(rates.argmax())
        return (best + 1, float(rates[best])) if rates[best] > plain else (0, plain)

    def _as_arrays(self, curve: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
        """`_arrays(curve)`, built on first use (a curve replaced later gets its own)."""
        kept = self._arrays.get(id(curve))
        if kept is None or kept[0] is not curve:
            kept = self._arrays[id(curve)] = (curve, _arrays(curve))
        return kept[1]

    def _probe_planned(self, planned: dict[str, int], allowed: dict[str, int]) -> dict[str, int]:
        """Counts steps planned without drafts; at the limit one draft is planned (a probe, which `choose`
        then keeps even where it would skip it) and the wait doubles."""
        start = self.first_wait  # as it was before this step's probes
        crowding = _crowding(len(planned))
        for rid, k in planned.items():
            if not allowed[rid]:
                continue
            if k:
                self.skipped[rid] = 0
                self._paid(rid)
                continue
            self.skipped[rid] = skipped = self.skipped.get(rid, 0) + 1
            wait = self.probe_every.get(rid, start)
            if skipped >= wait * crowding:
                planned[rid], self.skipped[rid] = 1, 0
                self._back_off(rid, wait)
                self.probing.add(rid)
        return planned

    def _probe(self, chosen: dict[str, int], offered: dict[str, int]) -> dict[str, int]:
        """Estimates only move where drafts are verified; a request left out for long gets one draft
        checked, so a drafter that became good for it (e.g. the answer started quoting) is noticed. Each
        probe doubles the wait before the next, until drafts are chosen on their merit again."""
        start = self.first_wait  # as it was before this step's probes
        for rid, k in chosen.items():
            if rid in self.probing:  # planned as a probe: verified whatever this step's verdict
                self.probing.discard(rid)
                chosen[rid] = max(k, min(1, offered[rid]))
                continue
            if k:
                self._paid(rid)
            if k or not offered[rid]:
                self.skipped[rid] = 0
                continue
            self.skipped[rid] = self.skipped.get(rid, 0) + 1
            wait = self.probe_every.get(rid, start)
            if self.skipped[rid] >= wait * _crowding(len(chosen)):
                chosen[rid], self.skipped[rid] = 1, 0
                self._back_off(rid, wait)
        return chosen

    def _paid(self, rid: str) -> None:
        """Drafts chosen on their merit: probing goes back to its shortest wait."""
        self.probe_every.pop(rid, None)
        self.first_wait = _PROBE_EVERY

    def _back_off(self, rid: str, wait: int) -> None:
        self.probe_every[rid] = min(2 * wait, _PROBE_EVERY_MAX)
        self.first_wait = max(self.first_wait, self.probe_every[rid])


def _crowding(rows: int) -> int:
    """How much longer each request waits between probes in a batch of `rows` requests."""
    return max(1, rows // _PROBE_ROWS)


def _survival(rates: list[float], n: int) -> list[float]:
    """Chance the first 1..n drafts all survive, from conditional per-position acceptance rates."""
    return list(itertools.accumulate(rates[:n], operator.mul))


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """For each element, 1 + how many elements before it share its group (as float)."""
    by_group = np.argsort(groups, kind="stable")
    ordered = groups[by_group]
    ranks = np.empty(len(groups))
    ranks[by_group] = np.arange(1, len(groups) + 1) - np.searchsorted(ordered, ordered, side="left")
    return ranks


def _arrays(curve: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """A curve's points as arrays, its end segments carried out a long way (2^30 tokens), so that np.interp,
    one C call, extrapolates them as `step_time` does."""
    xs, ys = np.array([x for x, _ in curve], dtype=float), np.array([y for _, y in curve], dtype=float)
    far = float(1 << 30)
    low = ys[0] - (ys[1] - ys[0]) * far / (xs[1] - xs[0])
    high = ys[-1] + (ys[-1] - ys[-2]) * far / (xs[-1] - xs[-2])
    return np.concatenate([[xs[0] - far], xs, [xs[-1] + far]]), np.concatenate([[low], ys, [high]])


def _interp(curve: tuple[np.ndarray, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """`AdaptiveBudget.step_time` over an array (the curve as `_arrays` made it)."""
    return np.interp(tokens, *curve)


def _marginal(curve: tuple[np.ndarray, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """What the rows-th row adds to a pass over rows - 1 (the whole pass for the first)."""
    return _interp(curve, rows) - np.where(rows > 1, _interp(curve, np.maximum(rows - 1, 1)), 0.0)
