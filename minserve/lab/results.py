"""Record a lab's baseline, and read an earlier lab's.

Every lab ends by writing its key numbers (medians, rates, counts measured in that run) to
``labs/results/<lab>.json``; later labs load them to compare against ("your TTFT at 512 prompt
tokens was 310 ms in lab 01; with prefix caching it is ..."). The files are per machine and per
run, so ``labs/results/`` is git-ignored. ``MINSERVE_LAB_RESULTS`` points elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import platform
from datetime import datetime
from pathlib import Path

RESULTS_ENV = "MINSERVE_LAB_RESULTS"


def results_dir(directory: str | Path | None = None) -> Path:
    """``directory``, else ``$MINSERVE_LAB_RESULTS``, else ``results/`` beside the notebook
    (Jupyter and nbval run a notebook in its own folder, so that is ``labs/results``)."""
    if directory is not None:
        return Path(directory)
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    return Path.cwd() / "results"


def _clean(v):
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):  # numpy scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def record_baseline(lab: str, numbers: dict, directory: str | Path | None = None,
                    preset=None, echo: bool = True) -> Path:
    """Write ``numbers`` (a flat or nested dict of this run's measurements) with the run's context
    (preset, device, model, machine, date, and the load other processes put on the machine since
    ``lab.setup()``) to ``<results>/<lab>.json``; returns the path."""
    from minserve.lab.presets import get_preset
    preset = preset or get_preset()
    path = results_dir(directory) / f"{lab}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"lab": lab, "date": datetime.now().isoformat(timespec="seconds"),
           "preset": preset.name, "device": preset.device, "model": preset.model,
           "machine": platform.machine(), "cpus": os.cpu_count(), "load": _load_so_far(),
           "numbers": _clean(numbers)}
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if echo:
        print(f"baseline of lab {lab} written to {path}:")
        for k, v in doc["numbers"].items():
            print(f"  {k}: {v}")
    return path


def _load_so_far() -> dict | None:
    """Other processes' CPU use since ``lab.setup()``: numbers from a busy machine say so."""
    from minserve.lab.lessons import _run
    probe = _run.get("probe")
    return None if probe is None else probe.peek().as_dict()


def load_baseline(lab: str, directory: str | Path | None = None) -> dict | None:
    """The numbers lab ``lab`` recorded (the dict given to :func:`record_baseline`, plus
    ``_context``), or None with a note when that lab has not been run here yet."""
    path = results_dir(directory) / f"{lab}.json"
    if not path.exists():
        print(f"no baseline for lab {lab} yet ({path} is missing): run that lab first to compare.")
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    numbers = dict(doc.get("numbers", {}))
    numbers["_context"] = {k: v for k, v in doc.items() if k != "numbers"}
    return numbers
