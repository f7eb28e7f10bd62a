"""minserve: a compact LLM serving engine for learning inference optimization (vLLM's API)."""

import logging as _logging
import os as _os

from minserve.config import EngineConfig
from minserve.engine.llm import LLM
from minserve.engine.llm_engine import LLMEngine, StepStats
from minserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob", "StepStats"]
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
