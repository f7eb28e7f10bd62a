"""Verification never changes the output distribution: exact math, checked by sampling.

Small vocabulary, random target distributions p_i and draft distributions q_i per position. The
tokens a verify step returns must be distributed as the target's: the first token as p_0, and the
second (given that the first proposal was kept) as p_1. The total-variation distance of the
empirical distribution from p must shrink like 1 / sqrt(n) (sampling noise alone), and must stay
large for a deliberately broken verifier (resampling from p instead of the residual after a
refusal) — so the test can fail.
"""

from __future__ import annotations

import math

import torch

from minserve.spec.verify import accept_one_hot, rejection_sample

V = 6


def _dists(seed: int, k: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)
    return p, q


def broken_rejection_sample(p, q, proposals, generator=None):
    """Keeps with min(1, p/q) but then draws from p, not from the residual: biased toward q."""
    out = []
    for i, d in enumerate(proposals):
        if torch.rand((), generator=generator) * q[i][d] <= p[i][d]:
            out.append(d)
            continue
        out.append(int(torch.multinomial(p[i], 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(proposals)], 1, generator=generator)))
    return out


def _tv_first_two(verify, p, q, n: int, seed: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(n):
        proposals = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        out = verify(p, q, proposals, g)
        first[out[0]] += 1
        if len(out) >= 2:   # the first proposal was kept: the second token comes from row 1
            second[out[1]] += 1
    tv1 = 0.5 * (first / first.sum() - p[0]).abs().sum().item()
    tv2 = 0.5 * (second / second.sum() - p[1]).abs().sum().item()
    return tv1, tv2


def test_rejection_sampling_gives_the_target_distribution():
    p, q = _dists(0, k=2)
    small, large = 1000, 16000
    tv_small = _tv_first_two(rejection_sample, p, q, small, 1)
    tv_large = _tv_first_two(rejection_sample, p, q, large, 2)
    # Sampling noise of a V-outcome distribution: E[TV] is about sqrt(V / (2 pi n)).
    bound = lambda n: 3 * math.sqrt(V / (2 * math.pi * n))  # noqa: E731
    assert tv_small[0] < bound(small) and tv_large[0] < bound(large), (tv_small, tv_large)
    assert tv_large[1] < 2 * bound(large / 3), tv_large   # fewer samples reach the second row
    assert tv_large[0] < tv_small[0] + 0.005, "the distance must shrink with the sample count"
    broken = _tv_first_two(broken_rejection_sample, p, q, large, 3)
    assert broken[0] > 3 * bound(large) and broken[0] > 8 * tv_large[0], \
        f"a biased verifier must be caught: {broken} vs {tv_large}"


def test_one_hot_rule_keeps_draws_until_the_first_disagreement():
    assert accept_one_hot([5, 6, 7], [5, 6, 7, 8]) == 4
    assert accept_one_hot([5, 6, 7], [5, 9, 7, 8]) == 2
    assert accept_one_hot([5], [4, 1]) == 1
    assert accept_one_hot([], [3]) == 1


def test_one_hot_proposals_give_the_target_distribution():
    """A one-hot draft through rejection sampling equals 'draw from p, keep if equal'."""
    p, _ = _dists(4, k=1)
    d = 2
    q = torch.zeros(1, V)
    q[0, d] = 1.0
    g = torch.Generator().manual_seed(5)
    n, counts = 8000, torch.zeros(V)
    for _ in range(n):
        counts[rejection_sample(p, q, [d], g)[0]] += 1
    tv = 0.5 * (counts / n - p[0]).abs().sum().item()
    assert tv < 3 * math.sqrt(V / (2 * math.pi * n))
