"""Sweep results as DataFrames and figures, for the CLI (``sweep plot``, ``plot_pareto``) and
notebooks alike.

:func:`load_results` reads a sweep's output directory (or any directory of ``bench serve`` result
files) into one row per run: the combination's parameters, vLLM's summary keys, each request
class's latency and SLO attainment (``<class>.p99_ttft_ms``...), and what the manifest says. It
checks every run's manifest against the first one's (:func:`minserve.bench.manifest.comparable`)
and says so, on stderr and in the ``not_comparable`` column, when runs cannot be compared (results
without a manifest cannot).

Derived columns: ``tokens_per_s_per_user`` = 1000 / median TPOT, the streaming speed a typical
user sees (vLLM's plot_pareto divides throughput by a concurrency instead, which an open-loop run
at a request rate does not have); ``request_rate`` as a float (``inf``: everything at once).

Figures are matplotlib ``Figure`` objects built without pyplot, so nothing changes a notebook's
backend; they show in Jupyter and are saved as PNG when given a path.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

SUMMARY_KEYS = ("request_rate", "burstiness", "max_concurrency", "num_prompts", "completed", "failed",
                "duration", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "max_concurrent_requests", "max_output_tokens_per_s")
STAT_KEYS = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99"))
CLASS_KEYS = ("completed", "failed", "slo_attainment", "request_goodput", "median_ttft_ms",
              "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms")
_RUN = re.compile(r"^run=(\d+)\.json$")


def _labels(name: str) -> tuple[str, str]:
    serve, _, bench = name.partition("-BENCH--")
    return serve.removeprefix("SERVE--"), bench


def _params(row: dict, serve: dict, bench: dict) -> None:
    for key, value in serve.items():
        row[f"serve.{key}" if key in bench else key] = value
    for key, value in bench.items():
        row[f"bench.{key}" if key in serve else key] = value


def _run_row(path: Path, result: dict, combination: str, run: int) -> dict:
    serve_label, bench_label = _labels(combination)
    row = {"combination": combination, "serve_label": serve_label, "bench_label": bench_label,
           "run": run, "status": "ok", "stage": "", "reason": "", "file": str(path)}
    _params(row, result.get("serve_params") or {}, result.get("bench_params") or {})
    row.update({k: result.get(k) for k in (*SUMMARY_KEYS, *STAT_KEYS) if k in result})
    for cls, stats in (result.get("classes") or {}).items():
        row.update({f"{cls}.{k}": stats.get(k) for k in CLASS_KEYS})
    m = result.get("manifest") or {}
    row.update(has_manifest=bool(m), workload=(m.get("workload") or {}).get("name"),
               workload_version=(m.get("workload") or {}).get("version"),
               prefix_cache_reset=(m.get("server") or {}).get("prefix_cache_reset"),
               others_cores=(m.get("load") or {}).get("others_cores"))
    return row


def _failed_rows(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    combination = doc.get("sweep_combination", path.parent.name)
    serve_label, bench_label = _labels(combination)
    rows = []
    for f in doc.get("failures", []):
        for run in f.get("runs") or [None]:
            row = {"combination": combination, "serve_label": serve_label, "bench_label": bench_label,
                   "run": run, "status": "failed", "stage": f.get("stage"), "reason": f.get("reason"),
                   "file": str(path), "has_manifest": False}
            _params(row, doc.get("serve_params") or {}, doc.get("bench_params") or {})
            rows.append(row)
    return rows


def _result_files(out: Path) -> list[tuple[Path, str, int]]:
    sweep = [(p, p.parent.name, int(_RUN.match(p.name).group(1)))
             for p in sorted(out.glob("SERVE--*/run=*.json")) if _RUN.match(p.name)]
    if sweep:
        return sweep
    # Not a sweep: a directory of `bench serve --save-result` files, one "combination" each.
    return [(p, p.stem, 0) for p in sorted(out.glob("*.json")) if p.name not in ("manifest.json", "summary.json")]


def load_results(output_dir: str | Path) -> "pd.DataFrame":
    """One row per run of the sweep in ``output_dir`` (module docstring), failed ones included."""
    import pandas as pd
    from minserve.bench.manifest import comparable
    out = Path(output_dir)
    if not out.is_dir():
        raise ValueError(f"no sweep results under {out}")
    rows, manifests = [], []
    for path, combination, run in _result_files(out):
        result = json.loads(path.read_text())
        if "completed" not in result:
            continue  # not a result file
        rows.append(_run_row(path, result, combination, run))
        manifests.append(result)
    for path in sorted(out.glob("SERVE--*/failed.json")):
        rows.extend(_failed_rows(path))
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    reasons = ["; ".join(comparable(manifests[0], m)) for m in manifests]
    df["not_comparable"] = reasons + [""] * (len(df) - len(reasons))
    bad = df[df.not_comparable != ""]
    if len(bad):
        print(f"warning: {len(bad)} of {len(manifests)} runs in {out} are not comparable with "
              f"{df.combination.iloc[0]} run {df.run.iloc[0]}: {bad.not_comparable.iloc[0]}", file=sys.stderr)
    if "request_rate" in df:
        df["request_rate"] = df["request_rate"].map(_rate)
    if "median_tpot_ms" in df:
        tpot = pd.to_numeric(df["median_tpot_ms"], errors="coerce")
        df["tokens_per_s_per_user"] = (1000.0 / tpot).where(tpot > 0)
    return df


def _rate(value) -> float:
    """A result's request_rate as a number ("inf" is vLLM's spelling of all at once)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def aggregate(df: "pd.DataFrame") -> "pd.DataFrame":
    """One row per combination over its successful runs: the median of every number, and
    ``n_runs``; ``<col>_min`` / ``<col>_max`` for the columns a plot draws error bars from."""
    ok = df[df.status == "ok"]
    if ok.empty:
        return ok
    numeric = ok.select_dtypes("number").columns.drop("run", errors="ignore")
    keys = ["combination", "serve_label", "bench_label"]
    g = ok.groupby(keys, sort=False)
    agg = g[list(numeric)].median().reset_index()
    spread = g[list(numeric)].agg(["min", "max"])
    spread.columns = [f"{c}_{s}" for c, s in spread.columns]
    agg = agg.merge(spread.reset_index(), on=keys)
    agg["n_runs"] = g.size().values
    first = g.first().reset_index()
    for col in ok.columns.difference(agg.columns):
        agg[col] = first[col].values
    return agg


def pareto_frame(df: "pd.DataFrame", x: str = "output_throughput",
                 y: str = "tokens_per_s_per_user") -> "pd.DataFrame":
    """:func:`aggregate`'s rows with ``on_frontier``: no other combination is at least as good in
    both ``x`` and ``y`` (both larger-is-better) and better in one."""
    agg = aggregate(df)
    if agg.empty or x not in agg or y not in agg:
        raise ValueError(f"no successful runs with both {x!r} and {y!r} to put on a Pareto front")
    agg = agg.dropna(subset=[x, y]).sort_values([x, y], ascending=False).reset_index(drop=True)
    best_y, frontier = -math.inf, []
    for value in agg[y]:  # by x descending: on the front when better than every point to its right
        frontier.append(value > best_y)
        best_y = max(best_y, value)
    agg["on_frontier"] = frontier
    return agg.sort_values(x).reset_index(drop=True)


def _figure(title: str):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot(df: "pd.DataFrame", x: str = "request_rate", y: str = "p99_ttft_ms",
         curve_by: str | list[str] = "serve_label", path: str | Path | None = None, title: str | None = None):
    """``y`` against ``x`` (default: p99 TTFT against offered load), one curve per ``curve_by``
    value, the median of the runs with their min-max as error bars. Points at x = inf are left
    out (the title says how many)."""
    agg = aggregate(df)
    if agg.empty or x not in agg or y not in agg:
        raise ValueError(f"no successful runs with both {x!r} and {y!r} to plot")
    finite = agg[agg[x].apply(lambda v: isinstance(v, (int, float)) and math.isfinite(v))]
    dropped = len(agg) - len(finite)
    fig, ax = _figure(title or f"{y} against {x}" + (f" ({dropped} points at {x}=inf left out)" if dropped else ""))
    by = [curve_by] if isinstance(curve_by, str) else list(curve_by)
    for label, part in finite.groupby(by, sort=True):
        part = part.sort_values(x)
        err = [part[y] - part[f"{y}_min"], part[f"{y}_max"] - part[y]] if f"{y}_min" in part else None
        ax.errorbar(part[x], part[y], yerr=err, marker="o", capsize=3,
                    label=", ".join(map(str, label)) if isinstance(label, tuple) else str(label))
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_pareto(df: "pd.DataFrame", x: str = "output_throughput", y: str = "tokens_per_s_per_user",
                label_by: str = "combination", path: str | Path | None = None):
    """Every combination at (``x``, ``y``), the Pareto front drawn through the best ones."""
    frame = pareto_frame(df, x, y)
    fig, ax = _figure(f"Pareto front: {y} against {x}")
    ax.scatter(frame[x], frame[y], color="0.6", label="combination")
    front = frame[frame.on_frontier]
    ax.plot(front[x], front[y], "o-", color="C3", label="Pareto front")
    middle = (frame[x].min() + frame[x].max()) / 2
    for _, row in front.iterrows():  # labels lean inwards, so the right-most stays in the figure
        right = row[x] > middle
        ax.annotate(str(row[label_by])[:48], (row[x], row[y]), fontsize=6, xytext=(-3 if right else 3, 3),
                    textcoords="offset points", ha="right" if right else "left")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path):
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def write_default_plots(df: "pd.DataFrame", fig_dir: str | Path) -> list[Path]:
    """The sweep's standard figures: p99 TTFT against offered load, and the Pareto fronts of
    tokens/s per user and of goodput against output tokens/s, each where the data allows."""
    fig_dir, written = Path(fig_dir), []
    jobs = [("p99_ttft_vs_request_rate.png", plot, {"x": "request_rate", "y": "p99_ttft_ms"}),
            ("pareto_tokens_per_s_per_user.png", plot_pareto, {"y": "tokens_per_s_per_user"}),
            ("pareto_request_goodput.png", plot_pareto, {"y": "request_goodput"})]
    for name, fn, kw in jobs:
        try:
            fn(df, path=fig_dir / name, **kw)
        except (ValueError, KeyError, TypeError):
            continue  # e.g. no goodput without SLOs, no finite rate: that figure has no data
        written.append(fig_dir / name)
    return written
