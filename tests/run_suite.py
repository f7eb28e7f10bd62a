"""Run the whole suite — tests/ and every notebook in labs/ — the way `make test` does.

    python tests/run_suite.py                 # one worker per core shares the parts (the default)
    TEST_WORKERS=3 python tests/run_suite.py  # another number of workers
    python tests/run_suite.py --layout one    # one pytest process, everything in turn
    python tests/run_suite.py -- -x -k lab    # anything after -- goes to each pytest
    python tests/run_suite.py -- tests/test_api.py labs/00_tour.ipynb   # just these

How the work is shared: the suite is cut into parts — each notebook, each test file that takes
minutes on its own (``SLOW_FILES``), and the rest of tests/ — and the workers (one per usable
core, at most ``MAX_DEFAULT_WORKERS``; ``TEST_WORKERS`` sets another number) each run one pytest
process at a time, taking the part that the most work waits on: its own expected time plus the
longest chain of notebooks that read its results (lab 05 reads lab 01's and lab 03's baselines,
``lab.load_baseline``, so it starts only when they are done). Expected times are the last run's
(``build/test-logs/durations.json``), else ``TYPICAL_S``. Every core stays busy until the end
whatever the mix: with vLLM's tests (CI) or without them the heavy half differs, and a fixed split
(the notebooks in one process, tests/ in the other, until 2026-12-05) left one core idle for the
last 8 minutes of a run without vLLM. Not pytest-xdist: with ``--dist loadgroup`` it ran a
notebook's cells out of order (measured 2026-12-02, 149 NameErrors), and it cannot keep the
notebook kernels at one thread while the tests ask for their own.

One more part starts while every worker is busy and a core has sat idle for the last ten seconds
(half a core or more on average, with 4 GiB of memory free; tests/spare_cores.py reads the
kernel's idle counts): some parts wait more than they compute (vLLM's part, the labs' paced
arrivals), and the idle share of a core takes the next part. Not when ``TEST_WORKERS`` sets the number.

Each part runs at one thread, so that each has a core of its own: tests through
``MINSERVE_TEST_THREADS=1`` (tests/conftest.py; a test that wants a team of two asks for it), the
notebooks' kernels through ``OMP_NUM_THREADS=1`` (``NOTEBOOK_THREADS`` overrides it). A team of
two beside a busy process is the slow case on two cores: an OpenMP region ends when its
descheduled thread does. Measured 2026-12-03 on the Intel host, lab 09 alone: 24 s quiet at two
threads; beside a busy loop 110 s at two threads, 31 s at one.

Each part's output goes to ``build/test-logs/<part>.log``; the terminal gets a line as each part
starts and ends, then the whole failure report of every part that failed. The exit status is
non-zero when any part failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from spare_cores import SpareCores

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "test-logs"
TIMES = LOGS / "durations.json"
# One worker per usable core, each part at one thread; at most this many unless TEST_WORKERS says
# otherwise: a part may hold two engines (a lab comparing settings; SmolLM2 in fp32 is ~0.7 GiB of
# weights and KV each), and a laptop with many cores may not have the memory for that many at
# once. On this project's 2-core boxes: 2.
MAX_DEFAULT_WORKERS = 4
WORKERS_ENV = "TEST_WORKERS"
NO_TESTS = 5   # pytest's exit status when nothing was selected: not a failure of that part
SPARE_POLL_S = 2.0   # how often the idle cores are read while every worker is busy

# Test files that take minutes alone (a whole lab against a server, a browser, the docs site):
# each is a part of its own, so the workers can share them.
SLOW_FILES = ("tests/test_vllm_peer.py", "tests/test_lab_target.py", "tests/test_docs.py",
              "tests/test_browser.py")
# Seconds each part took at one thread beside another on the Zen 4 host (2026-12-07, with vLLM):
# they only order the queue on a first run (a fresh clone, CI); later runs order it by their own
# last times.
TYPICAL_S = {"tests": 370, "tests/test_vllm_peer.py": 200, "labs/08_optimization_lab.ipynb": 125,
             "labs/02_continuous_batching.ipynb": 110, "tests/test_lab_target.py": 110,
             "labs/01_prefill_vs_decode.ipynb": 100, "tests/test_docs.py": 90,
             "labs/06_speculative_decoding.ipynb": 85, "labs/05_quantization.ipynb": 75,
             "labs/07_overload_and_goodput.ipynb": 70, "tests/test_browser.py": 50,
             "labs/04_prefix_caching.ipynb": 45, "labs/00_tour.ipynb": 30,
             "labs/03_kv_cache_detective.ipynb": 30, "labs/09_release_gates.ipynb": 20}


@dataclass
class Part:
    """One pytest process: its paths and options, whether it runs notebooks, and how it went."""

    name: str
    args: list[str]
    notebook: bool = False
    after: set[str] = field(default_factory=set)   # parts whose results this one reads
    rc: int | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    summary: str = ""
    log: Path = field(init=False)

    def __post_init__(self):
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name).strip("_")
        if len(stem) > 120:   # many paths in one part: a file name has at most 255 bytes
            stem = f"{stem[:100]}_{hashlib.sha256(stem.encode()).hexdigest()[:12]}"
        self.log = LOGS / (stem + ".log")

    @property
    def failed(self) -> bool:
        return self.rc not in (0, NO_TESTS)


def pytest_cmd(paths: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", *paths, "--nbval-lax", *extra]


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


def make_parts(tests: list[str], labs: list[str]) -> list[Part]:
    """The parts of a run. No paths: the rest of tests/, each slow file, each notebook. Paths
    given: the test paths together (one process), each notebook on its own (a folder of
    notebooks: each one in it)."""
    if not (tests or labs):
        slow = [f for f in SLOW_FILES if (ROOT / f).exists()]
        parts = [Part("tests", ["tests", *(f"--ignore={f}" for f in slow)])]
        parts += [Part(f, [f]) for f in slow]
        labs = ["labs"]
    else:
        parts = [Part(" ".join(tests), tests)] if tests else []
    notebooks: list[str] = []
    for path in labs:
        p = ROOT / path
        notebooks += ([str(n.relative_to(ROOT)) for n in sorted(p.glob("[0-9][0-9]_*.ipynb"))]
                      if p.is_dir() else [path])
    by_lab = {Path(n).name[:2]: n for n in notebooks}
    return parts + [Part(n, [n], notebook=True, after={by_lab[d] for d in reads(n) if d in by_lab})
                    for n in notebooks]


def reads(notebook: str) -> set[str]:
    """The labs whose baselines a notebook loads (``lab.load_baseline("01")`` in its source)."""
    source = (ROOT / notebook).with_suffix(".py")
    text = source.read_text() if source.exists() else (ROOT / notebook).read_text()
    return set(re.findall(r"""load_baseline\(\s*["'](\d\d)["']""", text)) - {Path(notebook).name[:2]}


def priorities(parts: list[Part]) -> dict[str, float]:
    """Each part's expected seconds plus the longest chain of parts that wait on it."""
    try:
        last = json.loads(TIMES.read_text())
    except (OSError, ValueError):
        last = {}
    own = {p.name: float(last.get(p.name, TYPICAL_S.get(p.name, 60))) for p in parts}
    waiting = {p.name: [q.name for q in parts if p.name in q.after] for p in parts}
    rank: dict[str, float] = {}

    def rank_of(name: str) -> float:
        if name not in rank:
            rank[name] = own[name]   # a cycle (two labs reading each other) ends here
            rank[name] += max((rank_of(w) for w in waiting[name]), default=0.0)
        return rank[name]
    return {p.name: rank_of(p.name) for p in parts}


def part_threads(part: Part) -> dict[str, str]:
    """The environment that keeps a part at one thread (the notebooks': NOTEBOOK_THREADS)."""
    if part.notebook:
        return {"OMP_NUM_THREADS": os.environ.get("NOTEBOOK_THREADS") or "1"}
    return {"MINSERVE_TEST_THREADS": "1"}


def run_part(part: Part, extra: list[str], env: dict[str, str]) -> None:
    start = time.monotonic()
    with open(part.log, "w") as out:
        proc = subprocess.Popen(pytest_cmd(part.args, extra), cwd=ROOT,
                                env={**env, **part_threads(part)}, stdout=out,
                                stderr=subprocess.STDOUT)
        # wait4 returns the CPU time of the process and of every descendant it waited for
        # (notebook kernels, servers a test started): how busy the part kept its core.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = part.rc = os.waitstatus_to_exitcode(status)
    part.seconds = time.monotonic() - start
    part.cpu_seconds = usage.ru_utime + usage.ru_stime
    lines = [ln.strip(" =") for ln in part.log.read_text(errors="replace").splitlines() if ln.strip()]
    part.summary = lines[-1] if lines else "(no output)"


def failure_report(part: Part) -> str:
    """A failed part's log from pytest's FAILURES (or ERRORS) section on; else its last 150 lines."""
    if not part.log.exists():
        return part.summary
    lines = part.log.read_text(errors="replace").splitlines()
    first = next((i for i, ln in enumerate(lines) if re.match(r"^=+ (FAILURES|ERRORS) =+$", ln)), None)
    return "\n".join(lines[first:] if first is not None else lines[-150:])


def run_shared(parts: list[Part], extra: list[str], env: dict[str, str], workers: int,
               spare: SpareCores | None = None) -> int:
    """Run the parts, ``workers`` at a time, and one more while ``spare`` (if given) sees a core
    idle (tests/spare_cores.py). Returns the suite's exit status."""
    LOGS.mkdir(parents=True, exist_ok=True)
    rank = priorities(parts)
    pending = sorted(parts, key=lambda p: -rank[p.name])
    finished: set[str] = set()
    done: list[Part] = []
    running: list[Part] = []
    changed, start = threading.Condition(), time.monotonic()
    more = " (and one more while a core sits idle)" if spare else ""
    print(f"suite: {len(parts)} parts, {workers} workers at one thread each{more}; each part's "
          f"output is in {LOGS.relative_to(ROOT)}/", flush=True)

    def next_ready() -> Part | None:
        """The first pending part whose inputs are done; with nothing running and nothing ready
        (the rest wait on each other), the first pending one."""
        ready = [p for p in pending if p.after <= finished] or ([] if running else pending)
        return ready[0] if ready else None

    def run(part: Part) -> None:
        try:
            run_part(part, extra, env)
        except Exception as exc:  # noqa: BLE001 - a part that cannot start is a failed part
            part.rc, part.summary = -1, f"could not run: {exc!r}"
        with changed:
            running.remove(part)
            done.append(part)
            finished.add(part.name)
            verdict = "FAILED" if part.failed else "passed"
            busy = f", CPU {part.cpu_seconds / part.seconds:.0%}" if part.seconds > 1 else ""
            print(f"[{len(done):2d}/{len(parts)}] {verdict} {part.name} in "
                  f"{part.seconds / 60:.1f} min{busy}: {part.summary}", flush=True)
            changed.notify_all()

    threads = []
    with changed:
        while pending or running:
            part, why = next_ready(), None
            if part is not None and len(running) >= workers:
                why = spare.room_for_one_more() if spare and len(running) == workers else None
                part = part if why else None
            if part is None:
                changed.wait(SPARE_POLL_S if spare else None)
                if spare:
                    spare.sample()
                continue
            pending.remove(part)
            running.append(part)
            if spare:
                spare.restart()   # the new part's start-up is not in the window yet
            if why:
                print(f"  + {part.name} starts beside the others: {why}", flush=True)
            threads.append(threading.Thread(target=run, args=(part,), daemon=True))
            threads[-1].start()
    for t in threads:
        t.join()
    save_times(done)
    return report(done, time.monotonic() - start)


def save_times(parts: list[Part]) -> None:
    try:
        times = json.loads(TIMES.read_text())
    except (OSError, ValueError):
        times = {}
    times.update({p.name: round(p.seconds, 1) for p in parts if p.rc == 0})
    TIMES.write_text(json.dumps(times, indent=1, sort_keys=True))


def report(parts: list[Part], total_s: float) -> int:
    failed = [p for p in parts if p.failed]
    for p in failed:
        print(f"\n==== {p.name} FAILED (exit {p.rc}), {p.log.relative_to(ROOT)} ====")
        print(failure_report(p))
    verdict = "FAILED" if failed else "passed"
    names = ", ".join(p.name for p in failed)
    print(f"==== suite {verdict} in {total_s / 60:.1f} min: {len(parts)} parts, "
          f"{len(failed)} failed{': ' + names if failed else ''} ====", flush=True)
    if failed:
        return 1
    return NO_TESTS if all(p.rc == NO_TESTS for p in parts) else 0


def worker_count() -> int:
    """``TEST_WORKERS`` if set (a positive integer), else one per usable core up to
    ``MAX_DEFAULT_WORKERS``."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if not text:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):   # macOS has no affinity call
            cores = os.cpu_count() or 1
        return max(1, min(cores, MAX_DEFAULT_WORKERS))
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"{WORKERS_ENV} must be a whole number of workers, 1 or more; got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # "two" is the shared layout's older name (two workers on the 2-core boxes), kept as an alias.
    ap.add_argument("--layout", choices=("shared", "two", "one"),
                    default=os.environ.get("TEST_LAYOUT") or "shared",
                    help="workers sharing the parts (default; TEST_WORKERS of them) or one process "
                         "(TEST_LAYOUT)")
    args = ap.parse_args(own)
    env = {**os.environ, "MINSERVE_LAB_CI": "1"}
    tests, labs, extra = split_paths(extra)
    if args.layout == "one":
        paths = tests + labs or ["tests", "labs"]
        return subprocess.call(pytest_cmd(paths, extra), cwd=ROOT, env=env)
    parts = make_parts(tests, labs)
    if len(parts) == 1:   # nothing to share: one process, printing as it runs
        return subprocess.call(pytest_cmd(parts[0].args, extra), cwd=ROOT,
                               env={**env, **part_threads(parts[0])})
    # One more part while a core sits idle, unless TEST_WORKERS fixed the number.
    spare = None if os.environ.get(WORKERS_ENV, "").strip() else SpareCores()
    return run_shared(parts, extra, env, workers=min(worker_count(), len(parts)), spare=spare)


if __name__ == "__main__":
    sys.exit(main())
