"""DFlash2's candidate selector: the greedy path is the best-scoring one, a sampled path follows the
chain distribution, and the q it reports makes verification lossless."""
from __future__ import annotations

import itertools

import torch

from pressroom.sampling_params import SamplingParams
from pressroom.spec_decode.selector import CandidateScorer, select_path
from pressroom.worker.rejection_sampler import verify
from pressroom.worker.sampler import SamplingRow

K, M = 3, 4


def _chain(seed: int):
    gen = torch.Generator().manual_seed(seed)
    candidates = torch.stack([torch.randperm(12, generator=gen)[:M] for _ in range(K)])
    unary = torch.randn(K, M, generator=gen)
    edges = [torch.randn(1, M, generator=gen)] + [torch.randn(M, M, generator=gen) for _ in range(K - 1)]
    return candidates, unary, edges


def _path_scores(unary, edges) -> dict[tuple[int, ...], float]:
    out = {}
    for path in itertools.product(range(M), repeat=K):
        s, prev = 0.0, 0
        for j, c in enumerate(path):
            s += float(edges[j][prev, c] + unary[j, c])
            prev = c
        out[path] = s
    return out


def test_greedy_path_is_the_best_scoring_one():
    for seed in range(5):
        candidates, unary, edges = _chain(seed)
        scores = _path_scores(unary, edges)
        best = max(scores, key=scores.get)
        chosen = select_path(candidates, unary, edges, temperature=0)
        assert chosen.tokens == [int(candidates[j, i]) for j, i in enumerate(best)] and chosen.q is None
        assert len(chosen.confidence) == K and all(0 < c <= 1 for c in chosen.confidence)


def test_sampled_paths_follow_the_chain_and_report_their_conditionals():
    candidates, unary, edges = _chain(7)
    temperature = 1.5
    scores = _path_scores(unary, edges)
    z = torch.logsumexp(torch.tensor(list(scores.values())) / temperature, dim=0)
    exact = {p: float(torch.exp(torch.tensor(s / temperature) - z)) for p, s in scores.items()}
    gen = torch.Generator().manual_seed(8)
    counts: dict[tuple[int, ...], int] = {}
    n = 6000
    for _ in range(n):
        chosen = select_path(candidates, unary, edges, temperature, gen)
        path = tuple(candidates[j].tolist().index(t) for j, t in enumerate(chosen.tokens))
        assert chosen.confidence == [float(chosen.q[j, i]) for j, i in enumerate(path)]
        counts[path] = counts.get(path, 0) + 1
        # q_j is the exact conditional of slot j given the slots before it
        prefix_mass = sum(v for p, v in exact.items() if p[:1] == path[:1])
        cond = [sum(v for p, v in exact.items() if p[:2] == path[:1] + (c,)) / prefix_mass for c in range(M)]
        assert torch.allclose(chosen.q[1], torch.tensor(cond), atol=1e-5)
    tv = 0.5 * sum(abs(counts.get(p, 0) / n - v) for p, v in exact.items())
    assert tv < 0.06  # 64 outcomes, 6,000 draws: an exact sampler's TV is about 0.04


def test_verification_with_selector_drafts_keeps_the_target_distribution():
    """The selector's q (spread over the vocabulary) goes to the rejection sampler: the first emitted
    token is distributed as the target's p, whatever the selector prefers."""
    vocab = 12
    candidates, unary, edges = _chain(3)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(K + 1, vocab, generator=gen)
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, [1], [], None) for _ in range(K + 1)]
    p0 = torch.softmax(logits[0], -1)
    first = torch.zeros(vocab)
    n = 6000
    for _ in range(n):
        chosen = select_path(candidates, unary, edges, 1.0, gen)
        q = chosen.vocab_probs(candidates, vocab)
        tokens = verify(logits, rows, chosen.tokens, q, gen)
        first[tokens[0]] += 1
    assert 0.5 * float((first / n - p0).abs().sum()) < 0.05


def test_scorer_edges_have_the_selector_shapes_and_learn():
    scorer = CandidateScorer(vocab_size=50, hidden_size=16, rank=4)
    candidates = torch.randint(0, 50, (K, M))
    edges = scorer.edges(7, candidates, torch.randn(K, 16))
    assert [tuple(e.shape) for e in edges] == [(1, M)] + [(M, M)] * (K - 1)
    assert all(float(e.abs().max()) == 0.0 for e in edges)  # untrained: no transition preference
    sum(e.sum() for e in edges).backward()
    assert scorer.b.weight.grad.abs().sum() > 0  # and it can learn one


def test_batched_greedy_paths_equal_the_per_request_selector():
    """Greedy drafting for many requests at once (the lattice, Viterbi and confidences batched) picks the
    same tokens and reports the same confidences as `select_path` does one request at a time."""
    from pressroom.spec_decode.selector import conditionals_batch, lattice, viterbi_batch
    torch.manual_seed(3)
    vocab, hidden, k, m, b = 50, 16, 5, 4, 6
    scorer = CandidateScorer(vocab, hidden, 8)
    torch.nn.init.normal_(scorer.b.weight)  # trained-like transitions, not the zero start
    slots, logits = torch.randn(b, k, hidden), 3 * torch.randn(b, k, vocab)
    anchors = torch.randint(vocab, (b,))
    with torch.no_grad():
        cand, unary, edges = lattice(scorer, m, slots, logits, anchors)
        path = viterbi_batch(unary, edges)
        confidence = conditionals_batch(unary, edges, path)
        for i in range(b):
            log_p = torch.log_softmax(logits[i], dim=-1)
            u, c = log_p.topk(m, dim=-1)
            one = select_path(c, u, scorer.edges(int(anchors[i]), c, slots[i]), 0.0)
            assert cand[i].gather(1, path[i][:, None])[:, 0].tolist() == one.tokens
            assert torch.allclose(confidence[i], torch.tensor(one.confidence), atol=1e-5)
