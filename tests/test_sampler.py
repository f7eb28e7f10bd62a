"""Behaviour of the batched sampler: greedy, bans, exact distributions, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

import minserve.engine.sampler as sampler_mod
from minserve.engine.sampler import Sampler, SamplingBatch, make_generator
from minserve.sampling_params import SamplingParams

LOGITS6 = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
# Chi-square critical values at p = 1e-6 for 1..5 degrees of freedom. The draws are seeded, so a
# pass is deterministic; the tiny alpha only guards against a seed that happens to be unlucky.
CHI2_CRIT = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89}


def _batch(params: list[SamplingParams], banned: list[list[int]] | None = None,
           generators: list | None = None) -> SamplingBatch:
    return SamplingBatch(params=params,
                         generators=generators or [make_generator(p) for p in params],
                         banned_token_ids=banned or [[] for _ in params])


def _target(logits: list[float], p: SamplingParams) -> list[float]:
    """Exact (float64) distribution after temperature, min-p, top-k, top-p (vLLM V1's order)."""
    z = [x / p.temperature for x in logits]
    full = _softmax(z)
    z = [x if q >= p.min_p * max(full) else -math.inf for x, q in zip(z, full)]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    order = [i for i in order if z[i] != -math.inf]
    keep = set(order[:p.top_k] if p.top_k > 0 else order)
    probs = _softmax([z[i] if i in keep else -math.inf for i in range(len(z))])
    above = 0.0  # mass of tokens strictly more likely than the current one
    for i in order:
        if i in keep and above >= p.top_p:
            keep.discard(i)
        # A top_p sitting on a cumulative boundary would make the test depend on rounding.
        assert abs(above - p.top_p) > 1e-3 or p.top_p == 1.0
        above += probs[i]
    return _softmax([z[i] if i in keep else -math.inf for i in range(len(z))])


def _softmax(z: list[float]) -> list[float]:
    m = max(z)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in z]
    return [x / sum(e) for x in e]


def _assert_matches(tokens: list[int], target: list[float]) -> None:
    counts = [0] * len(target)
    for t in tokens:
        counts[t] += 1
    n = len(tokens)
    support = [i for i, q in enumerate(target) if q > 0]
    for i, q in enumerate(target):
        if q == 0:
            assert counts[i] == 0, f"token {i} is outside the allowed set, drawn {counts[i]}x"
    if len(support) == 1:
        return
    chi2 = sum((counts[i] - n * target[i]) ** 2 / (n * target[i]) for i in support)
    assert chi2 < CHI2_CRIT[len(support) - 1], (chi2, counts, [round(n * q) for q in target])


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = Sampler()(logits, _batch([SamplingParams(temperature=0.0)] * 5))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.ranks is None
    assert torch.equal(logits, before)


def test_banned_tokens_are_never_chosen():
    logits = torch.tensor([LOGITS6] * 2000)
    banned = [[0, 2]] * 2000
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=2.0)] * 1999
    out = Sampler(torch.Generator().manual_seed(1))(logits, _batch(params, banned))
    assert out.token_ids[0] == 1  # greedy falls to the best allowed token
    assert not {0, 2} & set(out.token_ids)
    assert {1, 3, 4, 5} <= set(out.token_ids)  # the rest still gets sampled


def test_top_k_one_equals_greedy():
    logits = torch.randn(50, 100, generator=torch.Generator().manual_seed(2))
    out = Sampler(torch.Generator().manual_seed(3))(
        logits, _batch([SamplingParams(temperature=5.0, top_k=1)] * 50))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(50, 100, generator=torch.Generator().manual_seed(4))
    out = Sampler(torch.Generator().manual_seed(5))(
        logits, _batch([SamplingParams(top_p=1e-6)] * 50))
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
    dict(temperature=2.0, top_k=-1, top_p=0.5),
])
def test_distribution_matches_exact_math(kwargs):
    p = SamplingParams(**kwargs)
    n = 10_000
    out = Sampler(torch.Generator().manual_seed(6))(torch.tensor([LOGITS6] * n), _batch([p] * n))
    _assert_matches(out.token_ids, _target(LOGITS6, p))


def test_mixed_batch_each_row_gets_its_own_distribution():
    # Interleave configs (and greedy rows) so any row mix-up in the vectorized masks shows up.
    configs = [SamplingParams(top_k=2), SamplingParams(top_p=0.7, temperature=1.5),
               SamplingParams(min_p=0.3), SamplingParams(temperature=0.0),
               SamplingParams(temperature=3.0, seed=7)]
    reps = 3000
    params = configs * reps
    generators = [torch.Generator().manual_seed(100 + i) if p.seed is not None else None
                  for i, p in enumerate(params)]
    logits = torch.tensor([LOGITS6] * len(params))
    out = Sampler(torch.Generator().manual_seed(8))(logits, _batch(params, generators=generators))
    for c, p in enumerate(configs):
        _assert_matches(out.token_ids[c::len(configs)], _target(LOGITS6, p) if not p.is_greedy
                        else [1.0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.97])
def test_nucleus_window_and_its_fallback_are_exact(monkeypatch, top_p):
    # With a 2-token window and a 3-token wide one, top_p=0.5 fits in the first, 0.8 in the
    # second, 0.97 needs the full-sort fallback; mixing a second logits row whose nucleus is
    # narrower puts two paths in one call.
    monkeypatch.setenv("MINSERVE_SAMPLER_FILTERS", "torch")   # the windows, not kernels/nucleus.c
    monkeypatch.setattr(sampler_mod, "NUCLEUS_WINDOW", 2)
    monkeypatch.setattr(sampler_mod, "NUCLEUS_WIDE_WINDOW", 3)
    sharp = [4.0, 1.0, 0.5, 0.0, -0.5, -1.0]
    n = 6000
    p = SamplingParams(top_p=top_p)
    logits = torch.tensor([LOGITS6, sharp] * n)
    out = Sampler(torch.Generator().manual_seed(13))(logits, _batch([p] * (2 * n)))
    _assert_matches(out.token_ids[0::2], _target(LOGITS6, p))
    _assert_matches(out.token_ids[1::2], _target(sharp, p))


def _run_steps(sampler: Sampler, rows: list[tuple[torch.Tensor, SamplingParams, object]],
               steps: int, watch: int) -> list[int]:
    """Sample ``steps`` times from the same rows; return the tokens of row ``watch``."""
    seen = []
    for _ in range(steps):
        logits = torch.stack([r[0] for r in rows])
        batch = SamplingBatch([r[1] for r in rows], [r[2] for r in rows], [[] for _ in rows])
        seen.append(sampler(logits, batch).token_ids[watch])
    return seen


def test_seed_gives_same_tokens_whatever_the_batch():
    vocab = 64
    gen = torch.Generator().manual_seed(9)
    mine = torch.randn(vocab, generator=gen) * 0.5  # flat enough that draws vary
    others = [torch.randn(vocab, generator=gen) for _ in range(4)]
    p = SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=1234)

    alone = _run_steps(Sampler(), [(mine, p, make_generator(p))], steps=8, watch=0)
    crowd = [(others[0], SamplingParams(), None),
             (others[1], SamplingParams(seed=5, top_k=10), make_generator(SamplingParams(seed=5))),
             (mine, p, make_generator(p)),
             (others[2], SamplingParams(temperature=0.0), None),
             (others[3], SamplingParams(min_p=0.1, temperature=0.5, top_p=0.9), None),
             (others[0], SamplingParams(top_k=50, seed=3), make_generator(SamplingParams(seed=3)))]
    in_batch = _run_steps(Sampler(torch.Generator().manual_seed(10)), crowd, steps=8, watch=2)
    assert alone == in_batch
    assert len(set(alone)) > 1

    other_seed = SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=4321)
    different = _run_steps(Sampler(), [(mine, other_seed, make_generator(other_seed))],
                           steps=8, watch=0)
    assert different != alone


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(11)) * 3
    params = [SamplingParams(temperature=0.5, logprobs=3),  # scaled + banned: logprobs stay raw
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0),  # did not ask
              SamplingParams(top_k=4, logprobs=20)]
    banned = [[int(logits[0].argmax())], [], [], []]
    out = Sampler(torch.Generator().manual_seed(12))(logits, _batch(params, banned))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.ranks is not None
    assert out.logprobs[2] == []
    for i, p in enumerate(params):
        tok = out.token_ids[i]
        rank = int((ref[i] > ref[i, tok]).sum()) + 1
        assert out.ranks[i] == rank
        if p.logprobs is None:
            continue
        row = out.logprobs[i]
        assert len(row) == 1 + p.logprobs
        assert row[0][0] == tok and row[0][1] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        vals, ids = ref[i].topk(p.logprobs)
        assert [t for t, _ in row[1:]] == ids.tolist()
        assert [v for _, v in row[1:]] == pytest.approx(vals.tolist(), abs=1e-5)
    assert out.ranks[0] >= 2  # the raw argmax was banned, so row 0 sampled something else


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b.params.pop(), "params"),
    (lambda b: b.generators.pop(), "generators"),
    (lambda b: b.banned_token_ids.pop(), "banned_token_ids"),
    (lambda b: b.banned_token_ids.__setitem__(0, [6]), "banned_token_ids"),
    (lambda b: b.banned_token_ids.__setitem__(0, list(range(6))), "banned_token_ids"),
])
def test_bad_batch_raises_value_error(mutate, field):
    batch = _batch([SamplingParams()] * 2)
    mutate(batch)
    with pytest.raises(ValueError, match=field):
        Sampler()(torch.tensor([LOGITS6] * 2), batch)


def test_noise_seeds_differ_by_seed_and_by_position_and_fit_torchs_range():
    from minserve.engine.draws import noise_seed
    seeds = {noise_seed(s, j) for s in (-3, 0, 5, 6, 2**64 - 1) for j in range(50)}
    assert len(seeds) == 5 * 50                      # seed + position would collide (5, 1) with (6, 0)
    assert all(0 <= x < 2**64 for x in seeds)
    assert noise_seed(5, 1) == noise_seed(5, 1)


def test_inverse_cdf_never_picks_a_token_without_probability_even_at_the_ends():
    from minserve.engine.draws import inverse_cdf
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.5, 0.25, 0.0],     # zeros inside and at both ends
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])       # a failed row: any valid id
    first, last = torch.tensor([0.0, 0.0]), torch.tensor([1 - 2**-53, 1 - 2**-53])
    assert inverse_cdf(probs, first).tolist() == [1, 6]
    assert inverse_cdf(probs, last).tolist() == [5, 6]
    assert inverse_cdf(probs, torch.tensor([0.25, 0.5])).tolist() == [4, 6]   # boundaries go right
    assert inverse_cdf(probs * 3, torch.tensor([0.2, 0.5])).tolist() == [1, 6]  # unnormalized rows


def test_distribution_over_a_full_vocabulary_matches_exact_math():
    # A 49,152-token row (SmolLM2's vocabulary) whose mass sits in five tokens spread over it, the
    # last one at the end, with a floor of tiny probabilities everywhere else: a float32 running sum
    # or a lost tail would show as a departure here.
    V, hot = 49152, [3, 1000, 20000, 40000, 49151]
    logits = torch.full((V,), -12.0)
    logits[hot] = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2])
    exact = torch.softmax(logits.double(), dim=0)
    n = 4000
    out = Sampler(torch.Generator().manual_seed(9))(logits.expand(n, V).contiguous(),
                                                    _batch([SamplingParams(temperature=1.0)] * n))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=V).double()
    cold = exact.clone()
    cold[hot] = 0
    observed = [*counts[hot].tolist(), n - counts[hot].sum().item()]
    expected = [*(n * exact[hot]).tolist(), n * cold.sum().item()]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < CHI2_CRIT[5], (observed, [round(e, 1) for e in expected])
