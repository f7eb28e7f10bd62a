"""tests/run_suite.py (what `make test` runs): which arguments after ``--`` are paths, how the suite
is cut into parts, which notebooks wait for which, in what order the workers take the parts, and
what a run reports."""

import json
import sys

import pytest

import run_suite
import spare_cores
from run_suite import Part, make_parts, priorities, split_paths


def test_paths_go_to_their_side_and_options_stay_options():
    tests, labs, rest = split_paths(["-x", "tests/test_api.py::test_models_list", "labs/00_tour.ipynb",
                                     "-k", "tour", "-p", "no:cacheprovider", "tests"])
    assert tests == ["tests/test_api.py::test_models_list", "tests"]
    assert labs == ["labs/00_tour.ipynb"]
    assert rest == ["-x", "-k", "tour", "-p", "no:cacheprovider"]


def test_without_paths_everything_is_an_option():
    assert split_paths(["--durations=20", "-k", "no_such_path.py"]) == ([], [], ["--durations=20", "-k",
                                                                                "no_such_path.py"])


def test_the_whole_suite_is_every_test_once_and_every_notebook_alone():
    parts = make_parts([], [])
    rest = parts[0]
    assert rest.name == "tests" and rest.args[0] == "tests"
    slow = [p.name for p in parts if p.name.startswith("tests/")]
    assert slow == list(run_suite.SLOW_FILES)
    assert sorted(a for a in rest.args if a.startswith("--ignore=")) == sorted(f"--ignore={f}" for f in slow)
    notebooks = sorted(p.name for p in parts if p.notebook)
    assert notebooks == sorted(str(n.relative_to(run_suite.ROOT))
                               for n in (run_suite.ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    assert len(notebooks) >= 10 and all(p.args == [p.name] for p in parts if p.notebook)


def test_a_part_of_many_paths_gets_a_log_name_the_file_system_takes():
    many = [f"tests/test_{'x' * 30}_{i}.py" for i in range(20)]
    a, b = Part(" ".join(many), many), Part(" ".join(many[:-1]), many[:-1])
    assert len(a.log.name) <= 255 and a.log.name.endswith(".log")
    assert a.log != b.log                     # names that share their first 100 bytes still differ
    assert Part("tests/test_api.py", []).log.name == "tests_test_api.py.log"


def test_a_notebook_waits_for_the_baselines_it_loads():
    after = {p.name[5:7]: {a[5:7] for a in p.after} for p in make_parts([], ["labs"])}
    assert after["01"] == {"00"} and after["05"] == {"01", "03"} and after["08"] == set()
    # Only among the parts of this run: alone, lab 05 waits for nothing.
    assert make_parts([], ["labs/05_quantization.ipynb"])[0].after == set()


def test_a_part_that_others_wait_on_goes_first(tmp_path, monkeypatch):
    monkeypatch.setattr(run_suite, "TIMES", tmp_path / "durations.json")
    (tmp_path / "durations.json").write_text(json.dumps({"a": 100, "b": 30, "c": 50, "d": 10}))
    parts = [Part("a", []), Part("b", []), Part("c", [], after={"b"}), Part("d", [], after={"c"})]
    # b alone is short, but c and d wait on it: 30 + 50 + 10 ahead of a's 100 is close.
    assert priorities(parts) == {"a": 100, "b": 90, "c": 60, "d": 10}
    (tmp_path / "durations.json").write_text("not json")          # unknown: TYPICAL_S, else 60 s
    assert priorities(parts)["d"] == 60 and priorities(parts)["b"] == 180


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """run_suite rooted in tmp_path, each part's "pytest" a python -c of its first argument."""
    monkeypatch.setattr(run_suite, "LOGS", tmp_path)
    monkeypatch.setattr(run_suite, "ROOT", tmp_path)
    monkeypatch.setattr(run_suite, "TIMES", tmp_path / "durations.json")
    monkeypatch.setattr(run_suite, "pytest_cmd", lambda paths, extra: [sys.executable, "-c", paths[0]])


def test_a_run_reports_each_part_and_fails_on_any_failure(sandbox, tmp_path, capsys):
    ok = "print('3 passed in 0.1s')"
    bad = "print('x'); print('=== FAILURES ==='); print('assert 1 == 2'); raise SystemExit(1)"
    none = "raise SystemExit(5)"
    parts = [Part("ok", [ok]), Part("bad", [bad]), Part("none", [none], after={"ok"})]
    assert run_suite.run_shared(parts, [], {}, workers=2) == 1
    out = capsys.readouterr().out
    assert "passed ok in" in out and "3 passed in 0.1s" in out and "FAILED bad" in out
    assert "=== FAILURES ===\nassert 1 == 2" in out and "x\n=== FAILURES" not in out
    assert "suite FAILED" in out and "1 failed: bad" in out
    # Only what passed is timed for the next run's order.
    assert json.loads((tmp_path / "durations.json").read_text()).keys() == {"ok"}
    assert run_suite.run_shared([Part("none", [none])], [], {}, workers=1) == run_suite.NO_TESTS


def test_parts_that_wait_on_each_other_still_run(sandbox, tmp_path, capsys):
    ok = "print('1 passed')"
    parts = [Part("a", [ok], after={"b"}), Part("b", [ok], after={"a"}), Part("c", [ok])]
    assert priorities(parts)["c"] == 60      # and the cycle's ranks are finite
    assert run_suite.run_shared(parts, [], {}, workers=2) == 0
    assert "3 parts, 0 failed" in capsys.readouterr().out


def test_a_part_that_cannot_start_is_a_failure(sandbox, tmp_path, capsys):
    part = Part("a", ["print(1)"])
    part.log = tmp_path / "missing" / "a.log"          # a folder that is not there: no log
    assert run_suite.run_shared([part], [], {}, workers=1) == 1
    out = capsys.readouterr().out
    assert "FAILED a" in out and "could not run: FileNotFoundError" in out and "1 failed: a" in out


def test_one_worker_per_core_up_to_the_cap_unless_test_workers_says(monkeypatch):
    monkeypatch.delenv("TEST_WORKERS", raising=False)
    monkeypatch.setattr(run_suite.os, "sched_getaffinity", lambda pid: {0, 1})
    assert run_suite.worker_count() == 2                       # this project's 2-core boxes
    monkeypatch.setattr(run_suite.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert run_suite.worker_count() == run_suite.MAX_DEFAULT_WORKERS == 4
    monkeypatch.delattr(run_suite.os, "sched_getaffinity")    # macOS: the core count instead
    monkeypatch.setattr(run_suite.os, "cpu_count", lambda: 3)
    assert run_suite.worker_count() == 3
    monkeypatch.setenv("TEST_WORKERS", " 6 ")
    assert run_suite.worker_count() == 6
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv("TEST_WORKERS", bad)
        with pytest.raises(SystemExit, match=f"TEST_WORKERS must be a whole number of workers, 1 or more; got '{bad}'"):
            run_suite.worker_count()


def test_the_shared_layout_keeps_its_older_name(sandbox, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_suite, "pytest_cmd", lambda paths, extra: [sys.executable, "-c", "print('1 passed')"])
    monkeypatch.setenv("TEST_WORKERS", "3")
    (tmp_path / "labs").mkdir()
    (tmp_path / "test_a.py").write_text("")
    (tmp_path / "labs" / "01_b.py").write_text("")
    for layout in ("shared", "two"):
        assert run_suite.main(["--layout", layout, "--", "test_a.py", "labs/01_b.py"]) == 0
        out = capsys.readouterr().out
        assert "2 parts, 2 workers" in out             # never more workers than parts
        assert "one more while a core sits idle" not in out   # TEST_WORKERS fixes the number
    monkeypatch.delenv("TEST_WORKERS")
    assert run_suite.main(["--", "test_a.py", "labs/01_b.py"]) == 0
    assert "(and one more while a core sits idle)" in capsys.readouterr().out


# ---- one more part while a core sits idle (tests/spare_cores.py) -----------------------------------

STAT = """cpu  900 0 300 5000 100 0 0 0 0 0
cpu0 100 0 100 {idle0} 50 0 0 0 0 0
cpu1 800 0 200 {idle1} 50 0 0 0 0 0
cpu2 0 0 0 99999 0 0 0 0 0 0
intr 1 2 3
"""


def test_idle_jiffies_are_summed_over_the_processs_own_cpus():
    idle, total = spare_cores.read_idle(STAT.format(idle0=1000, idle1=10), {0, 1})
    assert idle == 1000 + 50 + 10 + 50 and total == 1250 + 1060   # cpu2 and the "cpu" total: not ours
    assert spare_cores.available_memory("MemTotal: 100 kB\nMemAvailable:  2048 kB\n") == 2048 * 1024
    assert spare_cores.available_memory("MemTotal: 100 kB\n") is None


def test_the_meter_counts_idle_cores_over_a_whole_window(tmp_path, monkeypatch):
    stat, meminfo = tmp_path / "stat", tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 8388608 kB\n")               # 8 GiB
    meter = spare_cores.SpareCores({0, 1}, window_s=10, stat=stat, meminfo=meminfo)
    # Each second: cpu0 idle the whole second (100 jiffies), cpu1 busy the whole of it.
    for second in range(12):
        stat.write_text(STAT.format(idle0=1000 + 100 * second, idle1=10).replace(
            "cpu1 800", f"cpu1 {800 + 100 * second}"))
        meter.sample(now=float(second))
        if second < 10:
            assert meter.idle() is None and meter.room_for_one_more() is None   # no whole window yet
    assert meter.idle() == pytest.approx(1.0)
    assert meter.room_for_one_more() == "1.0 of 2 cores idle over the last 10 s"
    meminfo.write_text("MemAvailable: 1048576 kB\n")               # 1 GiB: not enough for a part
    assert meter.room_for_one_more() is None
    meminfo.write_text("MemAvailable: 8388608 kB\n")
    meter.restart()
    assert meter.idle() is None
    # Both cores busy: no room whatever the memory.
    for second in range(12, 24):
        stat.write_text(STAT.format(idle0=2100, idle1=10).replace("cpu0 100", f"cpu0 {100 * second}")
                        .replace("cpu1 800", f"cpu1 {800 + 100 * second}"))
        meter.sample(now=float(second))
    assert meter.idle() == pytest.approx(0.0) and meter.room_for_one_more() is None
    assert spare_cores.SpareCores({0}, stat=tmp_path / "none").sample() is None   # no /proc: no count


class FixedMeter:
    def __init__(self, room: str | None):
        self.room, self.restarts = room, 0

    def sample(self):
        pass

    def restart(self):
        self.restarts += 1

    def room_for_one_more(self):
        return self.room


def _overlap(log) -> int:
    """The most parts that ran at once, from the start/end lines they wrote."""
    events = sorted((float(t), +1 if what == "start" else -1)
                    for what, t in (ln.split() for ln in log.read_text().splitlines()))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("room", [None, "1.0 of 2 cores idle over the last 10 s"])
def test_one_more_part_starts_only_while_the_meter_sees_room(sandbox, tmp_path, capsys, monkeypatch, room):
    monkeypatch.setattr(run_suite, "SPARE_POLL_S", 0.05)
    log = tmp_path / "times"
    body = (f"import time; f = open({str(log)!r}, 'a'); f.write(f'start {{time.time()}}\\n'); f.flush(); "
            f"time.sleep(0.6); f.write(f'end {{time.time()}}\\n'); print('1 passed')")
    parts = [Part(name, [body]) for name in "abcd"]
    meter = FixedMeter(room)
    assert run_suite.run_shared(parts, [], {}, workers=1, spare=meter) == 0
    out = capsys.readouterr().out
    assert "4 parts, 0 failed" in out and meter.restarts == 4
    if room is None:
        assert _overlap(log) == 1 and "starts beside the others" not in out
    else:   # one worker and one more: two at a time, never three
        assert _overlap(log) == 2 and f"starts beside the others: {room}" in out
        assert "(and one more while a core sits idle)" in out
