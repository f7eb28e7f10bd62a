"""Request timelines: one row per request, what it was doing at every moment.

From the engine's records of an in-process run (:class:`~minserve.lab.workload.RunResult`):

- **queued** (light grey): from arrival until the scheduler admits it, and again from each
  preemption until it is readmitted;
- **prefill** (orange): one bar per prompt chunk, over the engine step that computed it, so chunked
  prefill shows as separate blocks (alternating shades, so adjacent chunks stay distinguishable);
  after a preemption the recomputed chunks are purple;
- **decode** (blue): from the first token to the finish;
- markers: the first token (black tick) and each preemption (red cross).

Chunks come from the steps' ``prefill_chunks`` record (request, tokens already cached, tokens
computed); the rest from the request timelines. Over HTTP only the client's view exists — send,
first token, finish — and :func:`request_timeline` draws that (before first token / decode) and
says so in its title.

Readable for hundreds of requests: each kind of bar is one vectorized ``barh`` call, and row labels
thin out when there are many rows.
"""

from __future__ import annotations

import math

COLORS = {"queued": "#cfcfcf", "prefill": "#f28e2b", "prefill2": "#f7b26b",
          "recompute": "#9467bd", "decode": "#4e79a7", "waiting": "#e0b27a"}


def timeline_segments(result) -> dict[str, list[tuple[int, float, float]]]:
    """Bars by kind: ``{kind: [(row, start_s, end_s), ...]}`` and markers
    ``{"first_token": [(row, t)], "preemption": [(row, t)]}`` for ``result``'s requests, rows in
    arrival order. Exposed for tests and for learners who want their own plot."""
    reqs = result.requests.reset_index(drop=True)
    out: dict[str, list] = {k: [] for k in ("queued", "prefill", "prefill2", "recompute", "decode",
                                            "waiting", "first_token", "preemption")}
    for row, r in reqs.iterrows():
        finish = r.finished_s if _ok(r.finished_s) else None
        first = r.first_token_s if _ok(r.first_token_s) else None
        if not result.in_process:
            if first is not None:
                out["waiting"].append((row, r.arrival_s, first))
                out["first_token"].append((row, first))
                if finish is not None:
                    out["decode"].append((row, first, finish))
            continue
        tl = result.timelines.get(r.engine_id, {"scheduled_s": [], "preempted_s": [], "chunks": []})
        sched, pre = tl["scheduled_s"], tl["preempted_s"]
        # Queued: arrival -> first admission, then each preemption -> next admission.
        starts = [r.arrival_s] + list(pre)
        for k, s in enumerate(starts):
            end = sched[k] if k < len(sched) else (finish if finish is not None else s)
            out["queued"].append((row, s, end))
        if first is not None and finish is not None:
            out["decode"].append((row, first, finish))
        if first is not None:
            out["first_token"].append((row, first))
        for t in pre:
            out["preemption"].append((row, t))
        first_pre = pre[0] if pre else math.inf
        for k, (t0, t1, _ctx, _n) in enumerate(tl["chunks"]):
            kind = "recompute" if t0 >= first_pre else ("prefill" if k % 2 == 0 else "prefill2")
            out[kind].append((row, t0, t1))
    return out


def _ok(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def request_timeline(result, ax=None, max_rows: int | None = 400, title: str | None = None):
    """Draw ``result``'s requests as a Gantt chart (see the module docstring); returns the axes.

    ``max_rows``: draw at most this many requests (the first by arrival), for very long runs.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    reqs = result.requests.reset_index(drop=True)
    n = len(reqs) if max_rows is None else min(len(reqs), max_rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, min(2.0 + 0.22 * n, 12)))
    seg = timeline_segments(result)
    height = 0.8 if n <= 60 else 0.95
    handles = []
    # Decode first: a preempted request's queued and recompute bars are drawn over it.
    for kind, label, h in (("decode", "decode", height * 0.6), ("queued", "queued", height),
                           ("waiting", "before first token (client view)", height),
                           ("prefill", "prefill chunk", height),
                           ("prefill2", None, height), ("recompute", "recompute after preemption", height)):
        bars = [(row, s, e) for row, s, e in seg[kind] if row < n]
        if not bars:
            continue
        rows, starts, ends = zip(*bars)
        widths = [max(e - s, 0.0) for s, e in zip(starts, ends)]
        edge = "white" if kind.startswith("prefill") and n <= 120 else "none"
        ax.barh(rows, widths, left=starts, height=h, color=COLORS[kind], edgecolor=edge, linewidth=0.5)
        if label:
            handles.append(Patch(color=COLORS[kind], label=label))
    ft = [(row, t) for row, t in seg["first_token"] if row < n]
    if ft:
        ax.scatter([t for _, t in ft], [row for row, _ in ft], marker="|", color="black",
                   s=60 if n <= 60 else 15, zorder=3)
        handles.append(Line2D([], [], marker="|", color="black", ls="none", label="first token"))
    pre = [(row, t) for row, t in seg["preemption"] if row < n]
    if pre:
        ax.scatter([t for _, t in pre], [row for row, _ in pre], marker="x", color="red",
                   s=40 if n <= 60 else 12, zorder=4)
        handles.append(Line2D([], [], marker="x", color="red", ls="none", label="preemption"))
    ax.set_ylim(n - 0.5, -0.5)  # first arrival on top
    if n <= 40:
        ax.set_yticks(range(n))
        ax.set_yticklabels([str(x) for x in reqs.label[:n]])
    else:
        step = max(1, round(n / 20))
        ax.set_yticks(range(0, n, step))
        ax.set_ylabel("request (by arrival)")
    ax.set_xlim(left=0)
    ax.set_xlabel("time since the run started (s)")
    ax.grid(axis="y", visible=False)
    if title is None:
        title = ("request timeline" if result.in_process else
                 "request timeline, client view (queue/prefill split and chunks need engine records)")
        if n < len(reqs):
            title += f" (first {n} of {len(reqs)} requests)"
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def chunk_table(result):
    """One row per prefill chunk of an in-process run: request, step time span, tokens already
    cached before the chunk (``context_tokens``) and tokens computed (``tokens``)."""
    import pandas as pd
    result.require_engine("chunk_table")
    label = dict(zip(result.requests.engine_id, result.requests.label))
    rows = []
    for rid, tl in result.timelines.items():
        for k, (t0, t1, ctx, n) in enumerate(tl["chunks"]):
            rows.append({"request": label.get(rid, rid), "chunk": k, "start_s": t0, "end_s": t1,
                         "context_tokens": ctx, "tokens": n})
    return pd.DataFrame(rows, columns=["request", "chunk", "start_s", "end_s", "context_tokens",
                                       "tokens"]).sort_values(["start_s", "request"]).reset_index(drop=True)
