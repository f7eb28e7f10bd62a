"""TTFT as a timing side channel: probe the prefix cache, and test whether timings differ.

A prefix-cache hit skips the prefill of the cached tokens, so a request whose prompt starts with
a prefix *somebody already sent* gets its first token sooner. If tenants share one cache, a
tenant can therefore learn whether another tenant's prompt began with a given text — a document,
a customer's name, a salary band — by sending that text and timing the first token. The fix is to
give each tenant its own ``cache_salt`` (the salt is part of every block's hash, so different salts
never share a block); ``minserve serve`` does it by default with a salt bound to the tenant.

This module has what a lab needs to show the leak and its fix:

- :func:`probe` runs requests one at a time on an engine (nothing else in flight) and returns each
  one's TTFT from the engine's own records, with the prompt tokens it got from the cache;
- :func:`mann_whitney` (rank test; normal approximation with tie and continuity corrections),
  :func:`permutation_test` (difference of means or medians, exact resampling) and
  :func:`two_sample_test` (either, with a significance level) answer "are these two samples of
  timings from the same distribution?" with numpy alone;
- :func:`plot_groups` draws the two TTFT histograms with the test's verdict.

Why a two-sample test and not "look at the means": an attacker has a handful of noisy
measurements. The test says how often a difference this large would show up by chance if hits
and misses were timed alike; a p-value below ``alpha`` (say 0.01) means the timing separates them.
With per-tenant salts both groups are misses, the distributions are the same, and the test stays
quiet — except in ``alpha`` of runs, which is what a significance level means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minserve.bench.stats import mann_whitney_p
from minserve.bench.stats import mann_whitney_u as u_statistic  # noqa: F401 - lab 04 names it here


# ---- two-sample tests -------------------------------------------------------------------------

@dataclass(frozen=True)
class TestResult:
    """``statistic`` (U of the first sample, or the observed difference), two-sided or one-sided
    ``p_value``, the ``method``, and — from :func:`two_sample_test` — ``alpha`` and whether
    the difference is ``significant`` (p < alpha). ``effect``: median(a) - median(b)."""

    method: str
    statistic: float
    p_value: float
    n_a: int
    n_b: int
    effect: float
    alpha: float = math.nan
    alternative: str = "two-sided"

    @property
    def significant(self) -> bool:
        return bool(self.p_value < self.alpha) if math.isfinite(self.alpha) else False

    def __str__(self) -> str:
        verdict = ""
        if math.isfinite(self.alpha):
            verdict = (f": significant at alpha = {self.alpha:g}" if self.significant
                       else f": not significant at alpha = {self.alpha:g}")
        return (f"{self.method}, n = {self.n_a} vs {self.n_b}, p = {_p(self.p_value)}{verdict}")


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _clean(x, name: str) -> np.ndarray:
    v = np.asarray(x, dtype=float).ravel()
    v = v[np.isfinite(v)]
    if len(v) < 2:
        raise ValueError(f"{name} needs at least 2 finite values, got {len(v)}")
    return v


def mann_whitney(a, b, alternative: str = "two-sided") -> TestResult:
    """The Mann-Whitney U test (Wilcoxon rank-sum) of ``a`` against ``b``.

    U as in :func:`u_statistic`; under the null hypothesis (one distribution for both) it has mean
    n_a n_b / 2 and, with ties, variance n_a n_b / 12 * ((N + 1) - sum(t^3 - t) / (N (N - 1)))
    over the tie groups t. The p-value is the normal approximation with a continuity correction
    (scipy's ``method="asymptotic"``), good from about 8 values per sample. ``alternative``:
    ``"two-sided"``, ``"less"`` (a tends to be smaller) or ``"greater"``."""
    a, b = _clean(a, "a"), _clean(b, "b")
    n1, n2 = len(a), len(b)
    u, p, _ = mann_whitney_p(a, b, alternative, method="asymptotic")
    return TestResult("Mann-Whitney U", u, float(p), n1, n2,
                      float(np.median(a) - np.median(b)), alternative=alternative)


def permutation_test(a, b, statistic: str = "mean", n_resamples: int = 9999, seed: int = 0,
                     alternative: str = "two-sided") -> TestResult:
    """A permutation test of the difference of means (``statistic="mean"``) or medians.

    Under the null hypothesis the labels "a" and "b" are exchangeable: shuffle the pooled values
    ``n_resamples`` times, recompute the difference, and count how often it is at least as
    extreme as the observed one. p = (1 + count) / (1 + n_resamples), so it is never 0 and the
    test keeps its level exactly. Seeded: the same data give the same p."""
    a, b = _clean(a, "a"), _clean(b, "b")
    if statistic not in ("mean", "median"):
        raise ValueError(f"statistic must be 'mean' or 'median', got {statistic!r}")
    if alternative not in ("two-sided", "less", "greater"):
        raise ValueError(f"alternative must be 'two-sided', 'less' or 'greater', got {alternative!r}")
    if n_resamples < 99:
        raise ValueError(f"n_resamples must be >= 99, got {n_resamples}")
    f = np.mean if statistic == "mean" else np.median
    pooled = np.concatenate([a, b])
    n1 = len(a)
    observed = float(f(a) - f(b))
    rng = np.random.default_rng(seed)
    # One permutation per row, all at once: fast enough for 10^4 x a few dozen values.
    idx = np.argsort(rng.random((n_resamples, len(pooled))), axis=1)
    perm = pooled[idx]
    diffs = f(perm[:, :n1], axis=1) - f(perm[:, n1:], axis=1)
    eps = 1e-12 * max(1.0, abs(observed))  # float noise must not decide "at least as extreme"
    if alternative == "two-sided":
        count = int((np.abs(diffs) >= abs(observed) - eps).sum())
    elif alternative == "greater":
        count = int((diffs >= observed - eps).sum())
    else:
        count = int((diffs <= observed + eps).sum())
    p = (1 + count) / (1 + n_resamples)
    return TestResult(f"permutation test ({statistic}s)", observed, float(p), n1, len(b),
                      float(np.median(a) - np.median(b)), alternative=alternative)


def two_sample_test(a, b, alpha: float = 0.01, method: str = "permutation", **kwargs) -> TestResult:
    """Are ``a`` and ``b`` from one distribution? ``method``: ``"permutation"`` (difference of
    means, :func:`permutation_test`) or ``"mann-whitney"``; the result knows ``alpha`` and says
    whether the difference is ``significant``."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if method == "permutation":
        r = permutation_test(a, b, **kwargs)
    elif method in ("mann-whitney", "mannwhitney", "mann_whitney"):
        r = mann_whitney(a, b, **kwargs)
    else:
        raise ValueError(f"method must be 'permutation' or 'mann-whitney', got {method!r}")
    return TestResult(r.method, r.statistic, r.p_value, r.n_a, r.n_b, r.effect, alpha, r.alternative)


# ---- probing an engine ------------------------------------------------------------------------

@dataclass
class Probe:
    """One timed request: ``prompt`` sent with ``cache_salt`` (None: the shared namespace) by
    ``tenant``; ``group`` names what the experiment expects (e.g. "sent by the victim")."""

    prompt: str
    group: str = ""
    tenant: str = ""
    cache_salt: str | None = None
    max_tokens: int = 1


_counter = [0]


def probe(llm, probes: Sequence[Probe], title: str = "probes", live: bool = True):
    """Run ``probes`` one at a time on ``llm`` (an LLM or LLMEngine; nothing else may run on it)
    and return a DataFrame: order, tenant, group, prompt_tokens, cached_tokens, ttft_s (from the
    engine's records: arrival to first token, no client or network in between), e2e_s."""
    import pandas as pd

    from minserve import SamplingParams
    from minserve.lab.live import Progress
    eng = getattr(llm, "llm_engine", llm)
    if eng.has_unfinished_requests():
        raise RuntimeError("the engine still has unfinished requests; a probe must run alone to "
                           "be timed fairly")
    bar = Progress(len(probes), title, "probes", enabled=live)
    rows = []
    for k, p in enumerate(probes):
        _counter[0] += 1
        rid = f"probe-{_counter[0]}"
        eng.add_request(rid, p.prompt, SamplingParams(temperature=0, max_tokens=p.max_tokens,
                                                      ignore_eos=True), cache_salt=p.cache_salt)
        last = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == rid:
                    last = out
        m = last.metrics
        rows.append({"order": k, "tenant": p.tenant, "group": p.group,
                     "prompt_tokens": len(last.prompt_token_ids),
                     "cached_tokens": int(last.num_cached_tokens or 0),
                     "ttft_s": m.ttft_s, "e2e_s": m.e2e_s})
        bar.update(k + 1)
    return pd.DataFrame(rows)


def plot_groups(df, a: str, b: str, test: TestResult | None = None, ax=None, title: str | None = None,
                bins: int = 12):
    """Histograms of ``ttft_s`` (in ms) for ``df.group == a`` and ``== b`` on one axis, medians
    dotted, the test's verdict in the title. Returns the axes."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.4))
    va = df.loc[df.group == a, "ttft_s"].to_numpy(float) * 1000
    vb = df.loc[df.group == b, "ttft_s"].to_numpy(float) * 1000
    both = np.concatenate([va, vb])
    edges = np.linspace(both.min() * 0.95, both.max() * 1.05, bins + 1) if len(both) else bins
    for v, name, color in ((va, a, "tab:red"), (vb, b, "tab:blue")):
        ax.hist(v, bins=edges, alpha=0.55, color=color, label=f"{name} (n={len(v)})")
        if len(v):
            ax.axvline(np.median(v), color=color, ls=":", lw=1.5)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("probes")
    if title is None:
        title = f"{a} vs {b}"
    if test is not None:
        title += f"\n{test}"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    return ax


def timing_attack(llm, sent: Sequence[str], unsent: Sequence[str], *, victim_salt: str | None = None,
                  attacker_salt: str | None = None,
                  victim_suffix: str = "\n\nSummarize the risks in two sentences.",
                  probe_suffix: str = "\nTL;DR:", seed: int = 0, live: bool = True):
    """The experiment of the lab, in two phases on ``llm``:

    1. the victim tenant sends every text of ``sent`` (with its own question after it), with
       ``victim_salt`` as its ``cache_salt``;
    2. the attacker probes every text of ``sent`` and of ``unsent`` once, in a random (seeded)
       order, each followed by ``probe_suffix``, with ``attacker_salt``.

    Returns (victim frame, probe frame) as :func:`probe` makes them; the probes' ``group`` is
    ``"sent by the victim"`` or ``"sent by nobody"``."""
    victim = [Probe(t + victim_suffix, group="victim", tenant="victim", cache_salt=victim_salt,
                    max_tokens=2) for t in sent]
    vdf = probe(llm, victim, title="victim sends its documents", live=live)
    probes = ([Probe(t + probe_suffix, group=SENT, tenant="attacker", cache_salt=attacker_salt)
               for t in sent] +
              [Probe(t + probe_suffix, group=UNSENT, tenant="attacker", cache_salt=attacker_salt)
               for t in unsent])
    order = np.random.default_rng(seed).permutation(len(probes))
    pdf = probe(llm, [probes[i] for i in order], title="attacker probes", live=live)
    return vdf, pdf


SENT, UNSENT = "sent by the victim", "sent by nobody"
