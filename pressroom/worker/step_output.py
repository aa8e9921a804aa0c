"""What a step leaves behind: its output for the engine (whose tokens may still be on their way from the
device) and, for async scheduling and device drafters, the emitted tokens kept on the device.

Outputs never touch the runner's request states: `PendingOutput.resolve` only waits for the tokens and
fills the output; the runner books them into its states in one place (ModelRunner._book).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pressroom.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pressroom.worker.device import to_device
from pressroom.worker.request_state import CachedRequestState


@dataclass(slots=True)
class DeviceStep:
    """The last launched step's emitted tokens, left on the device as the next step's inputs."""
    rows: dict[str, int]  # request id -> row
    tokens: torch.Tensor  # [rows, width]: accepted drafts, then the target's token; padded
    counts: torch.Tensor | None  # [rows] tokens emitted per row; None: one each
    num_drafts: list[int]  # per row, the drafts it verified (its next positions shift by the rejected ones)

    def last_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        if self.counts is None:
            return self.tokens[rows, 0]
        return self.tokens[rows, self.counts[rows] - 1]

    def rejected(self, rows: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
        return num_drafts - (self.counts[rows] - 1)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass(slots=True)
class PendingOutput(AsyncModelRunnerOutput):
    """A step's output whose emitted tokens may still be on their way from the device."""
    output: ModelRunnerOutput
    states: list[CachedRequestState]  # the sampled requests, in the order of the emitted rows
    tokens: torch.Tensor | None  # [rows, width] host copy (pinned, filled asynchronously on CUDA)
    counts: torch.Tensor | None = None  # [rows] tokens emitted per row; None: one each
    spans: list[int] | None = None  # per row, the tokens it had in flight (1 + drafts); None: none
    copied: torch.cuda.Event | None = None
    resolved: bool = False
    transferred: torch.cuda.Event | None = None  # the step's KV offload copies (their slots return with the output)
    emitted_rows: list[list[int]] | None = None  # per row, its emitted tokens once on the host

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingOutput:
        return cls(output, [], None, resolved=True, emitted_rows=[])

    @classmethod
    def on_host(cls, output: ModelRunnerOutput, states: list[CachedRequestState]) -> PendingOutput:
        """A step sampled on the host: its tokens are in `output` already."""
        return cls(output, states, None, resolved=True,
                   emitted_rows=[output.sampled_token_ids[s.req_id] for s in states])

    @classmethod
    def start(cls, output: ModelRunnerOutput, states: list[CachedRequestState], tokens: torch.Tensor,
              counts: torch.Tensor | None, spans: list[int]) -> PendingOutput:
        if not tokens.is_cuda:
            return cls(output, states, tokens, counts, spans)
        tokens, counts = _pinned_copy(tokens), None if counts is None else _pinned_copy(counts)
        copied = torch.cuda.Event()
        copied.record()
        return cls(output, states, tokens, counts, spans, copied)

    def resolve(self) -> ModelRunnerOutput:
        """Waits for the tokens and returns the output with them."""
        if self.transferred is not None:
            self.transferred.synchronize()
            self.transferred = None
        if self.resolved:
            return self.output
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.tokens.tolist()
        counts = self.counts.tolist() if self.counts is not None else [1] * len(rows)
        self.emitted_rows = [row[:n] for row, n in zip(rows, counts)]
        for state, emitted in zip(self.states, self.emitted_rows):
            self.output.sampled_token_ids[state.req_id] = emitted
        self.resolved = True
        return self.output

    def emitted(self) -> Iterator[tuple[CachedRequestState, list[int], int]]:
        """(state, its emitted tokens, the tokens it had in flight) of each row; after `resolve`."""
        spans = self.spans or [0] * len(self.states)
        return zip(self.states, self.emitted_rows, spans)


@dataclass(slots=True)
class Emission:
    """What a step emitted: its output (pending or resolved) and, per request that sampled, its tokens,
    which the next step (async scheduling) and a device drafter read on the device."""
    pending: PendingOutput
    sampling: list[tuple[int, CachedRequestState]]  # (batch index, state) of each request that sampled
    num_drafts: list[int]  # per sampled request: the drafts it verified
    tokens: torch.Tensor | None = None  # [sampled, width] on the device: accepted drafts, then the target's token
    counts: torch.Tensor | None = None  # [sampled] tokens emitted per row; None: one each
    emitted: list[list[int]] | None = None  # the same tokens on the host, where sampling ran there

    def device_tokens(self, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`tokens` and `counts`, sent to the device once where sampling ran on the host."""
        if self.tokens is None and self.emitted is not None:
            width = 1 + max(self.num_drafts)  # as the device path pads: a drafter reads 1 + k per row
            self.tokens = to_device(torch.tensor([e + [0] * (width - len(e)) for e in self.emitted]), device)
            self.counts = to_device(torch.tensor([len(e) for e in self.emitted]), device)
        return self.tokens, self.counts

    def device_step(self, device: str) -> DeviceStep | None:
        if not self.sampling:
            return None
        tokens, counts = self.device_tokens(device)
        return DeviceStep({s.req_id: j for j, (_, s) in enumerate(self.sampling)}, tokens, counts, self.num_drafts)
