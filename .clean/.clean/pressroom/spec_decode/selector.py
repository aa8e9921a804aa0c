"""DFlash2's candidate selector: a draft path through the target head's top-M candidates per slot.

A block drafter gives K slots of hidden states; the target's LM head scores each, and the top-M
tokens per slot are the candidates. A path c_1..c_K through them scores

    sum_j unary_j(c_j) + edge_j(c_{j-1} -> c_j),    edge_j(p -> c) = <A[p] * project(h_j), B[c]>,

a low-rank bilinear transition (token factors A, B of rank r, the slot's hidden state projected to
r) plus a unary term; c_0 is the last verified token (the anchor). Greedy drafting takes the best
path (Viterbi). At temperature T > 0 the path is drawn from the chain distribution
P(path) ~ exp(score / T), slot by slot from its exact conditionals (backward messages), and each
slot's conditional q_j over its candidates goes to verification, which therefore stays lossless.
The drafter that produces the hidden states and the training of A, B and the projection are
separate pieces (the block drafter, `pressroom train-drafter`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class CandidateScorer(nn.Module):
    """The learned transition term: token factors A (from) and B (to), and a slot projection."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.a = nn.Embedding(vocab_size, rank)
        self.b = nn.Embedding(vocab_size, rank)
        nn.init.zeros_(self.b.weight)  # untrained, every transition scores 0: the path follows the unary term
        self.project = nn.Linear(hidden_size, rank, bias=False)

    def edges(self, anchor: int, candidates: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        """candidates: [K, M] token ids; hidden: [K, hidden]. Returns per slot j a [from, M] score
        matrix: from the anchor for slot 0 (one row), from slot j - 1's candidates after it."""
        slot = self.project(hidden)  # [K, r]
        sources = [torch.tensor([anchor], device=candidates.device)] + list(candidates[:-1])
        return [(self.a(src) * slot[j]) @ self.b(candidates[j]).T for j, src in enumerate(sources)]


@dataclass(slots=True)
class SelectedPath:
    tokens: list[int]
    # [K, M]: slot j's conditional distribution over its candidates given the chosen c_{j-1}
    # (None for a greedy path: the proposal is deterministic).
    q: torch.Tensor | None
    # Per slot, the chain's probability of the chosen candidate given the path before it (at the
    # sampling temperature, or 1 for a greedy path): the drafter's confidence, which
    # confidence-scheduled verification turns into survival estimates.
    confidence: list[float]

    def vocab_probs(self, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """q spread over the vocabulary, [K, vocab], as the rejection sampler takes it."""
        if self.q is None:
            return None
        dense = torch.zeros(len(self.tokens), vocab_size, dtype=self.q.dtype, device=self.q.device)
        return dense.scatter_(1, candidates, self.q)


def select_path(candidates: torch.Tensor, unary: torch.Tensor, edges: list[torch.Tensor], temperature: float,
                generator: torch.Generator | None = None) -> SelectedPath:
    """candidates, unary: [K, M]; edges: per slot [from, M] (slot 0 from the anchor alone)."""
    scores = [edges[j] + unary[j] for j in range(len(edges))]  # [from, M] per slot
    if temperature <= 0:
        idx = _viterbi(scores)
        conditionals = _conditionals([s.float() for s in scores], idx)
        return SelectedPath([int(candidates[j, i]) for j, i in enumerate(idx)], None,
                            [float(q[i]) for q, i in zip(conditionals, idx)])
    scaled = [s.float() / temperature for s in scores]
    beta = _backward(scaled)
    prev, idx, qs = 0, [], []
    for j, s in enumerate(scaled):
        q = torch.softmax(s[prev] + beta[j], dim=-1)
        choice = int(torch.multinomial(q, 1, generator=generator))
        idx.append(choice)
        qs.append(q)
        prev = choice
    return SelectedPath([int(candidates[j, i]) for j, i in enumerate(idx)], torch.stack(qs),
                        [float(q[i]) for q, i in zip(qs, idx)])


def _conditionals(scaled: list[torch.Tensor], idx: list[int]) -> list[torch.Tensor]:
    """Each slot's conditional distribution given the chosen path before it."""
    beta = _backward(scaled)
    prev, out = 0, []
    for j, s in enumerate(scaled):
        out.append(torch.softmax(s[prev] + beta[j], dim=-1))
        prev = idx[j]
    return out


def _viterbi(scores: list[torch.Tensor]) -> list[int]:
    best = scores[0][0]  # [M]: the anchor's single row
    back = []
    for s in scores[1:]:
        total = best[:, None] + s  # [M_prev, M]
        best, arg = total.max(dim=0)
        back.append(arg)
    idx = [int(best.argmax())]
    for arg in reversed(back):
        idx.append(int(arg[idx[-1]]))
    return idx[::-1]


def _backward(scaled: list[torch.Tensor]) -> list[torch.Tensor]:
    """beta[j][c]: log of the total weight of every continuation after choosing c at slot j."""
    beta = [torch.zeros(scaled[-1].shape[1], device=scaled[-1].device)]
    for s in reversed(scaled[1:]):
        beta.append(torch.logsumexp(s + beta[-1][None, :], dim=1))
    return beta[::-1]


# ---- many blocks at once: greedy drafting for a batch of requests, and the drafter's training ----

def lattice(scorer: CandidateScorer, top_m: int, slots: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates [b, K, M], unary log-probs [b, K, M] and edge scores [b, K, M, M] (from, to) for b
    blocks of slot hidden states [b, K, h] and logits [b, K, vocab]; slot 0's edges come from the
    anchor, the same for every `from` row."""
    # The top-M log-probs without a [b, K, vocab] log-softmax: a memory-bound pass saved on big batches.
    top, cand = logits.topk(top_m, dim=-1)
    unary = top.float() - torch.logsumexp(logits, dim=-1, keepdim=True).float()
    proj = scorer.project(slots)  # [b, K, r]
    b = cand.shape[0]
    src = torch.cat([scorer.a(anchors)[:, None, None, :].expand(b, 1, top_m, -1), scorer.a(cand[:, :-1])], dim=1)
    return cand, unary, torch.einsum("bkfr,bkr,bktr->bkft", src, proj, scorer.b(cand))


def viterbi_batch(unary: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Best path indices [b, K] through each block's lattice (`select_path` at temperature 0)."""
    best = unary[:, 0] + edges[:, 0, 0]
    back = []
    for j in range(1, unary.shape[1]):
        total = best[:, :, None] + edges[:, j] + unary[:, j, None, :]
        best, arg = total.max(dim=1)
        back.append(arg)
    idx = [best.argmax(dim=-1)]
    for arg in reversed(back):
        idx.append(arg.gather(1, idx[-1][:, None])[:, 0])
    return torch.stack(idx[::-1], dim=1)


def conditionals_batch(unary: torch.Tensor, edges: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[b, K]: the chain's probability of each chosen candidate given the path before it, the greedy
    path's confidences (as `select_path` reports them)."""
    scores = edges + unary[:, :, None, :]  # [b, K, from, to]
    k = scores.shape[1]
    beta = [torch.zeros_like(unary[:, 0])]
    for j in range(k - 1, 0, -1):
        beta.append(torch.logsumexp(scores[:, j] + beta[-1][:, None, :], dim=2))
    beta = beta[::-1]
    prev = torch.zeros_like(idx[:, 0])
    out = []
    for j in range(k):
        row = scores[:, j].gather(1, prev[:, None, None].expand(-1, 1, scores.shape[-1]))[:, 0]
        q = torch.softmax(row + beta[j], dim=-1)
        out.append(q.gather(1, idx[:, j:j + 1])[:, 0])
        prev = idx[:, j]
    return torch.stack(out, dim=1)
