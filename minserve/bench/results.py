"""Bench results: one object for notebooks, one JSON file per run, and the printed report.

The JSON file holds vLLM's keys (see :func:`minserve.bench.metrics.result_dict`) plus two of ours,
so latency can be plotted against what the server was doing at the time:
- ``requests``: one record per request (ids, planned and actual send time, TTFT, ITL list, TPOT,
  E2EL, input / output lengths, success, error), times in seconds from the start of the run;
- ``server_metrics_timeseries``: the server's ``/metrics`` sampled during the run (HTTP backend),
  or ``engine_steps``: the engine's per-step records (in-process backend);
- ``manifest``: what the run was measured on (:mod:`minserve.bench.manifest`: workload version and
  hash, model hash, code, kernels, hardware, engine configuration, machine load);
- ``classes`` (a workload file's runs): per request class, its counts, latencies and goodput
  against its own SLO. Without a run-wide ``--goodput``, ``request_goodput`` is then the sum of
  the classes' goodputs: a request is good when it met its own class's SLO.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from minserve.bench.metrics import (METRIC_NAMES, RequestRecord, calculate_metrics,
                                    percentile_key, request_tpot, result_dict)

if TYPE_CHECKING:
    import pandas as pd

REQUEST_COLUMNS = ["request_id", "scenario", "scheduled_s", "send_s", "prompt_len",
                   "expected_output_len", "output_len", "ttft_s", "tpot_s", "itl_s", "e2el_s",
                   "finish_s", "success", "error", "response_id", "cached_tokens"]


@dataclass
class BenchOptions:
    """How to offer load and what to report; shared by both backends (vLLM's flag meanings)."""
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    disable_tqdm: bool = True
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft", "tpot", "itl"])
    metric_percentiles: list[float] = field(default_factory=lambda: [99.0])
    goodput: dict[str, float] = field(default_factory=dict)   # SLOs in ms
    # Per request class (a workload file's classes, by SampleRequest.scenario): its priority
    # class, streaming flag and SLO ({"ttft": ms, ...}); adds "classes" to the summary.
    class_slos: dict[str, dict] | None = None


@dataclass
class BenchResult:
    summary: dict                              # vLLM's result keys
    requests: "pd.DataFrame"                   # one row per request (REQUEST_COLUMNS)
    steps: "pd.DataFrame | None" = None        # engine steps (in-process backend)
    server_metrics: "pd.DataFrame | None" = None  # /metrics time series (HTTP backend)
    manifest: dict | None = None               # what it ran on (minserve.bench.manifest)

    def to_json(self) -> dict:
        out = dict(self.summary)
        if self.manifest is not None:
            out["manifest"] = self.manifest
        out["requests"] = _records(self.requests)
        if self.server_metrics is not None:
            out["server_metrics_timeseries"] = _records(self.server_metrics)
        if self.steps is not None:
            out["engine_steps"] = _records(self.steps)
        return out


def _records(df) -> list[dict]:
    """DataFrame rows as JSON-safe dicts (NaN -> null: strict JSON has no NaN)."""
    def clean(v):
        if isinstance(v, float) and math.isnan(v):
            return None
        return v.item() if hasattr(v, "item") else v
    return [{k: clean(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def requests_frame(records: list[RequestRecord], lens: list[int], t0: float) -> "pd.DataFrame":
    """One row per request; times in seconds, ``send_s``/``finish_s`` relative to ``t0``."""
    import pandas as pd
    rows = []
    for rec, n in zip(records, lens):
        ok = rec.success
        tpot = request_tpot(rec, n) if ok else None
        rows.append({
            "request_id": rec.request_id, "scenario": rec.scenario, "scheduled_s": rec.scheduled_s,
            "send_s": rec.start_time - t0, "prompt_len": rec.prompt_len,
            "expected_output_len": rec.expected_output_len, "output_len": n,
            "ttft_s": rec.ttft if ok else math.nan,
            "tpot_s": math.nan if tpot is None else tpot,
            "itl_s": list(rec.itl), "e2el_s": rec.latency if ok else math.nan,
            "finish_s": rec.start_time + rec.latency - t0 if ok else math.nan,
            "success": ok, "error": rec.error, "response_id": rec.response_id,
            "cached_tokens": rec.cached_tokens})
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)


def finalize(records: list[RequestRecord], duration_s: float, t0: float, meta: dict,
             opts: BenchOptions, tokenizer=None) -> tuple[dict, "pd.DataFrame"]:
    """Metrics -> (vLLM result dict, requests frame); the one path both backends take."""
    m, lens = calculate_metrics(records, duration_s, tokenizer, opts.metric_percentiles,
                                opts.goodput or None)
    summary = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **meta,
               "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
               "burstiness": opts.burstiness, "max_concurrency": opts.max_concurrency}
    summary = result_dict(records, m, lens, duration_s, summary, opts.percentile_metrics,
                          opts.goodput or None)
    if opts.class_slos:
        summary["classes"] = class_summaries(records, duration_s, opts, tokenizer)
        judged = [c["request_goodput"] for c in summary["classes"].values() if c["request_goodput"] is not None]
        if summary["request_goodput"] is None and judged:
            # No run-wide SLO given: a request counts as good when it met its own class's SLO.
            summary["request_goodput"] = sum(judged)
    return summary, requests_frame(records, lens, t0)


CLASS_KEYS = ("completed", "failed", "request_throughput", "request_goodput", "output_throughput")


def class_summaries(records: list[RequestRecord], duration_s: float, opts: BenchOptions,
                    tokenizer=None) -> dict[str, dict]:
    """Per request class: counts, throughput and goodput against *its own* SLO (over the whole
    run's duration, so the classes' throughputs add up to the run's), the share of its requests
    that met the SLO, and the latency statistics of :func:`calculate_metrics`."""
    out = {}
    for name, spec in opts.class_slos.items():
        mine = [r for r in records if r.scenario == name]
        slo = dict(spec.get("slo") or {})
        m, _ = calculate_metrics(mine, duration_s, tokenizer, opts.metric_percentiles, slo or None)
        row = {"priority_class": spec.get("priority_class"), "streaming": spec.get("streaming"),
               "slo": slo, "num_requests": len(mine), **{k: getattr(m, k) for k in CLASS_KEYS}}
        row["slo_attainment"] = (m.request_goodput * duration_s / len(mine)) if mine and slo else None
        if not slo:
            row["request_goodput"] = None
        for metric, stats in m.stats_ms.items():  # None, not vLLM's 0, for a class with no answers
            row.update({f"{stat}_{metric}_ms": v if m.completed else None
                        for stat, v in stats.items() if stat != "std"})
        out[name] = row
    return out


def default_filename(backend: str, rate: float, max_concurrency: int | None, model_id: str,
                     date: str) -> str:
    """vLLM's naming: ``{backend}-{rate}qps[-concurrencyN]-{model basename}-{date}.json``."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{backend}-{float(rate)}qps{conc}-{model_id.rstrip('/').split('/')[-1]}-{date}.json"


def save_result(result: dict, path: str | Path) -> Path:
    path = Path(path)
    if path.parent != Path(""):
        os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result), encoding="utf-8")
    return path


FAILURE_REASON_CHARS = 120
MAX_FAILURE_REASONS = 5
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def format_summary(s: dict, percentiles: list[float]) -> str:
    """The human-readable block vLLM prints after a run."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines += [row("Successful requests:", s["completed"]), row("Failed requests:", s["failed"])]
    lines += failure_lines(s.get("errors") or [])
    if s.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", s["max_concurrency"]))
    if s.get("request_rate") != "inf":
        lines.append(rowf("Request rate configured (RPS):", s["request_rate"]))
    lines += [rowf("Benchmark duration (s):", s["duration"]),
              row("Total input tokens:", s["total_input_tokens"]),
              row("Total generated tokens:", s["total_output_tokens"]),
              rowf("Request throughput (req/s):", s["request_throughput"])]
    if s.get("request_goodput") is not None:
        lines.append(rowf("Request goodput (req/s):", s["request_goodput"]))
    lines += [rowf("Output token throughput (tok/s):", s["output_throughput"]),
              rowf("Total Token throughput (tok/s):", s["total_token_throughput"])]
    titles = {"ttft": ("TTFT", "Time to First Token"),
              "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
              "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    for name in METRIC_NAMES:
        if f"mean_{name}_ms" not in s:
            continue
        short, header = titles[name]
        lines.append("{:-^50}".format(header))
        lines += [rowf(f"Mean {short} (ms):", s[f"mean_{name}_ms"]),
                  rowf(f"Median {short} (ms):", s[f"median_{name}_ms"])]
        for p in percentiles:
            key = percentile_key(p)
            lines.append(rowf(f"{key.upper()} {short} (ms):", s[f"{key}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def failure_reasons(errors: list[str], width: int = FAILURE_REASON_CHARS) -> list[tuple[str, int]]:
    """The errors of failed requests grouped by cause, most frequent first. A cause is the
    message's first line, its numbers masked (token counts, ids and milliseconds differ from one
    request to the next; "HTTP 429" keeps its status), cut to ``width`` characters."""
    counts: Counter[str] = Counter()
    for error in errors:
        if not error:
            continue  # a successful request
        head, _, rest = error.strip().splitlines()[0].partition(": ")
        status = re.fullmatch(r"HTTP \d{3}", head)
        text = f"{head}: {_NUMBER.sub('#', rest)}" if status else _NUMBER.sub("#", error.strip().splitlines()[0])
        counts[text if len(text) <= width else text[:width - 3] + "..."] += 1
    return counts.most_common()


def failure_lines(errors: list[str], max_reasons: int = MAX_FAILURE_REASONS) -> list[str]:
    """The summary's lines under "Failed requests:": each cause with its count, the rarest
    causes folded into one line when there are more than ``max_reasons``."""
    reasons = failure_reasons(errors)
    lines = [f"  {count:>5} x {text}" for text, count in reasons[:max_reasons]]
    rest = reasons[max_reasons:]
    if rest:
        lines.append(f"  {sum(c for _, c in rest):>5} x ... {len(rest)} other reasons (see \"errors\" "
                     "in the result file)")
    return lines


def sweep_table(summaries: list[dict]) -> str:
    """One line per rate: the numbers a capacity curve is drawn from."""
    head = (f"{'rate':>8} {'done':>6} {'req/s':>8} {'out tok/s':>10} {'TTFT mean':>10} "
            f"{'TTFT p99':>10} {'TPOT mean':>10} {'TPOT p99':>10} {'goodput':>8}")
    lines = [head, "-" * len(head)]

    def ms(s, key):
        v = s.get(key)
        return f"{v:10.1f}" if isinstance(v, (int, float)) else f"{'-':>10}"
    for s in summaries:
        good = s.get("request_goodput")
        lines.append(f"{str(s['request_rate']):>8} {s['completed']:>6} {s['request_throughput']:8.2f} "
                     f"{s['output_throughput']:10.1f} {ms(s, 'mean_ttft_ms')} {ms(s, 'p99_ttft_ms')} "
                     f"{ms(s, 'mean_tpot_ms')} {ms(s, 'p99_tpot_ms')} "
                     f"{(f'{good:8.2f}' if good is not None else '-'.rjust(8))}")
    return "\n".join(lines)
