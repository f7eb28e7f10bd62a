"""When each request is sent: the arrival process of ``vllm bench serve``.

Gaps between requests are drawn from a gamma distribution with shape ``burstiness`` and mean
``1 / request_rate``. Shape 1 is the exponential distribution, i.e. a Poisson process; a shape
below 1 gives the same mean rate with more clumping (coefficient of variation ``1/sqrt(shape)``),
a shape above 1 gives more evenly spaced requests, and ``inf`` a fixed interval. A rate of ``inf``
sends every request at t = 0.

Like vLLM, the cumulative times are then rescaled so the last request is sent exactly at
``n / request_rate``: a sum of random gaps misses that target by a few percent, and the rescale
keeps the offered load (and so throughput figures) comparable between seeds.
"""

from __future__ import annotations

import math

import numpy as np


def check_rate(request_rate: float, burstiness: float) -> None:
    if not (request_rate > 0):
        raise ValueError(f"request_rate must be > 0 (or inf for all at once), got {request_rate}")
    if not (burstiness > 0):
        raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0,
                  seed: int | None = 0) -> np.ndarray:
    """Send times in seconds after the start of the run, one per request, non-decreasing."""
    check_rate(request_rate, burstiness)
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if n == 0 or math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        # Gamma with shape k and scale 1/(rate*k) has mean 1/rate whatever k is.
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times
