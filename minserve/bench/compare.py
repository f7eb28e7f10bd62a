"""``minserve bench compare BASE NEW``: did NEW get faster, slower, or can we not tell yet?

**The unit is the run.** Each side is several runs of one configuration; every run is reduced to
one number per metric (its p90 TTFT, its output throughput, ...) and the test compares those
numbers across runs. We do not pool the requests of all runs into one sample: requests of one run
share that run's conditions (what else the machine was doing, the cache state, the arrival
draw), so they are not independent of each other, and a test that counts each request as a
separate observation reports differences between *runs* as if they were differences between
*builds*. asv and pyperf make the same choice: statistics per process run, compared across runs.

**The rules** (per class and metric; ``direction``: for latencies higher is worse, for
throughput, goodput and SLO attainment lower is worse):

- *regressed* / *improved*: the Mann-Whitney U test (two-sided; exact for up to 10 runs a side
  without ties) gives p < ``alpha`` (0.05), the bootstrap 95 % interval of the ratio
  median(NEW) / median(BASE) excludes 1, and the change is at least ``min_effect`` (5 %);
- *no change*: p >= ``alpha`` and the change is under ``min_effect``, or a difference the test
  finds real but smaller than ``min_effect`` (real, too small to act on);
- *inconclusive*: the change looks at least ``min_effect`` but the test cannot separate it from
  the noise, or the test and the interval disagree, or a side has fewer than ``MIN_RUNS`` runs:
  collect more runs.

Where these come from. asv (airspeed velocity) reports a change only when the ratio passes a
factor (``--factor``, 1.1 by default) *and* its statistical test says the difference is not
noise; pyperf's ``compare_to`` marks differences its significance test cannot confirm as "not
significant" and can hide changes under ``--min-speed``. Chromium's pinpoint uses Mann-Whitney U
with two thresholds: below the low one the samples differ, above the high one they are the same,
and in between it runs more repeats instead of guessing. We take asv's two-part rule (a test *and*
a minimum effect, 5 % rather than 10 % since planted 5-10 % regressions are what a serving change
typically costs), pinpoint's rank test and its third answer, "inconclusive: collect more runs",
and add a bootstrap interval of the ratio so the table says how large the change plausibly is.
With five runs a side the exact test can reach p = 0.008 (every NEW run beyond every BASE run),
so ``alpha`` = 0.05 is attainable; with three a side the smallest p is 0.1 and nothing can be
called a regression, which is why the default is five.

**Refusals.** Results whose manifests differ in workload (name, version, content), model files or
hardware (CPU model, usable cores, GPU) are not compared: the difference would be the traffic or
the machine, not the build. Results without a manifest are not comparable either.
``allow_different=True`` (``--allow-different``) compares anyway and lists the differences.

Exit status: 0 no gated metric regressed (and none inconclusive), 1 a gated metric regressed
beyond noise, 2 inconclusive or not comparable. Gated metrics (``DEFAULT_GATED``): p50 and p90 of
TTFT, TPOT, ITL and E2E, output throughput and goodput; p99s and the rest are shown, not gated:
the p99 of one run of a few dozen requests is one or two requests, too noisy to fail a build on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from minserve.bench.compare_runs import ALL, Run, higher_is_better, load_runs, run_metrics
from minserve.bench.manifest import comparable
from minserve.bench.stats import (bootstrap_paired_ratio_ci, bootstrap_ratio_ci, mann_whitney_p,
                                  relative_change, wilcoxon_signed_rank_p)

ALPHA = 0.05
MIN_EFFECT = 0.05
MIN_RUNS = 3
DEFAULT_RUNS = 5
CI_LEVEL = 0.95
DEFAULT_GATED = tuple(f"p{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in (50, 90)) + (
    "output_throughput", "request_goodput")
IMPROVED, REGRESSED, NO_CHANGE, INCONCLUSIVE = "improved", "regressed", "no change", "inconclusive"
NOT_COMPARABLE = "not comparable"
EXIT = {NO_CHANGE: 0, IMPROVED: 0, REGRESSED: 1, INCONCLUSIVE: 2, NOT_COMPARABLE: 2}


@dataclass(frozen=True)
class Thresholds:
    alpha: float = ALPHA
    min_effect: float = MIN_EFFECT          # 0.05: a change under 5 % is "no change"
    min_runs: int = MIN_RUNS

    def __post_init__(self):
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not 0 <= self.min_effect < 10:
            raise ValueError(f"min_effect must be in [0, 10) (0.05 = 5 %), got {self.min_effect}")
        if self.min_runs < 2:
            raise ValueError(f"min_runs must be >= 2, got {self.min_runs}")


@dataclass
class MetricComparison:
    cls: str
    metric: str
    base: float                 # median over BASE's runs
    new: float
    change: float               # new / base - 1
    ci_low: float               # the interval of the ratio, as a change (ratio - 1)
    ci_high: float
    p_value: float
    n_base: int
    n_new: int
    verdict: str
    gated: bool
    why: str = ""


def judge(base, new, metric: str, th: Thresholds = Thresholds(), seed: int = 0, paired: bool = False) -> tuple:
    """(verdict, why, p, change, ci_low, ci_high) of one metric's per-run values. ``paired``: run i
    of each side was measured next to the other (alternated), so the test is the signed-rank test
    of the per-pair log ratios and the change is their median ratio."""
    base, new = np.asarray(base, float), np.asarray(new, float)
    if paired:
        if len(base) != len(new):
            raise ValueError(f"a paired comparison needs as many NEW runs as BASE runs, got {len(base)} and {len(new)}")
        keep = np.isfinite(base) & np.isfinite(new) & (base > 0) & (new > 0)
        base, new = base[keep], new[keep]
    else:
        base, new = base[np.isfinite(base)], new[np.isfinite(new)]
    if min(len(base), len(new)) < th.min_runs:
        return INCONCLUSIVE, f"fewer than {th.min_runs} runs a side", math.nan, math.nan, math.nan, math.nan
    if paired:
        change = float(np.median(new / base)) - 1
        lo, hi = bootstrap_paired_ratio_ci(base, new, level=CI_LEVEL, seed=seed)
        _, p, _ = wilcoxon_signed_rank_p(np.log(new / base))
    else:
        change = relative_change(float(np.median(base)), float(np.median(new)))
        lo, hi = bootstrap_ratio_ci(base, new, level=CI_LEVEL, seed=seed)
        _, p, _ = mann_whitney_p(new, base)
    worse = (change < 0) if higher_is_better(metric) else (change > 0)
    moved = REGRESSED if worse else IMPROVED
    big = abs(change) >= th.min_effect
    excludes_1 = lo > 1 or hi < 1
    if p < th.alpha and excludes_1 and big:
        return moved, f"p = {p:.3g} < {th.alpha}, interval excludes 1, |change| >= {th.min_effect:.0%}", p, change, lo - 1, hi - 1
    if not big:
        return NO_CHANGE, f"|change| < {th.min_effect:.0%}", p, change, lo - 1, hi - 1
    why = (f"p = {p:.3g} >= {th.alpha}: a {abs(change):.0%} change within the noise" if p >= th.alpha
           else "test and interval disagree")
    return INCONCLUSIVE, why + "; collect more runs", p, change, lo - 1, hi - 1


@dataclass
class Comparison:
    """What :func:`compare` found: ``rows`` (one per class and metric), the refusals, the verdict."""
    rows: list[MetricComparison] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)   # manifest differences
    refused: bool = False
    n_base: int = 0
    n_new: int = 0
    thresholds: Thresholds = Thresholds()
    paired: bool = False        # run i of BASE measured next to run i of NEW (signed-rank test)

    @property
    def verdict(self) -> str:
        if self.refused:
            return NOT_COMPARABLE
        gated = [r.verdict for r in self.rows if r.gated]
        for v in (REGRESSED, INCONCLUSIVE, IMPROVED):
            if v in gated:
                return v
        return NO_CHANGE if gated else INCONCLUSIVE

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def regressions(self) -> list[MetricComparison]:
        return [r for r in self.rows if r.gated and r.verdict == REGRESSED]

    def frame(self):
        """One row per class and metric, as a pandas DataFrame (for notebooks)."""
        import pandas as pd
        return pd.DataFrame([asdict(r) for r in self.rows])

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "refused": self.refused,
                "differences": self.differences, "n_base": self.n_base, "n_new": self.n_new, "paired": self.paired,
                "thresholds": asdict(self.thresholds), "rows": [_json_row(r) for r in self.rows]}

    def table(self) -> str:
        from minserve.bench.compare_report import format_comparison
        return format_comparison(self)


def _json_row(r: MetricComparison) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}


def manifest_differences(base: list[Run], new: list[Run]) -> list[str]:
    """Every reason (once) why a run of either side may not be compared with BASE's first run."""
    if not base or not new:
        return []
    ref = base[0].as_result()
    out: list[str] = []
    for run in base[1:] + new:
        for d in comparable(ref, run.as_result()):
            if d not in out:
                out.append(d)
    return out


def compare(base, new, thresholds: Thresholds = Thresholds(), gated=DEFAULT_GATED,
            allow_different: bool = False, classes: bool = True, seed: int = 0,
            paired: bool = False) -> Comparison:
    """Compare result set ``new`` with ``base`` (paths, directories, result dicts or
    BenchResults; see :mod:`minserve.bench.compare_runs`) metric by metric and class by class.
    ``paired=True``: the two sides were run alternately (BASE, NEW, BASE, NEW, ...), and run i of
    BASE is paired with run i of NEW in the order given (a directory's files by name)."""
    base_runs, new_runs = load_runs(base), load_runs(new)
    if not base_runs or not new_runs:
        raise ValueError(f"each side needs at least one run, got {len(base_runs)} and {len(new_runs)}")
    if paired and len(base_runs) != len(new_runs):
        raise ValueError(f"--paired needs as many NEW runs as BASE runs, got {len(base_runs)} BASE and "
                         f"{len(new_runs)} NEW")
    out = Comparison(n_base=len(base_runs), n_new=len(new_runs), thresholds=thresholds, paired=paired)
    out.differences = manifest_differences(base_runs, new_runs)
    if out.differences and not allow_different:
        out.refused = True
        return out
    per_base = [run_metrics(r) for r in base_runs]
    per_new = [run_metrics(r) for r in new_runs]
    keys = sorted({k for m in per_base for k in m} & {k for m in per_new for k in m},
                  key=lambda k: (k[0] != ALL, k[0], k[1]))
    for cls, metric in keys:
        if not classes and cls != ALL:
            continue
        b = [m.get((cls, metric), math.nan) for m in per_base]
        n = [m.get((cls, metric), math.nan) for m in per_new]
        verdict, why, p, change, lo, hi = judge(b, n, metric, thresholds, seed, paired)
        out.rows.append(MetricComparison(cls, metric, float(np.nanmedian(b)), float(np.nanmedian(n)),
                                         change, lo, hi, p, int(np.isfinite(b).sum()),
                                         int(np.isfinite(n).sum()), verdict, metric in gated, why))
    return out


def dumps(c: Comparison) -> str:
    return json.dumps(c.to_json(), indent=1)
