"""The robustness benchmark's bookkeeping (benchmarks/bench_lab_robustness.py): its table counts
shown and explained lessons per condition, and its verdict names every missed target."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_lab_robustness", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lab_robustness.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def row(cond, seconds, shown, explained=False, error=None, run=0):
    return {"lab": "07", "condition": cond, "run": run, "seconds": seconds, "error": error,
            "lessons": [{"key": "07-room", "claim": "c", "shown": shown, "explained": explained}]}


def test_table_counts_shown_and_explained_lessons():
    rows = [row("quiet", 100, True), row("quiet", 120, True, run=1),
            row("busy", 200, True), row("busy", 240, False, explained=True, run=1)]
    md = bench.table(rows, ["quiet", "busy"])
    assert "| 07 | quiet | 2/2 | 1.8 min (2.0) | 07-room 2/2 |" in md
    assert "| 07 | busy | 2/2 | 3.7 min (4.0) | 07-room 1/2 (+1 explained) |" in md


def test_verdicts_name_each_missed_target():
    ok = [row("quiet", 100, True), row("busy", 200, False, explained=True)]
    assert bench.verdicts(ok) == []
    bad = [row("quiet", 200, False), row("busy", 400, True, error="CellExecutionError: boom")]
    misses = bench.verdicts(bad)
    assert any("without a measured cause" in m and "quiet" in m for m in misses)
    assert any("3.3 min > 3.0 min" in m for m in misses)
    assert any("failed: CellExecutionError" in m for m in misses)
