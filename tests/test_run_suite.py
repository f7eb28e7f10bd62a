"""tests/run_suite.py (what `make test` runs): which arguments after ``--`` are paths, how the suite
is cut into parts, which notebooks wait for which, in what order the workers take the parts, and
what a run reports."""

import json
import sys

import pytest

import run_suite
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
        assert "2 parts, 2 workers" in capsys.readouterr().out   # never more workers than parts
