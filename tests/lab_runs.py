"""Run a whole lab notebook against a server, and check what a server run must show.

Shared by tests/test_lab_target.py (a real ``minserve serve``) and tests/test_vllm_peer.py (a real
vLLM): the lab runs top to bottom with ``MINSERVE_LAB_TARGET`` and ``MINSERVE_LAB_API_KEY`` set and
``MINSERVE_LAB_CI=1``, as ``make test`` runs notebooks, in the ``smoke`` preset
(minserve/lab/presets.py): the notebooks' own run (labs/, ``quick``) proves each lab at the
learner's sizes; here every cell runs again through the target, on fewer points. Every cell
marked ``# needs the engine:`` must print its one skip line and nothing else; every other cell
must run, the lab's lessons must be judged on what the server measured, its baseline file
written, and its run summary printed last.
"""

from __future__ import annotations

import os
from pathlib import Path

from minserve.lab import target as tg
from minserve.lab.presets import PRESET_ENV

ROOT = Path(__file__).resolve().parents[1]
SERVER_LABS = ("01_prefill_vs_decode", "02_continuous_batching", "07_overload_and_goodput")


def run_lab(name: str, base: str, results: Path, api_key: str | None = None, preset: str = "smoke"):
    """Execute ``labs/{name}.py`` in a fresh kernel against ``base``; returns the executed notebook
    (nbclient raises on any cell's error)."""
    import jupytext
    import nbclient
    env = {tg.TARGET_ENV: base, "MINSERVE_LAB_CI": "1", "MINSERVE_LAB_RESULTS": str(results),
           PRESET_ENV: preset}
    if api_key:
        env[tg.API_KEY_ENV] = api_key
    old = {k: os.environ.get(k) for k in (*env, tg.API_KEY_ENV)}
    os.environ.pop(tg.API_KEY_ENV, None)
    os.environ.update(env)      # the kernel inherits this process's environment
    try:
        nb = jupytext.read(ROOT / "labs" / f"{name}.py")
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "labs")}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _first_line(cell) -> str:
    return next((ln for ln in cell.source.splitlines() if ln.strip()), "")


def check_server_run(name: str, nb, base: str, results: Path, baseline: bool = True,
                     lessons: bool = True) -> list[str]:
    """Assert what a lab run against ``base`` must show; returns the lesson lines it printed.
    ``baseline=False`` for a lab whose baseline is made of the engine's own records (labs 03, 04),
    ``lessons=False`` for one whose checked lessons all read them (lab 03: its HTTP sections show
    the live figures and the planner, and judge nothing)."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    marked = [c for c in code if tg.MARKER.match(_first_line(c))]
    assert marked, f"{name} has no cell that needs the engine"
    for c in marked:
        what = tg.MARKER.match(_first_line(c))["what"]
        assert stream_text(c) == f"skipped against {base} (in process only): this exercise needs {what}\n"
        assert not [o for o in c.outputs if o.output_type != "stream"]
    ran = [c for c in code if c not in marked]
    assert all(c.execution_count for c in ran)
    # The server-capable sections measured something: their lessons were judged, the baseline
    # was written, and the run summary came last.
    judged = [ln for c in ran for ln in stream_text(c).splitlines() if ln.startswith("Lesson")]
    assert bool(judged) == lessons, f"{name} judged {len(judged)} lessons against {base}"
    assert (results / f"{name[:2]}.json").exists() == baseline
    assert f"Lab {name[:2]} ran in" in stream_text(ran[-1])
    assert "(smoke preset)" in stream_text(ran[-1])   # run_lab's preset reached the kernel
    return judged
