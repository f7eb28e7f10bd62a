"""The printed table of ``minserve bench compare`` and its command line.

    minserve bench compare results/base/ results/new/          # directories of result files
    minserve bench compare base-run*.json --new new-run*.json  # several files a side
    minserve bench compare BASE NEW --json out.json --allow-different

Exit status: 0 no regression, 1 a gated metric regressed beyond noise, 2 inconclusive (collect
more runs) or not comparable (the manifests differ, or a result has none).
"""

from __future__ import annotations

import argparse
import math
import sys

from minserve.bench import compare as cmp


def _num(v: float, metric: str) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v:.3f}" if metric in ("request_throughput", "request_goodput", "slo_attainment") else f"{v:.1f}"


def _pct(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:+.1%}"


def format_comparison(c: "cmp.Comparison") -> str:
    test = ("paired: run i of each side, signed-rank test of the ratios" if c.paired
            else "the unit is the run")
    lines = [f"bench compare: {c.n_base} BASE runs vs {c.n_new} NEW runs ({test}; "
             f"alpha {c.thresholds.alpha}, minimum effect {c.thresholds.min_effect:.0%})"]
    if c.differences:
        head = "NOT COMPARABLE" if c.refused else "compared anyway (--allow-different)"
        lines.append(f"{head}: the manifests differ:")
        lines += [f"  - {d}" for d in c.differences]
    if c.rows:
        head = ("class", "metric", "BASE", "NEW", "change", "95% CI", "p", "verdict")
        rows = [(r.cls, r.metric + ("" if r.gated else " (shown)"), _num(r.base, r.metric),
                 _num(r.new, r.metric), _pct(r.change), f"[{_pct(r.ci_low)}, {_pct(r.ci_high)}]",
                 "-" if not math.isfinite(r.p_value) else f"{r.p_value:.3f}", r.verdict.upper()
                 if r.verdict == cmp.REGRESSED else r.verdict) for r in c.rows]
        widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
        fmt = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
        lines += [fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    for r in c.regressions():
        lines.append(f"regressed: {r.cls} {r.metric} {_pct(r.change)} ({r.why})")
    lines.append(f"verdict: {c.verdict} (exit {c.exit_code})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minserve bench compare", description=(
        "Compare two result sets (bench serve / bench sweep / in-process result files) metric by "
        "metric, per class, with a rank test across runs and a bootstrap interval of the ratio."),
        epilog="exit status: 0 no regression, 1 regression beyond noise, 2 inconclusive or not comparable")
    ap.add_argument("base", nargs="+", help="BASE result files or directories (then NEW, or use --new)")
    ap.add_argument("--new", nargs="+", default=None, help="NEW result files or directories")
    ap.add_argument("--alpha", type=float, default=cmp.ALPHA, help="significance level (default 0.05)")
    ap.add_argument("--min-effect", type=float, default=cmp.MIN_EFFECT,
                    help="smallest change that counts, as a fraction (default 0.05 = 5 %%)")
    ap.add_argument("--min-runs", type=int, default=cmp.MIN_RUNS, help="fewer runs a side: inconclusive")
    ap.add_argument("--gate", default=",".join(cmp.DEFAULT_GATED),
                    help="comma list of metrics whose verdict sets the exit status")
    ap.add_argument("--allow-different", action="store_true",
                    help="compare even when workload, model or hardware differ (listed)")
    ap.add_argument("--no-classes", action="store_true", help="only the whole run, no per-class rows")
    ap.add_argument("--paired", action="store_true",
                    help="BASE and NEW were run alternately: pair run i of each side (in the order given; a "
                         "directory's files by name) and test the per-pair ratios (signed-rank): a slow spell "
                         "of the machine that spans a pair cancels out. Needs as many runs a side, at least 6")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the comparison as JSON ('-': stdout)")
    return ap


def split_sides(a) -> tuple[list[str], list[str]]:
    if a.new:
        return a.base, a.new
    if len(a.base) != 2:
        raise ValueError("give BASE NEW (two paths), or BASE... --new NEW...")
    return [a.base[0]], [a.base[1]]


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        base, new = split_sides(a)
        th = cmp.Thresholds(a.alpha, a.min_effect, a.min_runs)
        c = cmp.compare(base, new, th, gated=tuple(m for m in a.gate.split(",") if m),
                        allow_different=a.allow_different, classes=not a.no_classes, paired=a.paired)
    except (ValueError, FileNotFoundError) as e:
        print(f"minserve bench compare: {e}", file=sys.stderr)
        return 2
    if a.json == "-":
        print(cmp.dumps(c))
    else:
        print(c.table())
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                f.write(cmp.dumps(c))
    return c.exit_code


if __name__ == "__main__":
    sys.exit(main())
