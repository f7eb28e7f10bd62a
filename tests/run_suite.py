"""Run the whole suite — tests/ and every notebook in labs/ — the way `make test` does.

    python tests/run_suite.py                 # two pytest processes side by side (the default)
    python tests/run_suite.py --layout one    # one pytest process, everything in turn
    python tests/run_suite.py -- -x -k lab    # anything after -- goes to each pytest
    python tests/run_suite.py -- tests/test_api.py labs/00_tour.ipynb   # just these, side by side

Why two processes: the ten notebooks (executed by nbval) and the rest of tests/ take about the
same time alone, and neither keeps both cores busy — a notebook waits on its kernel and on HTTP
between steps, most unit tests run one thread. Side by side each fills the other's idle core.
pytest-xdist cannot split the work this way: with ``--dist loadfile`` two workers may each take a
notebook (both then run on a contended machine at one thread), and with ``--dist loadgroup`` it ran
a notebook's cells out of order (measured 2026-12-02, 149 NameErrors).

Each side runs one thread, so that each has a core of its own: the unit tests through
``MINSERVE_TEST_THREADS=1`` (tests/conftest.py; a test that wants a team of two asks for it), the
notebooks' kernels through ``OMP_NUM_THREADS=1`` (``NOTEBOOK_THREADS`` overrides it). A team of
two beside a busy process is the slow case on two cores: an OpenMP region ends when its
descheduled thread does, and prefill steps keep the full team (the adaptive thread count,
minserve/engine/threads.py, covers decode steps). Measured 2026-12-03 on the Intel host, lab 09
alone: 24 s quiet at two threads; beside a busy loop 110 s at two threads, 31 s at one.

The unit tests print to the terminal as they run; the notebooks' output goes to
``build/test-logs/notebooks.log`` and its summary (all of it, when a notebook failed) is printed
when both have finished. The exit status is non-zero when either failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "test-logs"


def pytest_cmd(paths: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", *paths, "--nbval-lax",
            *extra]


def notebook_summary(log: Path, failed: bool) -> str:
    """The notebooks' log: whole when they failed, else its last (summary) line."""
    text = log.read_text(errors="replace")
    if failed:
        return text
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def split_paths(extra: list[str]) -> tuple[list[str], list[str], list[str]]:
    """pytest's arguments -> (test paths, notebook paths, the rest). A path is an argument naming a
    file or folder under the repository (``tests/test_x.py::test_y`` counts, by its file); a
    notebook path is one under labs/."""
    tests, labs, rest = [], [], []
    for arg in extra:
        if not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists():
            (labs if Path(arg.split("::")[0]).parts[:1] == ("labs",) else tests).append(arg)
        else:
            rest.append(arg)
    return tests, labs, rest


def run_one(paths: list[str], extra: list[str], env: dict[str, str]) -> int:
    return subprocess.call(pytest_cmd(paths, extra), cwd=ROOT, env=env)


def run_two(tests: list[str], labs: list[str], extra: list[str], env: dict[str, str]) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / "notebooks.log"
    start = time.monotonic()
    with open(log, "w") as out:
        threads = os.environ.get("NOTEBOOK_THREADS") or "1"
        notebooks = subprocess.Popen(pytest_cmd(labs, extra), cwd=ROOT,
                                     env={**env, "OMP_NUM_THREADS": threads},
                                     stdout=out, stderr=subprocess.STDOUT)
        print(f"notebooks (labs/) run beside the tests; their output: {log.relative_to(ROOT)}",
              flush=True)
        try:
            tests_rc = subprocess.call(pytest_cmd(tests, extra), cwd=ROOT,
                                       env={**env, "MINSERVE_TEST_THREADS": "1"})
            tests_done = time.monotonic() - start
            if notebooks.poll() is None:
                print(f"tests/ done in {tests_done / 60:.1f} min; waiting for the notebooks...",
                      flush=True)
            notebooks_rc = notebooks.wait()
        except KeyboardInterrupt:
            notebooks.terminate()
            notebooks.wait()
            raise
    total = time.monotonic() - start
    print(f"\n==== notebooks (labs/), {log.relative_to(ROOT)} ====")
    print(notebook_summary(log, failed=notebooks_rc != 0))
    verdict = "passed" if tests_rc == notebooks_rc == 0 else "FAILED"
    print(f"==== suite {verdict} in {total / 60:.1f} min: tests/ exit {tests_rc}, "
          f"notebooks exit {notebooks_rc} ====", flush=True)
    return tests_rc or notebooks_rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=("two", "one"),
                    default=os.environ.get("TEST_LAYOUT") or "two",
                    help="two processes side by side (default) or one (TEST_LAYOUT)")
    args = ap.parse_args(own)
    env = {**os.environ, "MINSERVE_LAB_CI": "1"}
    # Paths after -- select what runs (each to its side); none: every test and every notebook.
    # One side only leaves nothing to run beside it: one process.
    tests, labs, extra = split_paths(extra)
    if not (tests or labs):
        tests, labs = ["tests"], ["labs"]
    if args.layout == "one" or not (tests and labs):
        return run_one(tests + labs, extra, env)
    return run_two(tests, labs, extra, env)


if __name__ == "__main__":
    sys.exit(main())
