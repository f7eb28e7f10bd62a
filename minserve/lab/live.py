"""A figure that updates in place while a workload runs, and a progress line.

Why a display handle and a PNG, not an interactive backend: ``display(..., display_id=True)``
returns a handle whose ``update()`` replaces that one output in place — in JupyterLab it redraws
without flicker or a growing pile of figures, and in an executed notebook (nbval, nbconvert) the
saved output is the *last* update. So the final figure and "12/12 requests" stay in the saved
notebook, which a widget progress bar does not guarantee (it saves its first text form, "0/12").
The figure is a plain ``matplotlib.figure.Figure`` (Agg), rendered to PNG for each frame: no GUI
backend, no second copy shown by pyplot at the end of the cell.

A frame costs CPU time between engine steps (it delays the requests in flight), so frames are
spaced at least ``interval_s`` apart and, while requests are in flight, at least 8 times the last
frame's drawing time: the live view takes at most ~1/8 of a busy run on a slow machine, and frames
drawn while the engine is idle cost the measurements nothing. ``live=False`` turns it off.

Without a notebook frontend (a script, a test) nothing is displayed; the final figure is still
drawn and returned. Under ``MINSERVE_LAB_CI=1`` only the final frame is rendered: nobody watches
CI, and each frame costs ~0.1 s of CPU that the engine would otherwise use.
"""

from __future__ import annotations

import io
import math
import time
from typing import Any

from minserve.lab.presets import get_preset, is_ci


def in_notebook() -> bool:
    """True inside a Jupyter kernel (a frontend may be watching, or nbval records outputs)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


# Where live views draw: None means the cell's own output (display handles). A widget callback
# (a control panel's Run button) sets two ipywidgets.Output areas instead: JupyterLab does not
# route ``update_display`` messages into an Output widget, so a display handle created inside one
# never redraws (the figure stayed at its first frame); clearing and redrawing the area does.
_SINK: dict = {"figure": None, "progress": None}


class rendering_into:
    """``with rendering_into(fig_out, bar_out): ...``: live figures and progress lines drawn in
    the block go to these ``ipywidgets.Output`` areas, redrawn in place."""

    def __init__(self, figure_area, progress_area):
        self.areas = {"figure": figure_area, "progress": progress_area}

    def __enter__(self):
        self._saved = dict(_SINK)
        _SINK.update(self.areas)
        return self

    def __exit__(self, *exc):
        _SINK.update(self._saved)


class _AreaHandle:
    """A display handle's ``update`` for an Output widget: clear it, draw the new object."""

    def __init__(self, area, obj):
        self.area = area
        self.update(obj)

    def update(self, obj) -> None:
        from IPython.display import display
        with self.area:
            self.area.clear_output(wait=True)
            display(obj)


def show(obj, kind: str):
    """Display ``obj`` (a figure image or a progress line) where live views draw now; returns a
    handle with ``update(obj)``."""
    area = _SINK.get(kind)
    if area is not None:
        return _AreaHandle(area, obj)
    from IPython.display import display
    return display(obj, display_id=True)


def figure_png(fig) -> bytes:
    # No tight bounding box and fast compression: a frame must be cheap (see LiveRun.tick).
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    return buf.getvalue()


class _Progress:
    """``n/total`` as an HTML progress bar, with a plain-text form for saved notebooks."""

    def __init__(self, done: int, total: int, elapsed_s: float, title: str, unit: str = "requests"):
        self.done, self.total, self.elapsed_s, self.title, self.unit = done, total, elapsed_s, title, unit

    def __repr__(self) -> str:
        pct = 100 * self.done / self.total if self.total else 100
        return (f"{self.title}: {self.done}/{self.total} {self.unit} done ({pct:.0f} %, "
                f"{self.elapsed_s:.1f} s)")

    def _repr_html_(self) -> str:
        from html import escape
        return (f'<div style="font-family:monospace;font-size:12px">'
                f'<progress value="{self.done}" max="{max(self.total, 1)}" style="width:220px;'
                f'vertical-align:middle"></progress> {escape(repr(self))}</div>')


class LiveRun:
    """Collects what a run reports and redraws every ``interval_s`` seconds.

    The workload runners call :meth:`add_state` (engine gauges at a time), :meth:`add_finished`
    (a finished request's TTFT and TPOT) and :meth:`tick` (requests done so far), then
    :meth:`finish` with the complete result for the final, exact frame.
    """

    def __init__(self, total: int, title: str = "run", interval_s: float | None = None,
                 enabled: bool = True):
        self.total, self.title = total, title
        self.interval_s = interval_s if interval_s is not None else get_preset().live_interval_s
        self.enabled = enabled and in_notebook()
        self.frames = enabled and not is_ci()   # intermediate figure frames
        self.state: list[tuple[float, float, float, float, float]] = []
        self.finished: list[tuple[float, float, float]] = []
        self.num_frames = 0
        self._fig = None
        self._fig_handle = self._bar_handle = None
        self._t0 = self._last_draw = self._last_bar = 0.0
        self._gap_s = 0.0

    # -- data -------------------------------------------------------------------------------
    def add_state(self, t_s, running, waiting, kv_usage, preemptions) -> None:
        self.state.append((float(t_s), float(running), float(waiting), float(kv_usage),
                           float(preemptions)))

    def add_finished(self, t_s, ttft_s, tpot_s) -> None:
        nan = math.nan
        self.finished.append((float(t_s), nan if ttft_s is None else float(ttft_s),
                              nan if tpot_s is None else float(tpot_s)))

    # -- display ----------------------------------------------------------------------------
    def start(self) -> None:
        self._t0 = self._last_draw = self._last_bar = time.perf_counter()
        if not self.enabled:
            return
        self._bar_handle = show(_Progress(0, self.total, 0.0, self.title), "progress")

    def tick(self, done: int, idle: bool = False) -> None:
        """Called often (every engine step). Redraws at most every ``interval_s``; while requests
        are in flight (``idle`` False) also at most every 8 frame-drawing times, since a frame
        drawn between two steps delays every request in flight. When the engine is idle a
        frame costs the measurements nothing (arrival is stamped when a request is added)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last_bar >= min(0.25, self.interval_s):
            self._last_bar = now
            self._bar_handle.update(_Progress(done, self.total, now - self._t0, self.title))
        wait = self.interval_s if idle else max(self.interval_s, self._gap_s)
        if self.frames and now - self._last_draw >= wait:
            self._draw_live()
            t = time.perf_counter()
            # Drawing runs between engine steps, so it delays every request in flight: keep it
            # under ~1/8 of the wall time however slow this machine draws.
            self._gap_s = 8 * (t - now)
            self._last_draw = t

    def _draw_live(self) -> None:
        import numpy as np
        fin = np.array(self.finished, dtype=float).reshape(-1, 3)
        st = np.array(self.state, dtype=float).reshape(-1, 5)
        fig = self._figure()
        draw_panels(fig, fin[:, 0], fin[:, 1], fin[:, 2], st[:, 0], st[:, 1], st[:, 2], st[:, 3],
                    st[:, 4], f"{self.title} (running...)")
        self._show(fig)

    def _figure(self):
        if self._fig is None:
            self._fig = new_figure(3)
        return self._fig

    def _show(self, fig) -> None:
        from IPython.display import Image
        img = Image(data=figure_png(fig), format="png")
        if self._fig_handle is None:
            self._fig_handle = show(img, "figure")
        else:
            self._fig_handle.update(img)
        self.num_frames += 1

    def finish(self, done: int, result: Any = None):
        """The final frame, from ``result`` (a RunResult) when given; returns the figure."""
        fig = self._figure()
        if result is not None:
            r, s = result.requests, result.state
            ok = r[r.success]
            draw_panels(fig, ok.finished_s.to_numpy(float), ok.ttft_s.to_numpy(float),
                        ok.tpot_s.to_numpy(float), s.t_s.to_numpy(float),
                        s.num_running.to_numpy(float), s.num_waiting.to_numpy(float),
                        s.kv_cache_usage.to_numpy(float), s.num_preemptions.to_numpy(float),
                        f"{self.title}: {len(ok)}/{len(r)} requests in {result.duration_s:.1f} s")
        else:
            self._draw_data_only(fig)
        if self.enabled:
            self._bar_handle.update(_Progress(done, self.total, time.perf_counter() - self._t0,
                                              self.title))
            self._show(fig)
        return fig

    def _draw_data_only(self, fig) -> None:
        import numpy as np
        fin = np.array(self.finished, dtype=float).reshape(-1, 3)
        st = np.array(self.state, dtype=float).reshape(-1, 5)
        draw_panels(fig, fin[:, 0], fin[:, 1], fin[:, 2], st[:, 0], st[:, 1], st[:, 2], st[:, 3],
                    st[:, 4], f"{self.title} (stopped)")


class Progress:
    """A progress line for a sequence of steps (e.g. the runs of a sweep), updated in place."""

    def __init__(self, total: int, title: str, unit: str = "runs", enabled: bool = True):
        self.total, self.title, self.unit = total, title, unit
        self.enabled = enabled and in_notebook()
        self._t0 = time.perf_counter()
        self._handle = None
        if self.enabled:
            self._handle = show(self._bar(0), "progress")

    def _bar(self, done: int) -> _Progress:
        return _Progress(done, self.total, time.perf_counter() - self._t0, self.title, self.unit)

    def update(self, done: int, note: str = "") -> None:
        if self._handle is not None:
            bar = self._bar(done)
            if note:
                bar.title = f"{self.title} ({note})"
            self._handle.update(bar)


def new_figure(ncols: int, width: float = 13.0, height: float = 3.4):
    """A pyplot-free Agg figure (it is shown only where we display it)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=72)
    fig.subplots(1, ncols)
    # A fixed layout: a layout engine would re-solve on every frame.
    # left and wspace leave room for log-scale tick labels ("2x10^2") beside the axis label.
    fig.subplots_adjust(left=0.075, right=0.99, bottom=0.15, top=0.83, wspace=0.27)
    return fig


def draw_panels(fig, fin_t, ttft_s, tpot_s, t, running, waiting, kv, preempt_cum, title: str) -> None:
    """The three live panels: latencies of finished requests, queue lengths, KV usage."""
    import numpy as np
    ax1, ax2, ax3 = fig.axes
    for ax in fig.axes:
        ax.cla()
    xmax = max([1e-3, *(fin_t[np.isfinite(fin_t)] if len(fin_t) else []),
                *(t[np.isfinite(t)] if len(t) else [])]) * 1.02
    ax1.scatter(fin_t, 1000 * ttft_s, s=14, color="tab:orange", label="TTFT")
    ax1.scatter(fin_t, 1000 * tpot_s, s=14, marker="x", color="tab:blue", label="TPOT")
    if np.isfinite(ttft_s).any() or np.isfinite(tpot_s).any():
        ax1.set_yscale("log")
    ax1.set_xlabel("request finished at (s)")
    ax1.set_ylabel("ms (log scale)")
    ax1.set_title("latency of finished requests")
    ax1.legend(loc="upper left")
    ax2.step(t, running, where="post", color="tab:green", label="running")
    ax2.step(t, waiting, where="post", color="tab:red", label="waiting")
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("requests")
    ax2.set_title("running and waiting requests")
    ax2.legend(loc="upper right")
    ax3.plot(t, 100 * kv, color="tab:purple", label="KV cache used")
    ax3.set_ylim(0, 105)
    n_pre = 0
    if len(preempt_cum) and np.isfinite(preempt_cum).any():
        pc = np.nan_to_num(preempt_cum)
        n_pre = int(pc[-1])
        jumps = t[np.diff(np.concatenate([[0.0], pc])) > 0]
        for k, x in enumerate(jumps):
            ax3.axvline(x, color="tab:red", lw=0.8, alpha=0.7, label="preemption" if k == 0 else None)
    ax3.set_xlabel("time (s)")
    ax3.set_ylabel("KV blocks in use (%)")
    ax3.set_title(f"KV cache usage, {n_pre} preemption{'s' if n_pre != 1 else ''}")
    ax3.legend(loc="upper right")
    for ax in fig.axes:
        ax.set_xlim(0, xmax)
    fig.suptitle(title, fontsize=11)
