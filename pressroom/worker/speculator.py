"""Speculative decoding in the runner: the step's drafts laid out once, and the drafter's state.

`SpecDecodeMetadata` is built once per step when the batch is prepared: per sampled request, the drafts
it verifies, where its 1 + k logits rows sit in the flat batch (the positions its drafts are checked at,
then the bonus position) and where its draft ids sit. Verification, feature hand-over, drafting and the
next step's rejection shifts all read it.

`Speculator` owns the proposer (spec_decode/ implements it; worker/ only knows `Proposer`), the
probabilities of the drafts it made until they are verified, and, drafting on the device, the drafts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pressroom.core.outputs import PLACEHOLDER_DRAFT, ModelRunnerOutput, SchedulerOutput
from pressroom.worker.device import to_device
from pressroom.worker.proposer import DraftRequest, Proposer, TargetStep
from pressroom.worker.request_state import CachedRequestState

NO_LIMIT = 1 << 30  # drafts a request may have where the budget plans none


@dataclass(frozen=True, slots=True)
class SpecDecodeMetadata:
    """Per sampled request (in sampling order): the drafts it verifies and its place in the flat batch."""
    num_drafts: list[int]
    query_ends: list[int]  # exclusive end of each sampled request's query tokens in the flat batch
    draft_index: torch.Tensor | None  # [rows, max_drafts] flat positions of each row's drafts (the last
    # repeated as padding); None when no row has drafts

    @classmethod
    def build(cls, num_drafts: list[int], query_ends: list[int], device: str) -> SpecDecodeMetadata:
        kmax = max(num_drafts, default=0)
        draft_index = None
        if kmax:
            at = [end - k + min(j, k - 1) if k else 0 for end, k in zip(query_ends, num_drafts) for j in range(kmax)]
            draft_index = to_device(torch.tensor(at, dtype=torch.long), device).view(len(num_drafts), kmax)
        return cls(num_drafts, query_ends, draft_index)

    @property
    def max_drafts(self) -> int:
        return max(self.num_drafts, default=0)

    @property
    def spans(self) -> list[int]:
        """Per row, the tokens its step may emit: accepted drafts, then the target's token."""
        return [1 + k for k in self.num_drafts]

    def logits_positions(self, rows: Sequence[int]) -> list[int]:
        """Flat positions of the given rows' 1 + k logits, row after row (a row without drafts: its last token)."""
        return [p for j in rows for p in range(self.query_ends[j] - self.num_drafts[j] - 1, self.query_ends[j])]

    def logits_starts(self, rows: Sequence[int]) -> list[int]:
        """Where each of the given rows' logits start among `logits_positions(rows)`'s, and their end."""
        starts = [0]
        for j in rows:
            starts.append(starts[-1] + 1 + self.num_drafts[j])
        return starts


class Speculator:
    def __init__(self, proposer: Proposer, on_device: bool, synthetic_rates: list[float] | None = None) -> None:
        """`on_device`: async scheduling, where the proposer drafts on the device, its drafts stay there and
        the scheduler sends placeholders for them; `synthetic_rates`: rejection_sample_method="synthetic"."""
        self.proposer, self.on_device, self.synthetic_rates = proposer, on_device, synthetic_rates
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> q of its pending drafts
        self.next_drafts: dict[str, torch.Tensor] = {}  # request id -> its pending drafts, on the device

    def forget(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self.draft_probs.pop(rid, None)
            self.next_drafts.pop(rid, None)
        if req_ids:
            self.proposer.forget(req_ids)

    def device_drafts(self, req_id: str, count: int) -> torch.Tensor:
        """The first `count` drafts a device drafter left for a request."""
        return self.next_drafts[req_id][:count]

    def host_drafts(self, drafts: list[int], req_id: str) -> list[int]:
        """Scheduled drafts' ids on the host (fetched from the device where they are placeholders)."""
        if drafts and drafts[0] == PLACEHOLDER_DRAFT:
            return self.device_drafts(req_id, len(drafts)).tolist()
        return list(drafts)

    def take_probs(self, req_id: str, count: int) -> torch.Tensor | None:
        """q of a request's drafts being verified on the host (they are used up)."""
        q = self.draft_probs.pop(req_id, None)
        return None if q is None else q[:count]

    def draft_q(self, sampling: list[tuple[int, CachedRequestState]], spec: SpecDecodeMetadata
                ) -> torch.Tensor | None:
        """[rows, kmax, vocab]: q of each sampled (not greedy) row's drafts; None when no such row has drafts
        or the proposal is deterministic (verification then takes q as one-hot)."""
        kmax = spec.max_drafts
        wanted = [s for (_, s), k in zip(sampling, spec.num_drafts) if k and not s.params.greedy]
        if not wanted or not self.proposer.gives_probabilities:
            return None
        missing = [s.req_id for s in wanted if s.req_id not in self.draft_probs]
        if missing:  # treating such drafts as certain would bias the sample: a bug, not a fallback
            raise RuntimeError(f"No draft probabilities for sampled requests {missing}.")
        some = next(iter(self.draft_probs.values()))
        q = some.new_zeros(len(sampling), kmax, some.shape[-1])  # greedy rows: never read
        for j, (_, s) in enumerate(sampling):
            probs = self.draft_probs.get(s.req_id)
            if probs is not None:  # a host drafter's rows differ in length; a device drafter's are K long
                q[j, :min(kmax, len(probs))] = probs[:kmax]
        return q

    def hand_over_features(self, order: list[CachedRequestState], query_ends: list[int], sched: SchedulerOutput,
                           out: ModelRunnerOutput, features: torch.Tensor) -> None:
        """The target features (its aux layers) at each request's positions this step verified: every
        query token, except the rejected drafts of a verification."""
        for i, s in enumerate(order):
            first = query_ends[i - 1] if i else 0
            end = query_ends[i]
            if s.req_id in sched.scheduled_spec_decode_tokens:  # the last verified token + the accepted drafts
                end = first + len(out.sampled_token_ids[s.req_id])
            self.proposer.observe_features(s.req_id, features[first:end])

    def propose(self, states: list[CachedRequestState], out: ModelRunnerOutput, limits: dict[str, int]) -> None:
        """Drafts for each request's next step (at most its planned limit, where the budget plans them, and
        up to the first a structured request's grammar forbids); their probabilities stay here until
        verification."""
        by_id = {s.req_id: s for s in states}
        requests = [DraftRequest(s.req_id, s.token_ids,
                                 min(s.params.max_tokens - s.num_outputs - 1, limits.get(s.req_id, NO_LIMIT)),
                                 s.params) for s in states]
        for s in states:
            self.draft_probs.pop(s.req_id, None)
        for rid, draft in self.proposer.propose(requests).items():
            grammar = by_id[rid].grammar
            out.draft_token_ids[rid] = draft.token_ids if grammar is None else \
                grammar.allowed_prefix(by_id[rid].token_ids, draft.token_ids)
            if draft.confidences is not None:
                out.draft_confidences[rid] = draft.confidences
            if draft.probs is not None:
                self.draft_probs[rid] = draft.probs

    def launch(self, step: TargetStep, sampling: list[tuple[int, CachedRequestState]]) -> None:
        """Hands a step to the device drafter (which mirrors every target step in its own cache) and keeps
        its drafts on the device for the next step."""
        proposed = self.proposer.propose_on_device(step)
        if proposed is None:
            return
        drafts, probs = proposed
        for j, (_, s) in enumerate(sampling):
            self.next_drafts[s.req_id] = drafts[j]
            if probs is not None and not s.params.greedy:
                self.draft_probs[s.req_id] = probs[j]
            else:
                self.draft_probs.pop(s.req_id, None)
