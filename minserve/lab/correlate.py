"""What latency moves with: scatter plots with their correlation, and distributions side by side.

A latency number alone does not say why. Put next to the request's own circumstances — how long it
queued, how long its prompt was, how many requests shared its decode steps, how full the KV cache
was — one of them usually lines up with it. :func:`correlation_grid` draws the four classic pairs
and prints Pearson's r for each; :func:`scatter_corr` draws one pair.

:func:`add_context` adds those circumstances to the per-request frame:

- ``mean_batch``: mean number of requests computed per step while this request was decoding (in
  process: from the step records; over HTTP: the server's ``num_requests_running`` gauge sampled
  during its decode);
- ``mean_kv_usage`` / ``max_kv_usage``: KV cache usage (fraction) over the request's life.

:func:`compare_distributions` is "distributions, not averages": the CDF of one latency for two runs
on one axis, and a percentile table, because two runs with the same mean can treat their slowest
users very differently.
"""

from __future__ import annotations

import math

import numpy as np

PAIRS = (
    ("queue_s", "ttft_s", "queue time (s)", "TTFT (s)"),
    ("prompt_tokens", "ttft_s", "prompt tokens", "TTFT (s)"),
    ("mean_batch", "tpot_s", "running batch during decode (requests)", "TPOT (s)"),
    ("mean_kv_usage", "e2e_s", "mean KV cache usage (fraction)", "E2E latency (s)"),
)


def pearson(x, y) -> float:
    """Pearson's r over the pairs where both are finite; NaN with fewer than 3 pairs or no spread."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def _window_mean(t, v, start, end) -> float:
    """Mean of the samples ``v`` at times ``t`` within [start, end]; the nearest sample before
    ``end`` when none falls inside (a short request between two /metrics polls)."""
    if not (math.isfinite(start) and math.isfinite(end)) or len(t) == 0:
        return math.nan
    inside = (t >= start) & (t <= end)
    if inside.any():
        return float(np.nanmean(v[inside]))
    before = np.nonzero(t <= end)[0]
    return float(v[before[-1]]) if len(before) else float(v[0])


def add_context(result):
    """``result.requests`` plus ``mean_batch``, ``mean_kv_usage`` and ``max_kv_usage``."""
    df = result.requests.copy()
    if result.in_process:
        st = result.steps
        t = (st.t_s + st.step_time_s).to_numpy(float)
        batch = st.batch.to_numpy(float)
    else:
        st = result.state
        t = st.t_s.to_numpy(float)
        batch = st.num_running.to_numpy(float)
    kt = result.state.t_s.to_numpy(float)
    kv = result.state.kv_cache_usage.to_numpy(float)
    df["mean_batch"] = [_window_mean(t, batch, a, b) for a, b in zip(df.first_token_s, df.finished_s)]
    df["mean_kv_usage"] = [_window_mean(kt, kv, a, b) for a, b in zip(df.arrival_s, df.finished_s)]
    df["max_kv_usage"] = [_window_max(kt, kv, a, b) for a, b in zip(df.arrival_s, df.finished_s)]
    return df


def _window_max(t, v, start, end) -> float:
    if not (math.isfinite(start) and math.isfinite(end)) or len(t) == 0:
        return math.nan
    inside = (t >= start) & (t <= end)
    return float(np.nanmax(v[inside])) if inside.any() else _window_mean(t, v, start, end)


def scatter_corr(df, x: str, y: str, ax=None, xlabel: str | None = None, ylabel: str | None = None,
                 title: str | None = None, hue: str | None = None, echo: bool = True) -> float:
    """Scatter ``df[y]`` against ``df[x]``, a least-squares line, r in the title; returns r."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.6))
    xs, ys = df[x].to_numpy(float), df[y].to_numpy(float)
    r = pearson(xs, ys)
    if hue is not None and hue in df:
        for key, part in df.groupby(hue, sort=True):
            ax.scatter(part[x], part[y], s=16, label=str(key))
        ax.legend(fontsize=8)
    else:
        ax.scatter(xs, ys, s=16)
    ok = np.isfinite(xs) & np.isfinite(ys)
    if ok.sum() >= 3 and np.std(xs[ok]) > 0:
        k, b = np.polyfit(xs[ok], ys[ok], 1)
        grid = np.linspace(xs[ok].min(), xs[ok].max(), 50)
        ax.plot(grid, k * grid + b, color="black", lw=1, alpha=0.6)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    rtxt = "r = n/a" if math.isnan(r) else f"r = {r:+.2f}"
    ax.set_title(f"{title + ': ' if title else ''}{rtxt} (n = {int(ok.sum())})")
    if echo:
        print(f"{ylabel or y} vs {xlabel or x}: {rtxt} over {int(ok.sum())} requests")
    return r


def correlation_grid(result, pairs=PAIRS) -> dict[str, float]:
    """The four classic pairs in one figure (TTFT vs queue time, TTFT vs prompt tokens, TPOT vs
    running batch, E2E vs KV usage); prints and returns ``{"y~x": r}`` (r over all requests;
    points are coloured by label when there are 2 to 6 labels). Over HTTP the queue time is
    unknown to the client: that panel says so and its r is NaN."""
    import matplotlib.pyplot as plt
    df = add_context(result)
    # Colour by label when the workload mixes a few kinds of request (e.g. short vs RAG).
    hue = "label" if 2 <= df.label.nunique() <= 6 else None
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.6), layout="constrained")
    out = {}
    for ax, (x, y, xl, yl) in zip(np.atleast_1d(axes), pairs):
        if df[x].notna().sum() == 0:
            ax.text(0.5, 0.5, f"{xl}:\nnot observable over HTTP", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
            out[f"{y}~{x}"] = math.nan
            continue
        out[f"{y}~{x}"] = scatter_corr(df, x, y, ax=ax, xlabel=xl, ylabel=yl, hue=hue)
    return out


def compare_distributions(runs: dict, metric: str = "ttft_s", ax=None,
                          percentiles=(50, 90, 95, 99), unit: str = "ms"):
    """CDFs of ``metric`` for each run in ``runs`` (``{label: RunResult or DataFrame}``) on one
    axis, and a table of percentiles (rows: runs). Returns the table."""
    import matplotlib.pyplot as plt
    import pandas as pd
    scale = 1000.0 if unit == "ms" else 1.0
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.6))
    table = {}
    for label, run in runs.items():
        df = getattr(run, "requests", run)
        if "success" in df:
            df = df[df.success]
        v = np.sort(df[metric].dropna().to_numpy(float) * scale)
        if len(v) == 0:
            continue
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} (n={len(v)})")
        row = {f"p{p:g}": float(np.percentile(v, p)) for p in percentiles}
        row["mean"] = float(v.mean())
        table[label] = row
        mean = row["mean"]
        ax.axvline(mean, ls=":", lw=1, color=ax.lines[-1].get_color())
    for p in percentiles:
        ax.axhline(p / 100, color="grey", lw=0.5, alpha=0.5)
    name = metric.replace("_s", "").upper()
    ax.set_xlabel(f"{name} ({unit})")
    ax.set_ylabel("share of requests at or below")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name} distribution (dotted: means)")
    ax.legend(loc="lower right")
    return pd.DataFrame(table).T.round(1)
