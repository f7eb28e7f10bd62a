"""minserve.lab.live: one figure and one progress line, updated in place (never a pile of
outputs), ending on the final frame and "n/n"; and how often it redraws."""

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

from minserve import lab  # noqa: E402
from minserve.engine.llm_engine import LLMEngine  # noqa: E402
from minserve.lab import live  # noqa: E402
from minserve.lab.presets import CI_ENV  # noqa: E402


class FakeHandle:
    def __init__(self, log, obj):
        self.log, self.obj, self.updates = log, obj, 0

    def update(self, obj):
        self.obj = obj
        self.updates += 1


@pytest.fixture
def notebook(monkeypatch):
    """Pretend to be a Jupyter kernel: record display() calls and their handles."""
    import IPython.display
    log = []

    def display(obj, display_id=False):
        h = FakeHandle(log, obj)
        log.append(h)
        return h

    monkeypatch.setattr(live, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.delenv(CI_ENV, raising=False)
    return log


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=32,
                                      num_kv_blocks=64)


def test_a_run_updates_one_figure_and_one_progress_line_in_place(notebook, engine):
    reqs = lab.make_requests(engine.tokenizer, [20, 40, 60, 30, 50, 10], output_tokens=30, seed=1)
    lab.run_workload(engine, reqs, interval_s=0.0, name="live test")
    assert len(notebook) == 2, "exactly two outputs: the progress line and the figure"
    bar, fig = notebook
    assert isinstance(bar.obj, live._Progress) and bar.updates >= 1
    assert repr(bar.obj).startswith("live test: 6/6 requests done (100 %")
    assert "<progress" in bar.obj._repr_html_()
    assert fig.obj.format == "png" and fig.obj.data[:4] == b"\x89PNG"
    assert fig.updates >= 1, "intermediate frames replace the first one"


def test_ci_draws_only_the_final_frame(notebook, engine, monkeypatch):
    monkeypatch.setenv(CI_ENV, "1")
    reqs = lab.make_requests(engine.tokenizer, [20, 40], output_tokens=20, seed=2)
    run = lab.run_workload(engine, reqs, interval_s=0.0)
    bar, fig = notebook
    assert fig.updates == 0 and repr(bar.obj).split(": ")[1].startswith("2/2")
    assert run.figure is not None


def test_live_false_displays_nothing(notebook, engine):
    lab.run_workload(engine, lab.make_requests(engine.tokenizer, 10, 3), live=False)
    assert notebook == []


def test_frames_are_spaced_by_their_cost_while_busy(notebook, monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr(live.time, "perf_counter", lambda: clock["t"])
    run = live.LiveRun(10, "t", interval_s=0.5)

    def slow_draw():
        clock["t"] += 0.2  # a frame takes 0.2 s to draw
        run.num_frames += 1
    monkeypatch.setattr(run, "_draw_live", slow_draw)
    run.start()
    clock["t"] = 0.6
    run.tick(1)                      # first frame
    assert run.num_frames == 1
    clock["t"] = 1.4
    run.tick(2)                      # busy: must wait 8 x 0.2 s = 1.6 s after the last frame
    assert run.num_frames == 1
    run.tick(2, idle=True)           # idle: the plain interval is enough
    assert run.num_frames == 2
    clock["t"] = 4.0
    run.tick(3)
    assert run.num_frames == 3


def test_sweep_progress_counts_runs(notebook):
    out = lab.run_sweep(["a", "b", "c"], lambda v: v * 2, title="sweep")
    assert out == {"a": "aa", "b": "bb", "c": "cc"}
    (bar,) = notebook
    assert repr(bar.obj).startswith("sweep: 3/3 runs done")
