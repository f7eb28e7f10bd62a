"""Lab 06's live board (comparisons plotted while they run) and the hand-driven explorer."""

from __future__ import annotations

import time
from typing import Callable

from course.lab06_measure import Pair, compare, table
from course.lab06_workloads import WORKLOADS, make_engine, prompt_ids


# ---- the live board ----------------------------------------------------------------------------

class Board:
    """One figure, redrawn in place while comparisons run: tokens decoded against target steps
    taken for the group in flight (plain and speculative), and the speed-up of every comparison
    so far.

    Frames are spaced at least ``interval_s`` apart and at least 8 times the last frame's drawing
    time (as in :mod:`minserve.lab.live`: a frame delays the steps after it). Without a notebook
    nothing is shown and :meth:`finish` just returns the figure; under ``MINSERVE_LAB_CI=1`` only
    the final frame is rendered."""

    def __init__(self, title: str, label: Callable[[Pair], str] | None = None,
                 interval_s: float = 1.0):
        from minserve.lab.live import in_notebook
        from minserve.lab.presets import is_ci
        self.title, self.interval_s = title, interval_s
        self.label = label or (lambda p: p.label)
        self.pairs: list[Pair] = []
        self.enabled = in_notebook()
        self.frames = self.enabled and not is_ci()
        self.num_frames = 0
        self._fig = self._handle = None
        self._traces: list | None = None
        self._last = 0.0
        self._gap = 0.0

    def add(self, pair: Pair) -> None:
        if all(p is not pair for p in self.pairs):
            self.pairs.append(pair)

    def tick(self, traces) -> None:
        """Called after each round of steps with the traces of the group in flight."""
        self._traces = traces
        if not self.frames:
            return
        now = time.perf_counter()
        if now - self._last >= max(self.interval_s, self._gap):
            self._show(self.draw(running=True))
            t = time.perf_counter()
            self._gap, self._last = 8 * (t - now), t

    def update(self) -> None:
        """Called when a group has finished: redraw now."""
        self._traces = None
        if self.frames:
            self._show(self.draw(running=True))
            self._last = time.perf_counter()

    def draw(self, running: bool = False):
        from minserve.lab.live import new_figure
        if self._fig is None:
            self._fig = new_figure(2, width=12.0, height=3.8)
            self._fig.subplots_adjust(bottom=0.3)
        fig = self._fig
        ax1, ax2 = fig.axes
        for ax in fig.axes:
            ax.cla()
        traces, current = self._traces, self.pairs[-1] if self.pairs else None
        if traces is None and current is not None and current.spec:
            traces = [current.plain[-1].trace, current.spec[-1].trace]
        if traces:
            for tr, name, color in zip(traces, ("plain", "speculative"), ("tab:gray", "tab:blue")):
                x, n = zip(*tr)
                ax1.step(x, n, where="post", color=color, label=name)
            ax1.legend(loc="upper left")
        ax1.set_title(f"tokens per target step: {self.label(current)}" if current else "tokens per target step")
        ax1.set_xlabel("target steps (forward passes) so far")
        ax1.set_ylabel("tokens decoded (all requests)")
        done = [p for p in self.pairs if p.spec]
        values = [p.speedup for p in done]
        ax2.bar(range(len(values)), values,
                color=["tab:green" if v >= 1 else "tab:red" for v in values])
        ax2.axhline(1.0, color="black", lw=0.8)
        ax2.set_xticks(range(len(values)))
        ax2.set_xticklabels([self.label(p) for p in done], rotation=20, fontsize=8, ha="right")
        ax2.set_ylabel("decode speed-up (x)")
        ax2.set_title("speed-up so far (above 1: speculation paid)")
        fig.suptitle(self.title + (" (running...)" if running else ""), fontsize=11)
        return fig

    def _show(self, fig) -> None:
        from IPython.display import Image, display
        from minserve.lab.live import figure_png
        img = Image(data=figure_png(fig), format="png")
        if self._handle is None:
            self._handle = display(img, display_id=True)
        else:
            self._handle.update(img)
        self.num_frames += 1

    def finish(self):
        """The final frame (it stays in a saved notebook); returns the figure."""
        self._traces = None
        fig = self.draw()
        if self.enabled:
            self._show(fig)
        return fig


# ---- exploring by hand ---------------------------------------------------------------------------

class Explorer:
    """Runs one comparison with the settings of the panel (or of a direct call): workload, k,
    batch size, output tokens, adaptive rule. Keeps the last speculative engine it built, so
    that trying another workload with the same k does not reload the model."""

    def __init__(self, preset, plain, tokenizer, sentences: int | None = 2, engine_args: dict | None = None):
        self.preset, self.plain, self.tok, self.sentences = preset, plain, tokenizer, sentences
        # The speculative engines it builds get the plain engine's room (seats, KV blocks), so
        # that a batch the panel allows runs whole on both sides.
        self.engine_args = dict(engine_args or {})
        self._spec_key = None
        self._spec = None
        self.results: list[Pair] = []

    def adopt(self, spec, k: int, adaptive: bool = False) -> None:
        """Use an engine the notebook already built for these settings."""
        self._spec_key, self._spec = (int(k), bool(adaptive)), spec

    def spec_engine(self, k: int, adaptive: bool):
        key = (int(k), bool(adaptive))
        if self._spec_key != key:
            self._spec = None  # free the old one first: one extra model in memory at a time
            self._spec = make_engine(self.preset, k=int(k), adaptive=bool(adaptive), **self.engine_args)
            self._spec_key = key
        return self._spec

    def run(self, workload: str = "copy", k: int = 4, batch: int = 1, max_tokens: int = 48,
            groups: int = 1, adaptive: bool = False, board: Board | None = None) -> Pair:
        from minserve import SamplingParams
        if batch > self.plain.llm_engine.config.max_num_seqs:
            raise ValueError(f"batch must be at most the engine's max_num_seqs "
                             f"({self.plain.llm_engine.config.max_num_seqs}), got {batch}")
        spec = self.spec_engine(k, adaptive)
        sentences = self.sentences if workload == "copy" and batch > 1 else None
        prompts = prompt_ids(self.tok, workload, batch * groups, sentences)
        params = SamplingParams(temperature=0, max_tokens=int(max_tokens))
        board = board or Board(f"{workload}, k={k}, batch {batch}")
        pair = compare(self.plain, spec, prompts, params, batch=batch, workload=workload, k=k, board=board)
        board.finish()
        self.results.append(pair)
        return pair


def panel(explorer: Explorer, **defaults):
    """Widgets for :meth:`Explorer.run` (a k slider, the workload, batch size, output tokens, the
    adaptive rule) and a Run button; returns the widget, or None with a note without ipywidgets."""
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed: call explorer.run(...) directly "
              "(pip install ipywidgets for the panel).")
        return None
    from IPython.display import display
    d = {"workload": "copy", "k": 4, "batch": 1, "max_tokens": 48, "adaptive": False, **defaults}
    style, layout = {"description_width": "150px"}, w.Layout(width="420px")
    max_b = explorer.plain.llm_engine.config.max_num_seqs
    ctl = {
        "workload": w.Dropdown(description="workload", options=list(WORKLOADS), value=d["workload"],
                               style=style, layout=layout),
        "k": w.IntSlider(description="k (proposals per step)", value=d["k"], min=1, max=7,
                         style=style, layout=layout),
        "batch": w.IntSlider(description="batch (requests)", value=min(d["batch"], max_b), min=1,
                             max=max_b, style=style, layout=layout),
        "max_tokens": w.IntSlider(description="output tokens", value=d["max_tokens"], min=8, max=256,
                                  step=8, style=style, layout=layout),
        "adaptive": w.Checkbox(description="adaptive rule", value=d["adaptive"], style=style),
    }
    button = w.Button(description="Run", button_style="primary", icon="play")
    out = w.Output()

    def on_click(_):
        button.disabled = True
        try:
            with out:
                out.clear_output()
                pair = explorer.run(**{k: c.value for k, c in ctl.items()})
                display(table([pair]).round(3))
        finally:
            button.disabled = False

    button.on_click(on_click)
    return w.VBox([w.HTML("<b>Speculative decoding: one comparison</b>"), *ctl.values(), button, out])
