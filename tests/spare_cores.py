"""How much of this process's cores sat idle lately, and whether one more part of the suite fits.

tests/run_suite.py gives each usable core a worker; most parts keep their core busy, but some
wait a lot: vLLM's part (its processes start one after another, the labs' requests arrive on a
schedule) leaves much of its core idle (the runs' figures: docs/getting-started.md). A part
started while a core is idle makes use of it. The meter reads the kernel's own count of idle time
per CPU (``/proc/stat``), so it sees every process on the machine, ours or not: on a box someone
else is using, no extra part starts.

Why not minserve's own /proc/stat reader (``minserve.engine.threads.CpuLoadHint``) or the doctor's
meminfo: the runner must not import the package it tests. A package that fails to import fails its
parts, each with its report; a runner that imported it would fail before any part ran.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_MEMINFO = Path("/proc/meminfo")
WINDOW_S = 10.0          # idle time averaged over this long: a part's own pauses are shorter
IDLE_FOR_EXTRA = 0.5     # cores idle on average over the window before one more part starts
# A part may hold two engines (~0.7 GiB each for SmolLM2 in fp32) and a notebook kernel or a server.
MEMORY_FOR_EXTRA = 4 * 2**30


def read_idle(stat: str, cpus: set[int]) -> tuple[float, float]:
    """(idle, total) jiffies summed over the lines ``cpuN`` of /proc/stat's text for N in cpus.
    Idle counts iowait too: a core waiting on the disk has room for another part."""
    idle = total = 0.0
    for line in stat.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        ticks = [float(f) for f in fields[:8]]   # user nice system idle iowait irq softirq steal
        idle += ticks[3] + ticks[4]
        total += sum(ticks)
    return idle, total


def available_memory(meminfo: str) -> float | None:
    """Bytes the kernel says a new process can have (MemAvailable), or None when it does not say."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return None


class SpareCores:
    """Idle cores over the last ``WINDOW_S`` seconds among ``cpus`` (the process's own by default).

    ``sample()`` is called every second or two; ``idle()`` is None until a whole window is seen,
    and on a system without /proc (macOS), where no extra part ever starts."""

    def __init__(self, cpus: set[int] | None = None, window_s: float = WINDOW_S,
                 stat: Path = PROC_STAT, meminfo: Path = PROC_MEMINFO):
        if cpus is None:
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.cpus, self.window_s, self.stat, self.meminfo = set(cpus), window_s, stat, meminfo
        self.samples: deque[tuple[float, float, float]] = deque()

    def sample(self, now: float | None = None) -> None:
        try:
            idle, total = read_idle(self.stat.read_text(), self.cpus)
        except OSError:
            return
        now = time.monotonic() if now is None else now
        self.samples.append((now, idle, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()   # keep one sample at least a window old

    def idle(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, idle0, total0), (t1, idle1, total1) = self.samples[0], self.samples[-1]
        if t1 - t0 < self.window_s or total1 <= total0:
            return None
        return len(self.cpus) * (idle1 - idle0) / (total1 - total0)

    def room_for_one_more(self) -> str | None:
        """Why one more part fits now (for the run's log), or None when it does not."""
        idle = self.idle()
        if idle is None or idle < IDLE_FOR_EXTRA:
            return None
        try:
            memory = available_memory(self.meminfo.read_text())
        except OSError:
            memory = None
        if memory is None or memory < MEMORY_FOR_EXTRA:
            return None
        return f"{idle:.1f} of {len(self.cpus)} cores idle over the last {self.window_s:.0f} s"

    def restart(self) -> None:
        """Forget the window: a part just started, and its own start-up is not yet in the count."""
        self.samples.clear()
