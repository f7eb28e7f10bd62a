"""Measurement hygiene for the labs: warm engines, calibrations from repeats, the machine's load.

A workshop box shared by a room of participants is never quiet, and a fresh engine is never warm.
Three things keep a lab's numbers honest there, and they live here, once, rather than in each
notebook:

- :func:`warm` runs the prefill and decode shapes a lab will measure before it measures them. The
  first step of each shape pays for first use (allocations, OpenMP teams, the thread controller's
  first probes of that shape): measured here, a fresh engine's first 300-token prefill took 3.8 s
  and its second 0.9 s; the first decode after a 900-token prompt 0.8 s and the next 0.04 s.
- :func:`calibrate` repeats a measurement until the last few agree, and reports the median *and the
  spread*: a lab that scales its rates and objectives from one cold run scales them from noise.
- :class:`LoadProbe` measures how much CPU other processes (and the hypervisor) took while a
  piece of work ran, from ``/proc/stat``. A result that carries its load can say *why* a lesson
  did not show ("other processes kept 0.9 of 2 cores busy") instead of printing a claim its own
  numbers contradict (see :mod:`minserve.lab.lessons`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from minserve.engine.threads import CpuLoadHint

# Other processes holding a quarter of a core or more, on average, makes a 2-core run "busy":
# the labs' timing lessons were seen to vanish from about half a core taken (issue 19's runs).
BUSY_CORES = 0.25


@dataclass
class Load:
    """CPU that other processes took during a window: ``others_cores`` cores on average out of
    ``cpus`` (None where ``/proc/stat`` cannot tell, e.g. macOS)."""

    others_cores: float | None
    cpus: int
    seconds: float

    @property
    def busy(self) -> bool:
        return self.others_cores is not None and self.others_cores >= BUSY_CORES

    def describe(self) -> str:
        if self.others_cores is None:
            return "the load from other processes is unknown here (no /proc/stat)"
        if not self.busy:
            return f"the machine was quiet (other processes used {self.others_cores:.2f} of {self.cpus} cores)"
        return (f"other processes kept {self.others_cores:.2f} of {self.cpus} cores busy "
                f"over these {self.seconds:.0f} s")

    def as_dict(self) -> dict:
        return {"others_cores": None if self.others_cores is None else round(self.others_cores, 3),
                "cpus": self.cpus, "seconds": round(self.seconds, 2), "busy": self.busy}


class LoadProbe:
    """Measures other processes' CPU use between :meth:`start` (or entering the ``with`` block)
    and :meth:`stop`; the result is a :class:`Load` (also ``probe.load`` after the block).

    >>> with LoadProbe() as probe:
    ...     pass                      # the work being measured
    >>> probe.load.others_cores is None or probe.load.others_cores >= 0
    True
    """

    def __init__(self) -> None:
        self._hint = CpuLoadHint()
        self.load: Load | None = None
        self._t0 = time.perf_counter()

    def start(self) -> "LoadProbe":
        self._hint = CpuLoadHint()          # a fresh sample: the window starts now
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> Load:
        self.load = self.peek()
        self._hint._last = None      # stopped: a later peek or stop has no window
        return self.load

    def peek(self) -> Load:
        """The load so far, leaving the window open."""
        cpus = len(self._hint.cpus) or (os.cpu_count() or 1)
        seconds = time.perf_counter() - self._t0
        start = self._hint._last
        free = self._hint() if seconds >= 0.1 else None
        self._hint._last = start     # CpuLoadHint moves its window on each call: put it back
        others = None if free is None else max(0.0, cpus - free)
        return Load(others_cores=others, cpus=cpus, seconds=seconds)

    def __enter__(self) -> "LoadProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def machine_load(seconds: float = 0.5) -> Load:
    """Other processes' CPU use over the next ``seconds`` (this process sleeping meanwhile)."""
    probe = LoadProbe().start()
    time.sleep(seconds)
    return probe.stop()


@dataclass
class Calibration:
    """Repeated measurements of one quantity: the median is what a lab scales from, the spread
    ((max - min) / median of the samples kept) says whether it may."""

    name: str
    samples: list[float]
    kept: list[float]
    tolerance: float
    load: Load | None = None
    unit: str = "s"

    @property
    def median(self) -> float:
        return float(statistics.median(self.kept))

    @property
    def spread(self) -> float:
        m = self.median
        return (max(self.kept) - min(self.kept)) / m if m > 0 else float("inf")

    @property
    def stable(self) -> bool:
        return self.spread <= self.tolerance

    def describe(self) -> str:
        scale, unit = (1000.0, "ms") if self.unit == "s" else (1.0, self.unit)
        fmt = ".0f" if self.unit == "s" else ".3g"   # ratios and rates keep their digits
        shown = ", ".join(f"{scale * s:{fmt}}" for s in self.samples)
        verdict = ("stable" if self.stable else
                   f"NOT stable (more than {100 * self.tolerance:.0f} % apart): rates and objectives "
                   "scaled from it are approximate")
        text = (f"{self.name}: median {scale * self.median:{fmt}} {unit} of the last {len(self.kept)} "
                f"runs (all runs: {shown} {unit}), spread {100 * self.spread:.0f} %, {verdict}")
        return text + (f"; {self.load.describe()}" if self.load is not None else "")

    def as_dict(self) -> dict:
        return {"name": self.name, "median": self.median, "spread": round(self.spread, 4),
                "stable": self.stable, "samples": [round(s, 6) for s in self.samples],
                "load": None if self.load is None else self.load.as_dict()}


def calibrate(measure: Callable[[], float], *, name: str = "calibration", repeats: int = 3,
              max_runs: int = 6, tolerance: float = 0.2, discard_first: bool = True,
              unit: str = "s", echo: bool = True) -> Calibration:
    """Runs ``measure()`` (which returns one number, e.g. a service time in seconds) until its last
    ``repeats`` results lie within ``tolerance`` of their median, or ``max_runs`` runs were made.

    The first run is discarded when ``discard_first`` (it pays for whatever warm-up missed). The
    result keeps every sample, so a notebook can show how far apart the runs were."""
    if repeats < 1 or max_runs < repeats:
        raise ValueError(f"calibrate: need 1 <= repeats <= max_runs, got repeats={repeats}, "
                         f"max_runs={max_runs}")
    samples: list[float] = []
    probe = LoadProbe().start()
    needed = repeats + (1 if discard_first else 0)
    while True:
        samples.append(float(measure()))
        kept = samples[1:] if discard_first and len(samples) > 1 else samples
        kept = kept[-repeats:]
        cal = Calibration(name, list(samples), list(kept), tolerance, unit=unit)
        if len(samples) >= needed and (cal.stable or len(samples) >= max_runs):
            break
    cal.load = probe.stop()
    if echo:
        print(cal.describe())
    return cal


# ---- warm-up -------------------------------------------------------------------------------------

@dataclass
class WarmUp:
    """What :func:`warm` ran: prompt lengths prefilled, decode batch sizes, seconds taken."""

    prompt_tokens: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0


def warm(llm, prompt_tokens: Sequence[int] | None = None, batch_sizes: Sequence[int] | None = None,
         decode_tokens: int = 4) -> WarmUp:
    """Runs the shapes a lab will measure once, unmeasured: a prefill of each of ``prompt_tokens``
    (default: a short prompt and one full chunk of ``max_num_batched_tokens``) followed by
    ``decode_tokens`` decode steps at that context, then decode steps at each of ``batch_sizes``
    (default: 1 and ``max_num_seqs``) so every batch shape's thread choice has its first probes
    behind it. Prompts are clamped to the engine's ``max_model_len``."""
    from minserve import SamplingParams
    cfg = llm.llm_engine.config
    budget = int(cfg.max_num_batched_tokens)
    limit = max(8, int(llm.llm_engine.max_model_len) - decode_tokens - 1)
    prompts = sorted({max(1, min(int(n), limit)) for n in (prompt_tokens or (8, budget))})
    batches = sorted({max(1, min(int(b), int(cfg.max_num_seqs))) for b in (batch_sizes or (1, cfg.max_num_seqs))})
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    # Each prompt once: what a first use pays for (a kernel or primitive built for the shape, memory
    # first touched) it pays on that run. Measured 2026-12-05 on the AVX2 host, fresh engine,
    # prompts of 16 to 768 tokens three times each, at one thread and at two: no first run more
    # than 0.12 s slower than the next two (a second warm-up run bought nothing and cost as much). Every prompt differs from the others: with prefix caching on, a repeat
    # would be a cache hit, not a prefill.
    for j, n in enumerate(prompts):
        llm.generate([{"prompt_token_ids": _ids(n, offset=1 + j)}], params, use_tqdm=False)
    for b in batches:
        first = 1 + len(prompts) + b
        llm.generate([{"prompt_token_ids": _ids(8, offset=first + i)} for i in range(b)], params,
                     use_tqdm=False)
    return WarmUp(prompts, batches, time.perf_counter() - t0)


def _ids(n: int, offset: int = 0) -> list[int]:
    """``n`` token ids of ordinary vocabulary (ids 1000 to 3999); the first id differs per
    ``offset``, so prompts of different offsets share no cached block. Runs of consecutive ids
    that no lab prompt (real text) shares, so they never become its cache hits either."""
    return [1000 + (offset * 37 + k) % 3000 for k in range(n)]
