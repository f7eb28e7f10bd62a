"""Notebook set-up: a quiet engine, readable figures, one engine at a time.

:func:`setup` is the first call of every lab. It

- routes minserve's log messages to stdout as plain text at WARNING level: Jupyter paints stderr
  red, and an engine's routine start-up lines ("engine ready in 2.1 s") read as errors to a
  learner. ``setup(log_level="INFO")`` shows them again (still as plain text);
- quiets the libraries' own chatter (transformers' warnings, tqdm's experimental warning);
- sets matplotlib defaults (size, grid, no top/right spines) so every lab's figures look alike;
- returns the :class:`~minserve.lab.presets.Preset` of this run.

:func:`engine_for` keeps at most one engine alive: a lab that changes an engine argument (the KV
budget, ``max_num_seqs``) gets a new engine and the old one's weights and KV pool are freed, so a
laptop never holds two copies of the model.
"""

from __future__ import annotations

import gc
import logging
import platform
import sys
import warnings
from collections.abc import Sequence

from minserve.lab.hygiene import warm
from minserve.lab.presets import Preset, get_preset, is_ci


class _PlainStdoutHandler(logging.Handler):
    """Writes records to whatever ``sys.stdout`` is *now* (Jupyter swaps it per cell)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never break a lab
            self.handleError(record)


def quiet_logging(level: str | int = "WARNING") -> None:
    """minserve's logger: ``level`` and above, as plain text on stdout; library noise off."""
    logger = logging.getLogger("minserve")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = _PlainStdoutHandler()
    handler.setFormatter(logging.Formatter("[minserve %(levelname)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if isinstance(level, int) else level.upper())
    logger.propagate = False
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - transformers is optional for this
        pass
    warnings.filterwarnings("ignore", message=".*IProgress not found.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="tqdm")


def figure_style() -> None:
    """Shared matplotlib defaults for the labs."""
    import matplotlib as mpl
    mpl.rcParams.update({
        "figure.figsize": (9, 3.6), "figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3,
        "axes.spines.top": False, "axes.spines.right": False, "legend.frameon": False,
        "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
    })


def setup(log_level: str | int = "WARNING", preset: str | None = None, *,
          target: str | None = None, api_key: str | None = None) -> Preset:
    """Quiet logs, figure defaults; returns this run's preset (``MINSERVE_LAB_PRESET``). The lab's
    run time and the machine's load are counted from here (``lab.summary(...)`` reports them).

    ``target`` / ``api_key`` (default ``$MINSERVE_LAB_TARGET`` / ``$MINSERVE_LAB_API_KEY``): what
    the lab runs against, the engine in this notebook or a server's URL (see
    :mod:`minserve.lab.target`; :func:`~minserve.lab.target.current` returns it afterwards)."""
    from minserve.lab.lessons import start_run
    from minserve.lab.target import install_cell_marker, set_target
    chosen = set_target(target, api_key)
    install_cell_marker()
    if not chosen.in_process:
        print(f"Target: {chosen}. Cells marked 'needs the engine' are skipped, each with one line.")
    start_run()
    quiet_logging(log_level)
    figure_style()
    try:
        import pandas as pd
        pd.set_option("display.precision", 3)
        pd.set_option("display.max_columns", 30)
        pd.set_option("display.width", 160)
    except ImportError:
        pass
    return get_preset(preset)


def environment_summary() -> dict:
    """What the labs run on: Python, torch, device, threads, preset. Printed and returned."""
    import torch
    preset = get_preset()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": preset.device,
        "cpu threads": torch.get_num_threads(),
        "CUDA": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available",
        "preset": preset.name,
        "CI mode": is_ci(),
    }
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    return info


_current: dict = {"key": None, "llm": None}


def engine_for(preset: Preset | None = None, model: str | None = None, warm_up: bool = True,
               warm_prompts: Sequence[int] | None = None, warm_batches: Sequence[int] | None = None,
               **engine_args):
    """An ``LLM`` for ``model`` (default: the preset's) with the preset's engine arguments plus
    ``engine_args``, warmed up on the shapes the lab will measure (prompt lengths
    ``warm_prompts`` and decode batch sizes ``warm_batches``; see :func:`minserve.lab.hygiene.warm`
    for the defaults). The same arguments give back the same ``LLM`` (nothing reloads when a cell
    is run again); different ones free the previous engine first (a notebook variable still
    holding the old one keeps it alive)."""
    from minserve import LLM
    from minserve.lab.target import current
    preset = preset or get_preset()
    model = model or preset.model
    target = current()
    if not target.in_process:
        return _remote_for(target, model, engine_args, warm_up)
    kwargs = preset.engine_kwargs(**engine_args)
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    if _current["key"] == key and _current["llm"] is not None:
        llm = _current["llm"]
        if not llm.llm_engine.has_unfinished_requests():
            return llm
    release_engine()
    llm = LLM(model, **kwargs)
    if warm_up:
        warm(llm, warm_prompts, warm_batches)
    _current.update(key=key, llm=llm)
    return llm


def _remote_for(target, model: str, engine_args: dict, warm_up: bool):
    """Against a server: no engine here. The engine arguments are the server's (a client cannot
    resize a server), so the ones asked for are named, once per distinct request."""
    from minserve.lab.target import RemoteLLM
    asked = {k: v for k, v in engine_args.items() if v is not None}
    key = ("remote", target, model, tuple(sorted((k, repr(v)) for k, v in asked.items())))
    if _current["key"] == key and _current["llm"] is not None:
        return _current["llm"]
    release_engine()
    if asked:
        print(f"Engine arguments are the server's own: {', '.join(f'{k}={v!r}' for k, v in asked.items())} "
              f"cannot be set over HTTP (asked of {target.base_url}).")
    llm = RemoteLLM(target, model, asked)
    if warm_up:   # one short request: the server's first one may pay for first use of a shape
        from minserve.lab.workload import make_requests, run_workload
        run_workload(llm, make_requests(llm.get_tokenizer(), 32, 4, num_requests=2), live=False,
                     name="warm-up")
    _current.update(key=key, llm=llm)
    return llm


def release_engine() -> None:
    """Drop the engine :func:`engine_for` holds (its weights and KV pool are freed)."""
    _current.update(key=None, llm=None)
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
