"""minserve: a compact LLM serving engine for learning inference optimization (vLLM's API)."""

from minserve.config import EngineConfig
from minserve.engine.llm import LLM
from minserve.engine.llm_engine import LLMEngine, StepStats
from minserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob", "StepStats"]
__version__ = "0.1.0"
