"""How many threads a decode step uses: as many as the cores that are actually free.

Why this exists: an OpenMP parallel region ends only when its slowest thread does. On a quiet
machine every thread has a core; when another process (a notebook beside a server, a load
generator, a busy loop) takes one, the team member that shares its core loses whole scheduler time
slices (milliseconds), and a decode step runs ~150 parallel regions (fused C kernel and PyTorch
alike, both on PyTorch's libgomp pool). Measured on 2 cores with one busy loop: batch-1 decode fell
from 45 to ~2 tok/s with 2 threads, while 1 thread on the free core ran at ~30. libgomp reads its
wait policy (OMP_WAIT_POLICY) once, when torch is imported, and PASSIVE costs a third of the quiet
speed, so the remedy here is the team size, chosen by measurement rather than by a guess:

- the runner times every decode-only step, keyed by its shape (path, batch bucket), at the thread
  count it ran with; a few recent steps per key form the *baseline* of the current count;
- now and then the controller *probes* another count for a few steps of the same shape and keeps
  whichever is faster (by a margin, medians: robust to a noisy neighbour). A probe starts
  - when the baseline *jumps* (the last steps are much slower than the ones before: contention
    appeared): probe fewer threads at once;
  - when the load hint changes (other processes' CPU use on our CPUs, from /proc/stat): cores came
    back or went away; the hint only triggers probes, measured time decides;
  - otherwise periodically, rate-limited so that losing probes cost at most ``budget`` of the time
    (a 2-thread step under contention can take half a second: such a probe is rare, and it stops
    at its first step that is twice the baseline).

The controller is pure bookkeeping over (key, thread count, seconds) with an injectable clock and
hint, so tests drive it with made-up timings (tests/test_contention.py). Turn it off with
``MINSERVE_ADAPTIVE_THREADS=0`` (steps then run with PyTorch's thread count, as before).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable
from pathlib import Path

ENV_SWITCH = "MINSERVE_ADAPTIVE_THREADS"


def adaptive_threads_enabled(config=None) -> bool:
    """The config's ``adaptive_threads`` (default True), unless the environment switch says 0."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return config is None or config.adaptive_threads


class CpuLoadHint:
    """Cores of this process's CPU set that other processes left free lately (Linux /proc/stat).

    Busy time of our CPUs (user, nice, system, irq, softirq and steal: a hypervisor taking the CPU
    is contention too) minus this process's own CPU time, per second of wall time. Returns None
    where /proc/stat is missing or does not list our CPUs (then only timings count).
    """

    def __init__(self) -> None:
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = []
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            lines = Path("/proc/stat").read_text().splitlines()
        except OSError:
            return None
        wanted, busy_ticks, seen = {f"cpu{c}" for c in self.cpus}, 0, 0
        for line in lines:
            f = line.split()
            if f and f[0] in wanted:
                v = [int(x) for x in f[1:9]]
                busy_ticks += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                seen += 1
        if not wanted or seen != len(wanted):
            return None
        return time.perf_counter(), busy_ticks / os.sysconf("SC_CLK_TCK"), time.process_time()

    def __call__(self) -> float | None:
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[0] - last[0] < 0.1:
            return None
        others = max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0])
        return max(0.0, len(self.cpus) - others)


class ThreadController:
    """Chooses the thread count of each step from measured step times (see the module docstring).

    Usage per step: ``n = choose(key)``; run the step with n threads; ``record(key, n, seconds)``.
    ``key`` names the step's shape (steps of one key cost about the same at one thread count);
    None marks a step that is not timed (prefill): it runs with the current count.
    """

    def __init__(self, max_threads: int, *, enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter,
                 load_hint: Callable[[], float | None] | None = None,
                 window: int = 8, probe_steps: int = 3, margin: float = 0.05, jump: float = 1.5,
                 budget: float = 0.01, min_interval_s: float = 10.0, max_interval_s: float = 60.0,
                 hint_period_s: float = 1.0) -> None:
        self.max_threads, self.enabled = max(1, int(max_threads)), enabled and max_threads > 1
        self.threads = self.max_threads           # the current choice
        self.clock, self.load_hint = clock, load_hint
        self.window, self.probe_steps, self.margin, self.jump = window, probe_steps, margin, jump
        self.budget, self.min_interval_s, self.max_interval_s = budget, min_interval_s, max_interval_s
        self.hint_period_s = hint_period_s
        self.probes = self.switches = 0           # counters for benchmarks and tests
        self._recent: dict[Hashable, deque] = {}  # key -> seconds of recent steps at self.threads
        self._probe: dict | None = None           # {"key", "threads", "samples", "why", "skipped"}
        self._want: tuple[int, str] | None = None  # a probe asked for by a jump or the hint
        self._next_probe_s = clock()              # probe once early: an engine may start contended
        self._next_hint_s = clock() + hint_period_s
        self._hint: int | None = None             # the count the load hint last suggested
        self._hint_pending = False                # ... a change we have not probed yet
        self._hint_probe_s = clock()              # no hint probe before (after a losing probe)
        self._up = False                          # periodic probes alternate down / up

    def choose(self, key: Hashable | None) -> int:
        """Thread count for the next step of shape ``key``."""
        if not self.enabled or key is None:
            return self.threads
        if self._probe is None:
            self._poll_hint()
            self._maybe_start_probe(key)
        p = self._probe
        if p is not None and p["key"] == key:
            return p["threads"]
        if p is not None:
            p["skipped"] += 1
            if p["skipped"] > 2 * self.probe_steps:   # that shape stopped coming: probe this one
                self._probe, self._want = None, (p["threads"], p["why"])
        return self.threads

    def record(self, key: Hashable | None, threads: int, seconds: float) -> None:
        """A step of shape ``key`` ran with ``threads`` threads in ``seconds``."""
        if not self.enabled or key is None:
            return
        p = self._probe
        if p is not None and p["key"] == key and p["threads"] == threads:
            self._record_probe(p, seconds)
        elif threads == self.threads:
            recent = self._recent.setdefault(key, deque(maxlen=self.window))
            recent.append(seconds)
            self._check_jump(recent)

    # ---- triggers ------------------------------------------------------------------------------

    def _check_jump(self, recent: deque) -> None:
        if len(recent) < self.window or self.threads == 1:
            return
        older, latest = list(recent)[:-3], list(recent)[-3:]
        if statistics.median(latest) > self.jump * statistics.median(older):
            for _ in older:                       # the baseline is now the slow regime
                recent.popleft()
            self._want = (self.threads - 1, "jump")

    def _poll_hint(self) -> None:
        if self.load_hint is None or self.clock() < self._next_hint_s:
            return
        self._next_hint_s = self.clock() + self.hint_period_s
        free = self.load_hint()
        if free is None:
            return
        suggested = min(self.max_threads, max(1, int(free + 0.5)))
        # Each change of the hint is worth one probe; a steady hint that timings refuted is not.
        if suggested != self._hint:
            self._hint, self._hint_pending = suggested, True
        self._hint_pending = self._hint_pending and suggested != self.threads

    def _maybe_start_probe(self, key: Hashable) -> None:
        recent = self._recent.get(key)
        if recent is None or len(recent) < 3:     # no baseline for this shape yet
            return
        if self._want is not None:
            threads, why = self._want
        elif self._hint_pending and self.clock() >= self._hint_probe_s:
            threads, why, self._hint_pending = self._hint, "hint", False
        elif self.clock() >= self._next_probe_s:
            down, up = self.threads - 1, self.threads + 1
            self._up = not self._up if 1 <= down and up <= self.max_threads else up <= self.max_threads
            threads, why = (up if self._up else down), "periodic"
        else:
            return
        self._want = None
        if 1 <= threads <= self.max_threads and threads != self.threads:
            self._probe = {"key": key, "threads": threads, "samples": [], "why": why, "skipped": 0}
            self.probes += 1

    # ---- decisions -----------------------------------------------------------------------------

    def _record_probe(self, p: dict, seconds: float) -> None:
        base = statistics.median(self._recent[p["key"]])
        p["samples"].append(seconds)
        lost_badly = seconds > 2 * base           # e.g. 2 threads on a shared core: stop now
        if not lost_badly and len(p["samples"]) < self.probe_steps:
            return
        self._probe = None
        won = not lost_badly and statistics.median(p["samples"]) < (1 - self.margin) * base
        now = self.clock()
        if won:
            self.threads, self.switches = p["threads"], self.switches + 1
            self._recent = {p["key"]: deque(p["samples"], maxlen=self.window)}
            self._next_probe_s = now + self.min_interval_s
        else:
            # Rate-limit by what the probe cost: losing probes take at most `budget` of the time.
            cost = sum(max(0.0, s - base) for s in p["samples"])
            self._next_probe_s = now + min(self.max_interval_s,
                                           max(self.min_interval_s, cost / self.budget))
            self._hint_probe_s = now + self.min_interval_s   # a flapping hint probes at most this often


def release_openmp_pool() -> bool:
    """Hand this thread's idle OpenMP workers back (``omp_pause_resource_all``), before another
    thread takes over the engine's steps. True if the runtime did it.

    Why: libgomp gives each thread that opens a parallel region a pool of its own, and pools persist.
    When a server builds its engine on the main thread (loading and warm-up steps) and then steps it
    on an engine thread, both pools exist, libgomp counts more threads than cores, and it stops
    spinning between regions: every region (a decode step has ~150) wakes its team by futex. Measured
    on the 2-core AVX2 EPYC (2026-12-04, batch 1, 128 tokens, adaptive threads off): 34-35 ms per token
    on an engine thread against 22-25 on the main thread, 77k context switches against 500; with the
    main thread's pool released first, 24.5-26 ms and 500. Safe to call anywhere: outside a parallel
    region it only frees this thread's pool (the next region here builds a new one)."""
    import ctypes

    for line in _maps():
        if "libgomp" in line and line.rstrip().endswith(".so.1"):
            try:
                return ctypes.CDLL(line.split()[-1]).omp_pause_resource_all(1) == 0   # omp_pause_soft
            except (OSError, AttributeError):
                return False
    return False


def _maps() -> list[str]:
    try:
        return Path("/proc/self/maps").read_text().splitlines()   # the runtime PyTorch loaded
    except OSError:
        return []
