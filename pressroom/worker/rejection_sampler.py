"""Lossless verification of draft tokens against the target's own distribution.

For one request with drafts d_1..d_k the target's forward pass gives logits at k + 1 positions.
Each position is processed with the history it would have had without speculation (penalties,
min_tokens, logit bias, thinking budget see the drafts before it), then:
- greedy: accept while d_j equals the argmax; the first mismatch (or position k + 1) gives the argmax;
- sampling: accept d_j with probability min(1, p(d_j) / q(d_j)); on rejection draw from
  normalize(max(0, p - q)) and stop; with every draft accepted, draw a bonus token from p.
A deterministic proposal (n-gram) has q = one-hot(d_j): acceptance is p(d_j), the residual is p
without d_j. The emitted tokens are then distributed exactly as sampling without speculation.
Seeded requests draw from generators keyed by (seed, output position), as the plain sampler does.
"""
from __future__ import annotations

import torch

from pressroom.worker.sampler import SamplingRow, _apply_processors, _mix, probabilities


def verify(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None, synthetic_rates: list[float] | None = None) -> list[int]:
    """logits: [k + 1, vocab] float32 for one request; rows: its sampling row at each position.
    Returns the tokens this step emits: the accepted drafts, then one token from the target.
    `synthetic_rates` (benchmarking only, not lossless): accept draft j with probability rates[j]."""
    logits = _apply_processors(logits, rows)
    params = rows[0].params
    if synthetic_rates is not None:
        return _synthetic(logits, rows, drafts, synthetic_rates, generator)
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        return drafts[:accepted] + [target[accepted]]
    probs = probabilities([params] * len(rows), logits)
    for j, token in enumerate(drafts):
        gen = _generator(rows[j], generator)
        p = probs[j, token]
        q = draft_probs[j, token] if draft_probs is not None else torch.ones((), device=probs.device)
        u = torch.rand((), generator=gen, device=probs.device)
        if bool(u * q < p):  # accept with probability min(1, p / q)
            continue
        residual = _residual(probs[j], draft_probs[j] if draft_probs is not None else None, token)
        return drafts[:j] + [_draw(residual, gen)]
    return drafts + [_draw(probs[len(drafts)], _generator(rows[len(drafts)], generator))]


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """normalize(max(0, p - q)); for a one-hot q that is p with the draft token removed."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    total = residual.sum()
    if float(total) <= 0.0:  # p == q up to rounding: any draw from p is exact
        return p
    return residual / total


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / noise).argmax())


def _generator(row: SamplingRow, shared: torch.Generator | None) -> torch.Generator | None:
    """A seeded request's draws at an output position come from their own generator."""
    seed = row.params.seed
    if seed is None:
        return shared
    device = shared.device if shared is not None else "cpu"
    return torch.Generator(device=device).manual_seed(_mix(seed, len(row.output_token_ids)) ^ 0x5EC)


def _synthetic(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int], rates: list[float],
               generator: torch.Generator | None) -> list[int]:
    """Accepts draft j with the given conditional probability, then one token from the target there."""
    accepted = 0
    while accepted < len(drafts):
        rate = rates[min(accepted, len(rates) - 1)]
        if float(torch.rand((), generator=generator, device=logits.device)) >= rate:
            break
        accepted += 1
    row = rows[accepted]
    if row.params.greedy:
        return drafts[:accepted] + [int(logits[accepted].argmax())]
    probs = probabilities([row.params], logits[accepted:accepted + 1])[0]
    return drafts[:accepted] + [_draw(probs, _generator(row, generator))]
