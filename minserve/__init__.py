"""minserve: a compact LLM serving engine for learning inference optimization (vLLM's API).

Extension points for side experiments (docs/extending.md): :class:`LogitsProcessor` (vLLM v1's
batch-level logits processors, with :class:`BatchUpdate`), :func:`register_scheduling_policy` and
:class:`SchedulingPolicy`, :data:`ModelRegistry` (``register_model``, ``get_supported_archs``),
and :class:`StepObserver` (``LLMEngine.add_step_observer``; :class:`LogitsRecorder`).
"""

import logging as _logging
import os as _os
import typing as _typing


def _kernels_from_checkout() -> None:
    """``minserve.kernels`` is the repository's top-level ``kernels/`` (pyproject.toml maps it).
    A wheel or an editable install knows the mapping; a bare checkout on sys.path (a ``python``
    started in the repository before any install) does not, so there it is loaded from
    ``../kernels`` here, before anything imports it. A checkout's own ``../kernels`` also wins
    over an installed mapping, so a second checkout on ``PYTHONPATH`` (a before/after benchmark)
    never pairs its Python with another copy's kernels. ``decode.c`` marks the directory as
    ours (Hugging Face's ``kernels`` package may sit next to an installed minserve)."""
    import importlib.util
    import sys
    from pathlib import Path
    name = f"{__name__}.kernels"
    init = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if not (init.parent / "decode.c").is_file():
        return  # an installed package: its own mapping finds minserve.kernels
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module  # as an import would: minserve.kernels is an attribute too


_kernels_from_checkout()

from minserve import lazy as _lazy  # noqa: E402  (after the kernels' mapping above)

# The public names and their home modules, imported on first use (minserve/lazy.py says why).
_EXPORTS = {
    "EngineConfig": "minserve.config", "LLM": "minserve.engine.llm",
    "LLMEngine": "minserve.engine.llm_engine", "StepStats": "minserve.engine.llm_engine",
    "LogitsProcessor": "minserve.engine.logits_processor", "BatchUpdate": "minserve.engine.logits_processor",
    "MoveDirectionality": "minserve.engine.logits_processor",
    "StepObserver": "minserve.engine.observers", "LogitsRecorder": "minserve.engine.observers",
    "SchedulingPolicy": "minserve.engine.scheduling_policy",
    "register_scheduling_policy": "minserve.engine.scheduling_policy",
    "ModelRegistry": "minserve.models.registry",
    "CompletionOutput": "minserve.outputs", "Logprob": "minserve.outputs",
    "RequestMetrics": "minserve.outputs", "RequestOutput": "minserve.outputs",
    "RequestOutputKind": "minserve.sampling_params", "SamplingParams": "minserve.sampling_params",
}

if _typing.TYPE_CHECKING:   # what static tools (type checkers, the docs' API pages) read
    from minserve.config import EngineConfig
    from minserve.engine.llm import LLM
    from minserve.engine.llm_engine import LLMEngine, StepStats
    from minserve.engine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
    from minserve.engine.observers import LogitsRecorder, StepObserver
    from minserve.engine.scheduling_policy import SchedulingPolicy, register_scheduling_policy
    from minserve.models.registry import ModelRegistry
    from minserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from minserve.sampling_params import RequestOutputKind, SamplingParams


__getattr__, __dir__ = _lazy.exports(globals(), _EXPORTS)

# Extension points (docs/extending.md): LogitsProcessor (with BatchUpdate, MoveDirectionality),
# the scheduling-policy registry, ModelRegistry and step observers.
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob", "StepStats",
           "LogitsProcessor", "BatchUpdate", "MoveDirectionality", "SchedulingPolicy", "register_scheduling_policy",
           "ModelRegistry", "StepObserver", "LogitsRecorder"]
__version__ = "0.1.0"


def _configure_logging() -> None:
    """Show minserve's start-up facts (KV cache size, load time) the way vLLM does: an INFO handler
    on our own logger only, never the root logger. MINSERVE_LOG_LEVEL=WARNING quiets it."""
    logger = _logging.getLogger("minserve")
    if not logger.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s minserve: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(_os.environ.get("MINSERVE_LOG_LEVEL", "INFO").upper())
        logger.propagate = False


_configure_logging()
