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
`verify_on_device` is the same test for a whole batch with no host round trip (async scheduling), for
rows whose sampling reads no token history.
"""
from __future__ import annotations

import itertools

import torch

from pressroom.sampling_params import SamplingParams
from pressroom.worker.device import to_device
from pressroom.worker.sampler import SamplingRow, _apply_processors, _mix, greedy_tokens, probabilities


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
        target = greedy_tokens(logits).tolist()
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


def verify_on_device(logits: torch.Tensor, params: list[SamplingParams], num_drafts: list[int],
                     drafts: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator | None,
                     synthetic_rates: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` for a batch, on the device. logits: [sum(1 + k_i), vocab] float32, each row's 1 + k_i
    positions in turn; drafts: [rows, kmax], padded; draft_probs: [rows, kmax, vocab], q of the sampled
    rows' drafts (None: one-hot). Returns tokens [rows, kmax + 1] (the accepted drafts, then the
    target's token, then padding) and how many each row emitted."""
    dev, (rows, kmax) = logits.device, drafts.shape
    first = list(itertools.accumulate((1 + k for k in num_drafts), initial=0))
    padded = [f + min(j, k) for f, k in zip(first, num_drafts) for j in range(kmax + 1)]
    logits = logits[to_device(torch.tensor(padded), dev)].view(rows, kmax + 1, -1)
    k = to_device(torch.tensor(num_drafts), dev)
    target = greedy_tokens(logits.view(rows * (kmax + 1), -1)).view(rows, kmax + 1)
    u = torch.rand(rows, kmax, generator=generator, device=dev)
    if synthetic_rates is not None:  # benchmarking only: acceptance at the given rates
        rates = [synthetic_rates[min(j, len(synthetic_rates) - 1)] for j in range(kmax)]
        hits = u < to_device(torch.tensor(rates), dev)
    else:
        hits = drafts == target[:, :kmax]  # greedy: prefix match
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        index = to_device(torch.tensor(sampled), dev)
        p = probabilities([params[i] for i in sampled for _ in range(kmax + 1)],
                          logits[index].flatten(0, 1)).view(len(sampled), kmax + 1, -1)
        if synthetic_rates is None:  # accept d_j with probability min(1, p / q)
            q, mine = _q(draft_probs, drafts, index, p.shape[-1]), drafts[index].unsqueeze(2)
            p_d, q_d = p[:, :kmax].gather(2, mine).squeeze(2), q.gather(2, mine).squeeze(2)
            hits = hits.index_copy(0, index, u[index] * q_d < p_d)
    accepted = (hits & (torch.arange(kmax, device=dev) < k[:, None])).int().cumprod(dim=1).sum(dim=1)
    tokens = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
    if sampled:
        at = accepted[index]
        p_at = p[torch.arange(len(sampled), device=dev), at]
        if synthetic_rates is None and kmax:  # rejected: draw from normalize(max(0, p - q)); all accepted: from p
            q_at = q[torch.arange(len(sampled), device=dev), at.clamp(max=kmax - 1)] * (at < k[index]).unsqueeze(1)
            residual = (p_at - q_at).clamp_(min=0.0)
            total = residual.sum(dim=-1, keepdim=True)
            p_at = torch.where(total > 0, residual / total.clamp(min=1e-30), p_at)  # p == q: any draw from p is exact
        noise = torch.empty_like(p_at).exponential_(generator=generator)
        tokens = tokens.index_copy(0, index, (p_at / noise).argmax(dim=-1))
    out = torch.cat([drafts, drafts.new_zeros(rows, 1)], dim=1).scatter_(1, accepted.unsqueeze(1), tokens.unsqueeze(1))
    return out, accepted + 1


def _q(draft_probs: torch.Tensor | None, drafts: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampled rows' q; a deterministic proposal is one-hot on its draft."""
    if draft_probs is not None:
        return draft_probs[index]
    return torch.nn.functional.one_hot(drafts[index], vocab).float()
