"""The release gate: a versioned policy applied to a candidate against the approved baseline.

A policy file (JSON, ``datasets/policies/default.json``) holds, under a ``version``:

- ``performance``: bench compare's thresholds (``alpha``, ``min_effect``, ``min_runs``),
  ``paired`` (the candidate's runs alternated with the baseline's: bench compare ``--paired``), the
  ``gated_metrics`` and ``allowed_regressions`` ({metric: fraction}): a regression beyond noise
  that stays within its allowance (a p90 TTFT 7 % slower where 10 % is allowed) is accepted;
- ``slos``: per class (a workload class name or its priority class, ``interactive`` / ``batch``)
  ``min_slo_attainment``: the median share of the candidate's requests that met their class's SLO;
- ``quality``: the floors of ``minserve eval`` per format (``int8``, ``int4``, ``default``):
  ``max_ppl_increase``, ``max_mean_kl``, ``max_em_drop``, ``min_exact_match``, against the
  reference row of the same eval run.

The two verdicts are separate, each ``pass`` / ``fail`` / ``inconclusive`` (or ``skipped``: no
eval result given), and the decision combines them: any ``fail`` rejects, else any
``inconclusive`` is inconclusive (collect more runs), else approve. Exit status as bench compare:
0 approve, 1 reject, 2 inconclusive.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minserve.bench import compare as cmp
from minserve.bench.compare_runs import load_runs

POLICY_VERSION = 1
PASS, FAIL, INCONCLUSIVE, SKIPPED = "pass", "fail", "inconclusive", "skipped"
APPROVE, REJECT = "approve", "reject"
DECISION_EXIT = {APPROVE: 0, REJECT: 1, INCONCLUSIVE: 2}
QUALITY_KEYS = ("max_ppl_increase", "max_mean_kl", "max_em_drop", "min_exact_match")


def default_policy_path() -> Path:
    here = Path(__file__).resolve().parents[1]
    for p in (here.parent / "datasets" / "policies" / "default.json", here / "datasets" / "policies" / "default.json"):
        if p.is_file():
            return p
    raise FileNotFoundError("the default policy (datasets/policies/default.json) is not installed")


def load_policy(path: str | Path | None = None) -> dict:
    """A policy dict, checked: its version and sections."""
    path = Path(path) if path else default_policy_path()
    policy = json.loads(path.read_text(encoding="utf-8"))
    if policy.get("version") != POLICY_VERSION:
        raise ValueError(f"{path}: policy version must be {POLICY_VERSION}, got {policy.get('version')!r}")
    for section in ("performance", "slos", "quality"):
        if not isinstance(policy.get(section, {}), dict):
            raise ValueError(f"{path}: '{section}' must be an object")
    return policy


@dataclass
class Verdict:
    status: str
    reasons: list[str] = field(default_factory=list)


@dataclass
class GateResult:
    performance: Verdict
    quality: Verdict
    comparison: cmp.Comparison | None = None

    @property
    def decision(self) -> str:
        statuses = (self.performance.status, self.quality.status)
        if FAIL in statuses:
            return REJECT
        return INCONCLUSIVE if INCONCLUSIVE in statuses else APPROVE

    @property
    def exit_code(self) -> int:
        return DECISION_EXIT[self.decision]

    def to_json(self) -> dict:
        return {"decision": self.decision, "exit_code": self.exit_code,
                "performance": vars(self.performance), "quality": vars(self.quality),
                "comparison": None if self.comparison is None else self.comparison.to_json()}

    def report(self) -> str:
        lines = [self.comparison.table(), ""] if self.comparison is not None else []
        for name, v in (("performance", self.performance), ("quality", self.quality)):
            lines.append(f"{name} verdict: {v.status}")
            lines += [f"  - {r}" for r in v.reasons]
        lines.append(f"decision: {self.decision} (exit {self.exit_code})")
        return "\n".join(lines)


def performance_verdict(c: cmp.Comparison, perf: dict, slos: dict, candidate_runs) -> Verdict:
    if c.refused:
        return Verdict(INCONCLUSIVE, [f"not comparable: {d}" for d in c.differences])
    allowed = perf.get("allowed_regressions", {})
    reasons, status = [], PASS
    for r in c.regressions():
        if abs(r.change) <= allowed.get(r.metric, 0.0):
            reasons.append(f"{r.cls} {r.metric} {r.change:+.1%}: a regression within its allowance "
                           f"({allowed[r.metric]:.0%})")
        else:
            status = FAIL
            reasons.append(f"{r.cls} {r.metric} regressed {r.change:+.1%} ({r.why})")
    unsure = [r for r in c.rows if r.gated and r.verdict == cmp.INCONCLUSIVE]
    if unsure and status == PASS:
        status = INCONCLUSIVE
        reasons += [f"{r.cls} {r.metric}: {r.why}" for r in unsure]
    slo_status, slo_reasons = slo_check(slos, candidate_runs)
    if slo_status == FAIL:
        status = FAIL
    return Verdict(status, reasons + slo_reasons)


def slo_check(slos: dict, runs) -> tuple[str, list[str]]:
    """Each class's median SLO attainment over the candidate's runs against its floor."""
    status, reasons = PASS, []
    for key, rule in slos.items():
        floor = rule.get("min_slo_attainment")
        if floor is None:
            continue
        values = [row["slo_attainment"] for run in runs for name, row in (run.summary.get("classes") or {}).items()
                  if key in (name, row.get("priority_class")) and row.get("slo_attainment") is not None]
        if not values:
            continue
        got = float(np.median(values))
        ok = got >= floor
        status = status if ok else FAIL
        reasons.append(f"class {key}: SLO attainment {got:.1%} {'>=' if ok else '<'} floor {floor:.0%}")
    return status, reasons


def quality_verdict(rows: list[dict] | None, floors: dict) -> Verdict:
    """``minserve eval --json`` rows (the first is the reference) against the policy's floors."""
    if rows is None:
        return Verdict(SKIPPED, ["no eval result given (--eval FILE or --run-eval): quality not judged"])
    if not rows:
        return Verdict(INCONCLUSIVE, ["the eval result has no rows"])
    ref, status, reasons = rows[0], PASS, []
    for row in rows[1:] or rows:
        if row.get("error"):
            status = FAIL
            reasons.append(f"{row.get('format')}: not evaluated: {row['error']}")
            continue
        th = floors.get(row.get("quantization") or "", floors.get("default", {}))
        for why in quality_misses(row, ref, th):
            status = FAIL
            reasons.append(f"{row.get('format')}: {why}")
        if status == PASS:
            reasons.append(f"{row.get('format')}: within the floors {th}")
    return Verdict(status, reasons)


def quality_misses(row: dict, ref: dict, th: dict) -> list[str]:
    out = []
    ppl_up = row["perplexity"] / ref["perplexity"] - 1
    if "max_ppl_increase" in th and ppl_up > th["max_ppl_increase"]:
        out.append(f"perplexity {ppl_up:+.2%} > +{th['max_ppl_increase']:.0%}")
    if "max_mean_kl" in th and row["mean_kl"] > th["max_mean_kl"]:
        out.append(f"mean KL {row['mean_kl']:.4f} > {th['max_mean_kl']}")
    drop = ref["exact_match"] - row["exact_match"]
    if "max_em_drop" in th and drop > th["max_em_drop"] + 1e-12:
        out.append(f"exact match {drop:.1%} below the reference > {th['max_em_drop']:.0%}")
    if "min_exact_match" in th and row["exact_match"] < th["min_exact_match"]:
        out.append(f"exact match {row['exact_match']:.1%} < {th['min_exact_match']:.0%}")
    return out


def run_gate(policy: dict, baseline, candidate, eval_rows: list[dict] | None = None,
             allow_different: bool = False, paired: bool | None = None) -> GateResult:
    """The gate in Python: ``baseline`` / ``candidate`` as :func:`minserve.bench.compare.compare`
    takes them, ``eval_rows`` from ``minserve eval --json`` (None: quality skipped); ``paired``
    None takes the policy's ``performance.paired`` (default False)."""
    perf = policy.get("performance", {})
    th = cmp.Thresholds(perf.get("alpha", cmp.ALPHA), perf.get("min_effect", cmp.MIN_EFFECT),
                        perf.get("min_runs", cmp.MIN_RUNS))
    gated = tuple(perf.get("gated_metrics", cmp.DEFAULT_GATED))
    cand_runs = load_runs(candidate)
    paired = perf.get("paired", False) if paired is None else paired
    c = cmp.compare(baseline, cand_runs, th, gated=gated, allow_different=allow_different, paired=paired)
    return GateResult(performance_verdict(c, perf, policy.get("slos", {}), cand_runs),
                      quality_verdict(eval_rows, policy.get("quality", {})), c)
