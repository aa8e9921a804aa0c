"""How a step's prompt chunks meet a request's media: runs attended bidirectionally kept whole, and the step's
encoder work capped.

A run of placeholder tokens attended bidirectionally (Gemma 3's images, `MediaItem.bidirectional`) is computed in
one chunk: its first tokens see its last ones, so a chunk that ended inside it would compute them before the rest
exists. The chunk the token budget gives is cut back to the run's start, or, where the chunk starts at (or, after a
prefix-cache hit, inside) the run, stretched to the run's end when the step's budget left holds it; otherwise the
request waits a step. A run longer than max_num_batched_tokens could never be scheduled: the request is refused.

The encoder's work per step (vLLM's max_num_encoder_input_tokens) is counted in encoder output rows: a chunk that
first reaches a media unit (an item, or a bidirectional run of adjacent items) pays its rows; a chunk stops before a
unit the step's encoder budget no longer holds, so a step with many images spreads their encoding over steps. The
step's first unit always fits, since one larger than the whole budget would otherwise never run. An image already in
the runner's encoder cache (another request's) is counted too: the scheduler does not see that cache, so the cap is
on the encoder work a step may ask for, the safe side.
"""
from __future__ import annotations

from pressroom.multimodal.inputs import MediaItem, bidirectional_runs


def whole_run_chunk(items: list[MediaItem] | None, start: int, n: int, room: int) -> int:
    """The tokens to schedule from `start` given the policy's chunk of `n` and `room` tokens left in the step: `n`
    unless its end falls inside a bidirectional run (then cut before the run, stretched to its end, or 0)."""
    end = start + n
    for run_start, run_end in bidirectional_runs(items):
        if run_start < end < run_end:
            if run_start > start:
                return run_start - start
            return run_end - start if run_end - start <= room else 0
    return n


def check_runs_fit(items: list[MediaItem] | None, max_num_batched_tokens: int) -> None:
    """A ValueError naming the fix where a bidirectional run cannot fit one step."""
    longest = max((end - start for start, end in bidirectional_runs(items)), default=0)
    if longest > max_num_batched_tokens:
        raise ValueError(f"This model attends to an image's {longest} tokens bidirectionally, so a prefill step must "
                         f"hold them whole; max_num_batched_tokens is {max_num_batched_tokens}: raise it to at least "
                         f"{longest}.")


def media_units(items: list[MediaItem]) -> list[tuple[int, int]]:
    """(first token, encoder rows) of each unit the encoder runs for: a bidirectional run (its adjacent items at
    once, since one chunk computes them) or an item, in prompt order."""
    units = [(start, end - start) for start, end in bidirectional_runs(items)]
    units += [(m.offset, m.encoder_cost) for m in items if not m.bidirectional]
    return sorted(units)


class EncoderBudget:
    """One step's encoder output rows left (`limit` at the step's start)."""

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit

    def chunk(self, items: list[MediaItem] | None, start: int, n: int) -> int:
        """The most of the chunk [start, start + n) whose newly reached media units fit; pays for those."""
        for offset, rows in media_units(items or []):
            if not start <= offset < start + n:  # encoded by an earlier chunk, or not reached
                continue
            if rows > self.left and self.left < self.limit:  # the step's first unit fits, whatever its size
                return offset - start
            self.left = max(0, self.left - rows)
        return n


def media_chunk(items: list[MediaItem] | None, start: int, n: int, room: int, encoder: EncoderBudget) -> int:
    """A prompt chunk of `n` tokens from `start` as the request's media allow: bidirectional runs whole
    (`whole_run_chunk`, `room` tokens left in the step), then the step's encoder budget."""
    if not items:
        return n
    return encoder.chunk(items, start, whole_run_chunk(items, start, n, room))
