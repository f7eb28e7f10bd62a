"""A lab's headline lessons, checked on the lab's own data.

A lesson is a claim about measurements ("past the knee, a bounded waiting room keeps more goodput
than an open door"). On a quiet machine the data shows it; on a box shared by a room of
participants it sometimes does not, and a notebook that prints the claim anyway prints a sentence
its own numbers contradict. So a lab states each lesson as a check::

    lab.lesson("07-goodput", "past the knee, the bounded room keeps more goodput than the open server",
               shown=bounded_gp > open_gp,
               evidence=f"goodput at {top} req/s offered: {bounded_gp:.2f} bounded vs {open_gp:.2f} open",
               load=run.load, calibration=cal)

and the notebook prints one of two things, both derived from the same numbers:

- **shown**: the claim and its evidence;
- **not shown**: that this run did not show it, the evidence, the cause it can measure (other
  processes' CPU use during the run, the spread of repeated calibrations) and how to get a clean run.
  When the machine was quiet and the calibration stable, noise is not the explanation, and the
  notebook says so: that is worth reporting.

Every lesson is also appended to ``<results>/lessons/<lab>.jsonl`` so the robustness benchmark
(``benchmarks/bench_lab_robustness.py``) can count which lessons appeared in which runs. A lesson
that does not show never raises: the lab goes on teaching from what the run did show.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import time

from minserve.lab.hygiene import Calibration, Load, LoadProbe
from minserve.lab.results import results_dir

CLEAN_RUN = ("For a clean run, rerun this section when the machine is quieter: close other "
             "notebooks and programs (`top` shows who holds the CPU), or, on a shared box, rerun "
             "at a quieter moment.")


@dataclass
class Lesson:
    """One checked claim of a lab: ``key`` is ``"<lab>-<name>"`` (e.g. ``"04-warm-ttft"``)."""

    key: str
    claim: str
    shown: bool
    evidence: str
    causes: list[str] = field(default_factory=list)
    timing: bool = True     # False: a lesson on counts or model outputs, which load cannot move

    @property
    def lab(self) -> str:
        return self.key.split("-", 1)[0]

    def text(self) -> str:
        if self.shown:
            return f"Lesson shown: {self.claim}. {self.evidence}."
        head = f"Lesson NOT shown in this run: {self.claim}. What this run measured: {self.evidence}."
        if self.causes:
            return f"{head} Likely cause: {'; '.join(self.causes)}. {CLEAN_RUN}"
        if not self.timing:
            return (f"{head} This is a count, not a timing, so a busy machine does not explain it: "
                    "the engine or the settings above may have changed. Please report it with this "
                    "notebook's output.")
        return (f"{head} No measured cause: the machine was quiet and no calibration was unstable, so "
                "noise does not explain it; the engine or the settings above may have changed. "
                "Please report it with this notebook's output.")


def causes_of(load: Load | None = None, calibration: Calibration | None = None,
              extra: list[str] | None = None) -> list[str]:
    """The measurable reasons a timing lesson may not show: a busy machine, an unstable calibration."""
    causes = list(extra or [])
    if load is not None and load.busy:
        causes.append(load.describe())
    if calibration is not None and not calibration.stable:
        causes.append(f"repeated calibration runs were {100 * calibration.spread:.0f} % apart "
                      f"({calibration.name})")
    if calibration is not None and calibration.load is not None and calibration.load.busy \
            and (load is None or not load.busy):
        causes.append(f"during the calibration, {calibration.load.describe()}")
    return causes


def lesson(key: str, claim: str, *, shown: bool, evidence: str, load: Load | None = None,
           calibration: Calibration | None = None, causes: list[str] | None = None,
           timing: bool = True, echo: bool = True, directory=None) -> Lesson:
    """Check one lesson, print what the run showed, and record it (see the module docstring).
    ``causes`` adds reasons the notebook measured itself (e.g. "two of five sweep points were
    slower than the calibration"). ``timing=False`` marks a lesson on counts or model outputs,
    which a busy machine cannot explain away: the load is then neither looked up nor blamed."""
    if timing and load is None and _run["probe"] is not None:
        load = _run["probe"].peek()   # no window given: the load since lab.setup()
    measured = causes_of(load if timing else None, calibration, causes)
    result = Lesson(key=key, claim=claim, shown=bool(shown), evidence=evidence.rstrip(". "),
                    causes=[] if shown else measured, timing=timing)
    if timing and not shown and not result.causes and (load is None or load.others_cores is None):
        result.causes = ["the load from other processes could not be measured here"]
    if echo:
        print(result.text())
    _record(result, load, directory)
    return result


# This kernel's run of a lab: started by lab.setup(), closed by lab.summary().
_run: dict = {"t0": None, "probe": None, "lessons": []}


def start_run() -> None:
    """Called by :func:`minserve.lab.setup`: the lab's run time and load are counted from here."""
    _run.update(t0=time.perf_counter(), probe=LoadProbe().start(), lessons=[])


def summary(lab: str, preset=None) -> dict:
    """The lab's closing line: its run time since ``lab.setup()``, the load other processes put on
    the machine meanwhile, and which of its lessons this run showed. Returned as a dict too."""
    from minserve.lab.presets import get_preset
    preset = preset or get_preset()
    t0 = _run["t0"] if _run["t0"] is not None else time.perf_counter()
    load = _run["probe"].stop() if _run["probe"] is not None else None
    mine = [x for x in _run["lessons"] if x.lab == lab]
    shown = [x for x in mine if x.shown]
    minutes = (time.perf_counter() - t0) / 60
    text = f"Lab {lab} ran in {minutes:.1f} min ({preset.name} preset)"
    if load is not None:
        text += f"; {load.describe()}"
    if mine:
        text += f". Lessons shown: {len(shown)} of {len(mine)}"
        missing = [x.claim for x in mine if not x.shown]
        if missing:
            text += " (not shown in this run: " + "; ".join(missing) + ")"
    print(text + ".")
    return {"lab": lab, "minutes": round(minutes, 2), "preset": preset.name,
            "load": None if load is None else load.as_dict(),
            "lessons": {x.key: x.shown for x in mine}}


def _record(result: Lesson, load: Load | None, directory) -> None:
    _run["lessons"].append(result)
    try:
        path = Path(results_dir(directory)) / "lessons" / f"{result.lab}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {**asdict(result), "lab": result.lab, "time": datetime.now().isoformat(timespec="seconds"),
               "load": None if load is None else load.as_dict()}
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass  # a read-only folder must not stop a lab


def recorded(lab: str, directory=None) -> list[dict]:
    """Every lesson row lab ``lab`` recorded in ``<results>/lessons/<lab>.jsonl`` (oldest first)."""
    path = Path(results_dir(directory)) / "lessons" / f"{lab}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
