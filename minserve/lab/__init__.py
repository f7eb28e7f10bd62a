"""Notebook helpers for the labs: presets, workloads with live plots, timelines, correlations,
widget controls, answer checks and baselines.

Typical lab cell sequence::

    from minserve import lab
    P = lab.setup()                                   # quiet logs, figure style, the preset
    llm = lab.engine_for(P)                           # one engine, sized by the preset
    reqs = lab.make_requests(llm.get_tokenizer(), prompt_tokens=[32, 512], output_tokens=16)
    run = lab.run_workload(llm, reqs)                 # live figure + progress while it runs
    lab.request_timeline(run)                         # Gantt chart from the engine's records
    lab.correlation_grid(run)                         # what latency moves with
    lab.record_baseline("01", run.key_numbers())      # labs/results/01.json

Modules: :mod:`~minserve.lab.presets` (quick | full | smoke, CI flag), :mod:`~minserve.lab.session`
(setup, one engine at a time), :mod:`~minserve.lab.target` (the engine here, or a server:
``MINSERVE_LAB_TARGET``, ``lab.needs_engine``), :mod:`~minserve.lab.workload` (requests, runs, RunResult),
:mod:`~minserve.lab.live` (in-place figure and progress), :mod:`~minserve.lab.timeline`,
:mod:`~minserve.lab.correlate`, :mod:`~minserve.lab.controls` (run_experiment + widgets),
:mod:`~minserve.lab.checks` (q.check / q.hint / q.solution), :mod:`~minserve.lab.results`,
:mod:`~minserve.lab.hygiene` (warm-up, calibration from repeats, the machine's load) and
:mod:`~minserve.lab.lessons` (a lab's headline claims, checked on its own data).

Each lab's own exercises, hints, solutions and helpers are course content, not toolkit: they live
beside the notebooks in ``labs/course/`` (``from course import lab07 as ex``).
"""

from minserve.lab import local_server, prefix, sidechannel, traffic  # labs 04 and 07: lab.prefix.*, ...
from minserve.lab.checks import ChoiceCheck, CheckFailed, FunctionCheck, Mistake, NumberCheck
from minserve.lab.controls import control_panel, run_experiment
from minserve.lab.hygiene import Calibration, Load, LoadProbe, calibrate, machine_load, warm
from minserve.lab.lessons import Lesson, lesson, summary
from minserve.lab.correlate import add_context, compare_distributions, correlation_grid, pearson, scatter_corr
from minserve.lab.presets import CI_ENV, PRESET_ENV, Preset, get_preset, is_ci
from minserve.lab.results import load_baseline, record_baseline
from minserve.lab.session import engine_for, environment_summary, release_engine, setup
from minserve.lab.target import API_KEY_ENV, TARGET_ENV, RemoteLLM, Target, needs_engine
from minserve.lab.target import current as current_target
from minserve.lab.timeline import chunk_table, request_timeline
from minserve.lab.workload import (EngineRecordsRequired, RunResult, make_requests, run_sweep,
                                   run_workload, scenario_requests, text_of_length)

__all__ = [
    "ChoiceCheck", "CheckFailed", "FunctionCheck", "Mistake", "NumberCheck", "control_panel",
    "run_experiment", "add_context", "compare_distributions", "correlation_grid", "pearson",
    "scatter_corr", "CI_ENV", "PRESET_ENV", "Preset", "get_preset", "is_ci", "load_baseline",
    "record_baseline", "engine_for", "environment_summary", "release_engine", "setup",
    "chunk_table", "request_timeline", "EngineRecordsRequired", "RunResult", "make_requests",
    "run_sweep", "run_workload", "scenario_requests", "text_of_length",
    "API_KEY_ENV", "TARGET_ENV", "RemoteLLM", "Target", "needs_engine", "current_target",
    "Calibration", "Load", "LoadProbe", "calibrate", "machine_load", "warm", "Lesson", "lesson", "summary",
    "local_server", "prefix", "sidechannel", "traffic",
]

# Labs 02 and 03: static vs continuous batching, load sweeps, KV-cache pressure (lab/capacity.py).
from minserve.lab.capacity import (StaticBatcher, achieved_rate, extra_steps, kv_allocation,  # noqa: E402
                                   load_table, mixed_requests, pressure_table, run_mixed,
                                   run_static, running_over_time, seat_use, steps_taken)
__all__ += ["StaticBatcher", "achieved_rate", "extra_steps", "kv_allocation", "load_table", "mixed_requests",
            "pressure_table", "run_mixed", "run_static", "running_over_time", "seat_use", "steps_taken"]
