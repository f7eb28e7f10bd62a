"""Metrics: vLLM-named Prometheus series per engine, and pandas frames of requests and steps.

``EngineMetrics`` is fed by the engine every step; ``requests_frame`` / ``steps_frame`` turn the
engine's request timelines and StepStats into DataFrames for the labs (pandas imported lazily).
"""

from minserve.metrics.frames import requests_frame, steps_frame
from minserve.metrics.prometheus import EngineMetrics

__all__ = ["EngineMetrics", "requests_frame", "steps_frame"]
