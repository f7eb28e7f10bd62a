"""Where sampling's randomness comes from: a seeded request's noise per output position, and the
CPU's draw of one token from a distribution.

A seeded request's noise for its output token j comes from a generator seeded by (seed, j)
(:func:`noise_seed`), not from one stream that every draw advances. A speculative verify step
draws a row for each proposal and keeps only some of them; with one stream, the draws it threw
away shifted every later token's noise, so the tokens depended on where proposals were made,
which the adaptive rule (spec/adaptive.py) decides from measured step times: two runs of the
same seeded request could differ. Keyed by position, the token at j is drawn with the same noise
whether its row came from a plain decode step or a verify step, so with lookup proposals (exact
by equality, spec/verify.py) a seeded request's tokens are those of decoding without proposals.

On a CPU one token is drawn by inverting the distribution function (:func:`inverse_cdf`): one
float64 uniform a row, where the exponential race needs a vocabulary's worth of noise.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's noise for its output token ``position`` (0: the first):
    SplitMix64's finalizer over the pair, so that neighbouring seeds and positions get unrelated
    streams (``seed + position`` would give request 5's second token the noise of request 6's
    first). In [0, 2**64), torch.Generator.manual_seed's range."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_generator(req, position: int) -> torch.Generator | None:
    """A seeded request's generator for its output token ``position``: a fresh one per row (the
    rows of one verify step are different positions of one request), ~6 us. None for an unseeded
    request (it draws from the sampler's shared generator)."""
    if req.params.seed is None:
        return None
    device = req.generator.device if req.generator is not None else "cpu"
    return torch.Generator(device=device).manual_seed(noise_seed(req.params.seed, position))


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution ``probs`` [V] (any non-negative weights): on a CPU by
    :func:`inverse_cdf` with one float64 uniform from ``generator``, elsewhere ``torch.multinomial``
    (0.075 against 1.03 ms for a 49,152-token row, one thread, Zen 4 EPYC,
    benchmarks/bench_sampler.py). For the draft method's proposals and rejection sampling
    (spec/draft.py, spec/verify.py)."""
    if probs.device.type != "cpu":
        return int(torch.multinomial(probs, 1, generator=generator))
    u = torch.rand(1, dtype=torch.float64, generator=generator)
    return int(inverse_cdf(probs.unsqueeze(0), u))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's token: the first index whose cumulative sum of ``probs[r]`` exceeds ``u[r]`` times
    the row's total, for ``u`` in [0, 1); ``probs`` [R, V] need not sum to 1 (zeros: tokens
    outside top-k / top-p / min-p, never chosen, since the sum does not grow there).

    Exact up to float64 rounding: the sums are float64 (a float32 running sum over 49,152 tokens
    would drift by ~1e-6), and so is u (53 bits). Why not the exponential race on a CPU:
    ``Tensor.exponential_`` computes one logarithm at a time, 0.96 ms per 49,152-token row (one
    thread, Zen 4 EPYC, 2026-12-06, benchmarks/bench_sampler.py), so 16 sampled rows spent ~15 ms
    of every decode step on noise, a third of a 16-row fp32 step; one sampler call over 16 rows at
    temperature 0.8 took 17.7 ms with the race and takes 2.5 with this. A row with no probability
    left (a failed row: its token is not used) gets the last id rather than one past it."""
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1]
    # u * total may round up to total itself (u just under 1), which no sum exceeds: keep the
    # target below it, so the last token with probability is the one found.
    target = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    found = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return found.clamp_max_(probs.shape[-1] - 1)
