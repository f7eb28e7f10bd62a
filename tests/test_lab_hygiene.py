"""Measurement hygiene (minserve/lab/hygiene.py) and checked lessons (minserve/lab/lessons.py):
the load probe sees other processes and not this one, calibrations repeat until stable and say
when they are not, a lesson that does not show names the measured cause, warm-up runs the shapes."""

import subprocess
from collections import Counter
import sys
import time

import pytest

from minserve.lab import hygiene, lessons
from minserve.lab.hygiene import Calibration, Load, LoadProbe, calibrate

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")


def _spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


@linux_only
def test_load_probe_counts_another_process_and_not_this_one():
    # Relative to the machine's load meanwhile: this process spinning on a core must not count as
    # another process. `make test` runs the notebooks beside this test, and their load comes and
    # goes within a second, so a reading may land on a burst of theirs: a probe that counted this
    # process would read >= background + 1 every time, so three tries tell the two apart.
    def spinning_counts_as_mine() -> bool:
        background = hygiene.machine_load(1.0).others_cores
        with LoadProbe() as mine:
            _spin(1.0)
        assert mine.load.others_cores is not None
        return mine.load.others_cores < background + 0.5
    assert any(spinning_counts_as_mine() for _ in range(3))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with LoadProbe() as other:
            time.sleep(1.5)
    finally:
        hog.kill()
        hog.wait()
    assert other.load.others_cores > 0.6, other.load
    assert other.load.busy and "busy" in other.load.describe()


def test_calibrate_repeats_until_the_last_runs_agree():
    values = iter([5.0, 2.0, 1.0, 1.05, 0.98, 1.0, 1.0])
    cal = calibrate(lambda: next(values), repeats=3, max_runs=7, tolerance=0.1, echo=False)
    assert cal.samples[0] == 5.0 and 5.0 not in cal.kept        # the cold first run is dropped
    assert cal.stable and cal.kept == [1.0, 1.05, 0.98] and cal.median == 1.0
    assert len(cal.samples) == 5


def test_calibrate_says_when_it_never_settled():
    values = iter([1.0, 1.0, 2.0, 1.0, 3.0, 1.0])
    cal = calibrate(lambda: next(values), repeats=3, max_runs=6, tolerance=0.1, echo=False)
    assert not cal.stable and len(cal.samples) == 6
    assert "NOT stable" in cal.describe()
    with pytest.raises(ValueError, match="repeats"):
        calibrate(lambda: 1.0, repeats=4, max_runs=2)


def test_a_lesson_that_does_not_show_names_its_measured_causes(tmp_path):
    busy = Load(others_cores=0.9, cpus=2, seconds=30)
    shaky = Calibration("service time", [2.0, 1.0, 1.5, 1.1], [1.0, 1.5, 1.1], tolerance=0.2)
    got = lessons.lesson("07-knee", "goodput falls past the knee", shown=False,
                         evidence="goodput 1.2 at 2x vs 1.1 at 1x", load=busy, calibration=shaky,
                         echo=False, directory=tmp_path)
    text = got.text()
    assert text.startswith("Lesson NOT shown") and "0.90 of 2 cores" in text and "45 % apart" in text
    shown = lessons.lesson("07-room", "the room helps", shown=True, evidence="2.0 vs 1.0",
                           load=busy, echo=False, directory=tmp_path)
    assert shown.text().startswith("Lesson shown") and shown.causes == []
    rows = lessons.recorded("07", tmp_path)
    assert [r["key"] for r in rows] == ["07-knee", "07-room"] and rows[0]["load"]["busy"]


def test_a_quiet_run_that_misses_a_lesson_says_noise_is_not_the_cause(tmp_path):
    quiet = Load(others_cores=0.02, cpus=2, seconds=30)
    got = lessons.lesson("04-warm", "warm TTFT is lower", shown=False, evidence="warm 300 ms, cold 200 ms",
                         load=quiet, echo=False, directory=tmp_path)
    assert "No measured cause" in got.text() and "report" in got.text()


def test_summary_counts_this_runs_lessons(tmp_path, capsys):
    lessons.start_run()
    lessons.lesson("02-a", "a", shown=True, evidence="x", echo=False, directory=tmp_path)
    lessons.lesson("02-b", "b", shown=False, evidence="y", echo=False, directory=tmp_path)
    out = lessons.summary("02")
    assert out["lessons"] == {"02-a": True, "02-b": False}
    assert "Lessons shown: 1 of 2" in capsys.readouterr().out


def test_warm_runs_each_prompt_shape_and_batch(tiny_llm):
    eng = tiny_llm.llm_engine
    before, seen = eng.num_steps, set(eng.requests_frame().request_id)
    w = hygiene.warm(tiny_llm, prompt_tokens=[8, 200, 10_000], batch_sizes=[1, 4, 999])
    assert w.prompt_tokens[:2] == [8, 200] and w.prompt_tokens[-1] < eng.max_model_len
    assert w.batch_sizes == [1, 4, eng.config.max_num_seqs]
    assert eng.num_steps > before and not eng.has_unfinished_requests()
    # One request per prompt length (a first run is the warm-up; hygiene.warm says why), then
    # one per sequence of each decode batch.
    ran = eng.requests_frame().loc[lambda f: ~f.request_id.isin(seen)]
    decode_seqs = 1 + 4 + eng.config.max_num_seqs
    assert Counter(ran.prompt_tokens) == Counter(w.prompt_tokens) + Counter({8: decode_seqs})


def test_a_counting_lesson_never_blames_the_load(tmp_path):
    busy = Load(others_cores=1.2, cpus=2, seconds=30)
    got = lessons.lesson("03-kv-formula", "the tensors take what the formula says", shown=False,
                         evidence="formula 100 bytes, tensors 120 bytes", load=busy, timing=False,
                         echo=False, directory=tmp_path)
    assert got.causes == [] and "count, not a timing" in got.text()


def test_warm_prompts_share_no_cached_block(tiny_llm):
    """Every warm-up prompt starts differently: with prefix caching a repeat would be a hit."""
    firsts = {hygiene._ids(16, offset=o)[0] for o in range(1, 40)}
    assert len(firsts) == 39
