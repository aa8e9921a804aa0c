"""How a step's prompt chunks meet a request's media.

A run of placeholder tokens attended bidirectionally (Gemma 3's images, `MediaItem.bidirectional`) is computed in
one chunk: its first tokens see its last ones, so a chunk that ended inside it would compute them before the rest
exists. The chunk the token budget gives is cut back to the run's start, or, where the chunk starts at (or, after a
prefix-cache hit, inside) the run, stretched to the run's end when the step's budget left holds it; otherwise the
request waits a step. A run longer than max_num_batched_tokens could never be scheduled: the request is refused.
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
