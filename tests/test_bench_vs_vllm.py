"""benchmarks/bench_vs_vllm.py's bookkeeping (its timings are benchmarks, not tests): which rows its
ratios compare, so a summary line never credits minserve with a format that fails the gate."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_vs_vllm import ENGINES, GATE_FAILS, METRICS, ratios  # noqa: E402


def _row(x: float) -> dict:
    return dict.fromkeys(METRICS, x)


def test_best_minserve_skips_formats_that_fail_the_gate():
    engines = {"minserve-fp32": _row(2.0), "minserve-int8": _row(9.0), "minserve-int4-a8": _row(3.0),
               "vllm-fp32": _row(1.0), "vllm-bf16": _row(1.5)}
    out = ratios(engines)
    assert out["minserve-fp32 / vllm-fp32"] == _row(2.0)
    assert out["best minserve / best vLLM"] == pytest.approx(_row(2.0))   # W4A8's 3.0 over vLLM bf16's 1.5
    assert "minserve-bf16 / vllm-bf16" not in out


def test_gate_failures_name_real_engines():
    assert set(GATE_FAILS) <= set(ENGINES)
    assert {"minserve-int4-a8", "minserve-int8-a8"} <= set(ENGINES)
