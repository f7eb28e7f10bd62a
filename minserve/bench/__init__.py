"""Load generation and benchmark metrics: ``minserve bench serve`` and its Python API.

- :mod:`~minserve.bench.datasets` / :mod:`~minserve.bench.scenarios`: workloads (random, ShareGPT,
  and our qa / rag / code / agent / mix shapes built from offline text);
- :mod:`~minserve.bench.arrivals`: when requests are sent (Poisson / gamma, like vLLM);
- :mod:`~minserve.bench.metrics`: TTFT, TPOT, ITL, E2EL, throughput, goodput (vLLM's formulas);
- :mod:`~minserve.bench.client`: the HTTP client for OpenAI-compatible servers;
- :mod:`~minserve.bench.inprocess`: the same benchmark straight on an ``LLMEngine``;
- :mod:`~minserve.bench.results` and :mod:`~minserve.bench.server_metrics`: result files, report,
  and the server's ``/metrics`` time series.
"""

from minserve.bench.arrivals import arrival_times
from minserve.bench.datasets import SampleRequest, get_samples
from minserve.bench.inprocess import run_inprocess
from minserve.bench.metrics import RequestRecord, calculate_metrics
from minserve.bench.results import BenchOptions, BenchResult

__all__ = ["arrival_times", "SampleRequest", "get_samples", "run_inprocess", "RequestRecord",
           "calculate_metrics", "BenchOptions", "BenchResult"]
