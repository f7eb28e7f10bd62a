"""Result sets for ``minserve bench compare``: read runs from files, directories or objects, and
turn each run into one number per (class, metric).

A run is one benchmark result: a ``minserve bench serve --save-result`` file, a sweep's
``run=K.json`` (``minserve bench sweep``), or a :class:`~minserve.bench.results.BenchResult` of
the in-process runner. A side of a comparison is several runs of one configuration; a directory
stands for every result file under it (the sweep's ``manifest.json`` and ``failed.json`` are not
results and are skipped).

Each run gives, per class (``"all"`` for the whole run, and each request class of a workload
file): p50 / p90 / p99 of TTFT, TPOT, ITL and E2E in ms, computed from the run's own request
records (so every percentile exists whatever ``--metric-percentiles`` the run was saved with), and
the run's request and output throughput, goodput and SLO attainment.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minserve.bench.metrics import MS_PER_S

ALL = "all"
PERCENTILES = (50, 90, 99)
LATENCIES = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2el_s"}
# Higher is better for these; for every latency lower is better.
RATES = ("request_throughput", "output_throughput", "request_goodput", "slo_attainment")
NOT_RESULTS = ("manifest.json", "failed.json")


@dataclass
class Run:
    """One benchmark run: its summary (vLLM's keys), request records and manifest."""
    summary: dict
    requests: list[dict]
    manifest: dict | None
    source: str = "?"

    def as_result(self) -> dict:
        """The result dict :func:`minserve.bench.manifest.comparable` reads."""
        return {"manifest": self.manifest} if self.manifest is not None else {}


def run_from(obj, source: str = "?") -> Run:
    """A :class:`Run` from a result dict (as in a result file) or a ``BenchResult``."""
    if hasattr(obj, "summary") and hasattr(obj, "requests"):   # BenchResult of run_inprocess
        frame = obj.requests
        records = frame.to_dict(orient="records") if hasattr(frame, "to_dict") else list(frame)
        return Run(dict(obj.summary), records, obj.manifest, source)
    if not isinstance(obj, dict) or "completed" not in obj:
        raise ValueError(f"{source}: not a benchmark result (no 'completed' key)")
    return Run(obj, list(obj.get("requests") or []), obj.get("manifest"), source)


def _natural_key(p: Path) -> list:
    """``run=2.json`` before ``run=10.json``: digits compare as numbers (a paired compare matches
    runs by this order)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def result_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted((p for p in path.rglob("*.json") if p.name not in NOT_RESULTS), key=_natural_key)
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no such result file or directory: {path}")


def load_runs(sources) -> list[Run]:
    """Every run in ``sources``: paths (files or directories), result dicts or BenchResults."""
    if isinstance(sources, (str, Path)) or not isinstance(sources, (list, tuple)):
        sources = [sources]
    runs = []
    for src in sources:
        if not isinstance(src, (str, Path)):
            runs.append(run_from(src, f"object {len(runs)}"))
            continue
        for f in result_files(Path(src)):
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ValueError(f"{f}: not JSON ({e})") from None
            runs.append(run_from(data, str(f)))
    return runs


def _values(records: list[dict], column: str) -> np.ndarray:
    out: list[float] = []
    for r in records:
        if not r.get("success", True):
            continue
        v = r.get(column)
        if isinstance(v, list):         # ITL: every gap of every request, pooled (vLLM's ITL)
            out.extend(float(x) for x in v if x is not None)
        elif v is not None and not (isinstance(v, float) and math.isnan(v)):
            out.append(float(v))
    return np.asarray(out, dtype=float)


def latency_stats(records: list[dict]) -> dict[str, float]:
    """``{"p50_ttft_ms": ..., "p99_e2el_ms": ...}`` over the successful requests given."""
    out = {}
    for name, column in LATENCIES.items():
        v = _values(records, column)
        if len(v):
            for p in PERCENTILES:
                out[f"p{p}_{name}_ms"] = float(np.percentile(v, p)) * MS_PER_S
    return out


def _summary_latencies(summary: dict) -> dict[str, float]:
    """A result file saved without request records: the percentiles its summary has."""
    out = {}
    for name in LATENCIES:
        for p, key in ((50, f"median_{name}_ms"), (90, f"p90_{name}_ms"), (99, f"p99_{name}_ms")):
            if isinstance(summary.get(key), (int, float)):
                out[f"p{p}_{name}_ms"] = float(summary[key])
    return out


def run_metrics(run: Run) -> dict[tuple[str, str], float]:
    """{(class, metric): value} of one run (see the module docstring)."""
    s = run.summary
    whole = latency_stats(run.requests) if run.requests else _summary_latencies(s)
    out = {(ALL, k): v for k, v in whole.items()}
    for k in RATES[:3]:
        if isinstance(s.get(k), (int, float)):
            out[(ALL, k)] = float(s[k])
    for cls, row in (s.get("classes") or {}).items():
        mine = [r for r in run.requests if r.get("scenario") == cls]
        out.update({(cls, k): v for k, v in latency_stats(mine).items()})
        out.update({(cls, k): float(row[k]) for k in RATES if isinstance(row.get(k), (int, float))})
    return out


def higher_is_better(metric: str) -> bool:
    return metric in RATES
