"""The statistics of a noise-aware comparison, with numpy alone (one home for them).

- :func:`mann_whitney_u` / :func:`mann_whitney_p`: the Mann-Whitney U rank test. Exact for small
  samples without ties (the null distribution of U counted by recursion), otherwise the normal
  approximation with the tie correction of the variance and a continuity correction (what scipy
  calls ``method="asymptotic"``).
- :func:`bootstrap_ratio_ci`: a percentile-bootstrap interval of statistic(NEW) / statistic(BASE).
- :func:`wilcoxon_signed_rank_p`: the Wilcoxon signed-rank test of paired differences (exact by
  enumerating every sign assignment for up to SIGNED_EXACT_MAX_N pairs, ties included; the normal
  approximation above). The test of a *paired* comparison: BASE and NEW run alternately, pair i
  made of the i-th run of each, so a slow spell of the machine that spans a pair cancels out.
- :func:`bootstrap_paired_ratio_ci`: a percentile-bootstrap interval of the median of the per-pair
  ratios NEW_i / BASE_i, resampling pairs.
- :func:`relative_change`: NEW / BASE - 1, the effect size a minimum-effect threshold applies to.

A rank test asks "do the two samples come from one distribution?" without assuming a normal
shape: latencies are skewed and a stalled run is an outlier a t-test would follow. The interval
says how large the change plausibly is, which a p-value alone does not.
"""

from __future__ import annotations

import functools
import math

import numpy as np

EXACT_MAX_N = 10          # exact null distribution when both samples are at most this large
SIGNED_EXACT_MAX_N = 16   # exact signed-rank p-value (2**16 sign assignments) up to this many pairs
ALTERNATIVES = ("two-sided", "less", "greater")


def finite(x, name: str, min_n: int = 2) -> np.ndarray:
    """``x`` as a flat float array of its finite values; at least ``min_n`` of them."""
    v = np.asarray(x, dtype=float).ravel()
    v = v[np.isfinite(v)]
    if len(v) < min_n:
        raise ValueError(f"{name} needs at least {min_n} finite values, got {len(v)}")
    return v


def mann_whitney_u(a, b) -> float:
    """U of ``a``: the number of pairs (x from a, y from b) with x > y, a tie counting one half.
    U ranges from 0 (every a below every b) to len(a) * len(b)."""
    a, b = np.asarray(a, float).ravel(), np.asarray(b, float).ravel()
    diff = a[:, None] - b[None, :]
    return float((diff > 0).sum() + 0.5 * (diff == 0).sum())


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z (erfc is in the standard library)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@functools.cache
def _u_counts(n1: int, n2: int) -> tuple[int, ...]:
    """How many of the C(n1 + n2, n1) orderings give each U = 0 .. n1 n2 (no ties): the largest
    value is either from sample 1 (it beats all n2 others: U gains n2) or from sample 2."""
    if n1 == 0 or n2 == 0:
        return (1,)
    with_1 = _u_counts(n1 - 1, n2)   # largest from sample 1: shift by n2
    with_2 = _u_counts(n1, n2 - 1)
    out = [0] * (n1 * n2 + 1)
    for u, c in enumerate(with_1):
        out[u + n2] += c
    for u, c in enumerate(with_2):
        out[u] += c
    return tuple(out)


def _exact_p(u: float, n1: int, n2: int, alternative: str) -> float:
    counts = np.array(_u_counts(n1, n2), dtype=float)
    total = counts.sum()
    k = int(round(u))
    greater = counts[k:].sum() / total        # P(U >= u)
    less = counts[:k + 1].sum() / total       # P(U <= u)
    if alternative == "greater":
        return float(greater)
    if alternative == "less":
        return float(less)
    return float(min(1.0, 2.0 * min(greater, less)))


def _normal_p(u: float, a: np.ndarray, b: np.ndarray, alternative: str) -> float:
    n1, n2 = len(a), len(b)
    _, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    n = n1 + n2
    tie = float(((counts ** 3) - counts).sum()) / (n * (n - 1))
    var = n1 * n2 / 12.0 * ((n + 1) - tie)
    mu = n1 * n2 / 2.0
    if var <= 0:  # every value equal: no evidence of any difference
        return 1.0
    if alternative == "two-sided":
        z = (abs(u - mu) - 0.5) / math.sqrt(var)
        return min(1.0, 2.0 * normal_sf(max(z, 0.0)))
    if alternative == "greater":
        return normal_sf((u - mu - 0.5) / math.sqrt(var))
    return 1.0 - normal_sf((u - mu + 0.5) / math.sqrt(var))


def mann_whitney_p(a, b, alternative: str = "two-sided", method: str = "auto") -> tuple[float, float, str]:
    """(U of ``a``, p-value, method used). ``alternative``: ``"two-sided"``, ``"less"`` (a tends
    to be smaller) or ``"greater"``. ``method``: ``"exact"``, ``"asymptotic"`` or ``"auto"``
    (exact when both samples have at most EXACT_MAX_N values and no value is tied)."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be 'two-sided', 'less' or 'greater', got {alternative!r}")
    if method not in ("auto", "exact", "asymptotic"):
        raise ValueError(f"method must be 'auto', 'exact' or 'asymptotic', got {method!r}")
    a, b = finite(a, "a"), finite(b, "b")
    u = mann_whitney_u(a, b)
    ties = len(np.unique(np.concatenate([a, b]))) < len(a) + len(b)
    if method == "auto":
        method = "exact" if max(len(a), len(b)) <= EXACT_MAX_N and not ties else "asymptotic"
    if method == "exact":
        if ties:
            raise ValueError("the exact Mann-Whitney p-value needs samples without ties")
        return u, _exact_p(u, len(a), len(b), alternative), "exact"
    return u, float(_normal_p(u, a, b, alternative)), "asymptotic"


def relative_change(base: float, new: float) -> float:
    """NEW / BASE - 1 (+0.10 = 10 % larger); nan when BASE is 0 or either is missing."""
    if not (math.isfinite(base) and math.isfinite(new)) or base == 0:
        return math.nan
    return new / base - 1.0


def bootstrap_ratio_ci(base, new, statistic=np.median, level: float = 0.95, n_resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of statistic(new) / statistic(base): each side resampled
    with replacement on its own (the two sides are independent runs), ``n_resamples`` times."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    base, new = finite(base, "base", 1), finite(new, "new", 1)
    rng = np.random.default_rng(seed)
    bi = rng.integers(0, len(base), size=(n_resamples, len(base)))
    ni = rng.integers(0, len(new), size=(n_resamples, len(new)))
    sb, sn = statistic(base[bi], axis=1), statistic(new[ni], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = sn / sb
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        return math.nan, math.nan
    return _percentile_interval(ratios, level)


def _percentile_interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    """The central ``level`` share of bootstrap ``samples``: the percentile interval."""
    tail = 50 * (1 - level)
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return float(lo), float(hi)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x``, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def wilcoxon_signed_rank_p(diffs, alternative: str = "two-sided") -> tuple[float, float, str]:
    """(W+, p-value, method) of the Wilcoxon signed-rank test that the paired differences ``diffs``
    are centred on 0. Zero differences are dropped (Wilcox's convention, scipy's default); W+ is the
    sum of the ranks of |d| over the positive d. ``alternative``: ``"greater"`` (the differences tend
    to be positive), ``"less"`` or ``"two-sided"``. Exact, ties included, by counting the 2**n sign
    assignments that are equally likely under the null, for n <= SIGNED_EXACT_MAX_N; else the
    normal approximation with the tie correction. With five pairs the smallest two-sided p is
    2/32 = 0.0625, with six 0.031: a paired comparison needs at least six pairs at alpha = 0.05."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be 'two-sided', 'less' or 'greater', got {alternative!r}")
    d = finite(diffs, "diffs", 1)
    d = d[d != 0]
    if not len(d):
        return 0.0, 1.0, "exact"
    r = _ranks(np.abs(d))
    w = float(r[d > 0].sum())
    n = len(d)
    if n <= SIGNED_EXACT_MAX_N:
        signs = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1          # every sign assignment
        null = signs @ r
        eps = 1e-9 * r.sum()                                               # rank sums are k/2 exactly
        ge, le = float(np.mean(null >= w - eps)), float(np.mean(null <= w + eps))
        p = {"greater": ge, "less": le, "two-sided": min(1.0, 2 * min(ge, le))}[alternative]
        return w, p, "exact"
    mean, var = r.sum() / 2, float((r ** 2).sum()) / 4
    z = (w - mean) / math.sqrt(var)
    p = {"greater": normal_sf(z), "less": normal_sf(-z), "two-sided": min(1.0, 2 * normal_sf(abs(z)))}[alternative]
    return w, float(p), "asymptotic"


def bootstrap_paired_ratio_ci(base, new, level: float = 0.95, n_resamples: int = 2000,
                              seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of NEW_i / BASE_i over the pairs: the pairs are
    resampled whole (a pair shares its moment of the machine, so its two runs travel together)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    base, new = np.asarray(base, float).ravel(), np.asarray(new, float).ravel()
    if len(base) != len(new):
        raise ValueError(f"paired samples need equal lengths, got {len(base)} and {len(new)}")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = new / base
    ratios = finite(ratios, "ratios", 1)
    rng = np.random.default_rng(seed)
    boot = np.median(ratios[rng.integers(0, len(ratios), size=(n_resamples, len(ratios)))], axis=1)
    return _percentile_interval(boot, level)
