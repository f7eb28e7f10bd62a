"""Sample the server's Prometheus ``/metrics`` while a benchmark runs.

TTFT and TPOT only explain themselves next to what the server was doing: how many requests were
running or queued, how full the KV cache was, whether it preempted. Any server that exports
vLLM's metric names works (vLLM itself, ``minserve serve``). Several label sets of one series
(e.g. one per engine) are summed; a series the server lacks is recorded as NaN. Older vLLM names
(``gpu_cache_usage_perc``, ``gpu_prefix_cache_*``) are accepted as fallbacks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

log = logging.getLogger("minserve")

# Our column -> Prometheus sample names to try, first found wins.
SERIES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "num_preemptions_total": ("vllm:num_preemptions_total",),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries_total",
                                   "vllm:gpu_prefix_cache_queries_total"),
}
COLUMNS = ["t", *SERIES]


def parse_metrics_text(text: str) -> dict[str, float]:
    """Prometheus exposition text -> one float per :data:`SERIES` column (NaN if absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    out = {}
    for column, names in SERIES.items():
        out[column] = next((totals[n] for n in names if n in totals), math.nan)
    return out


class MetricsPoller:
    """Polls ``url`` every ``interval_s`` seconds in the background; ``t`` is seconds since
    ``t0`` (the run's perf_counter start), the clock the request records use."""

    def __init__(self, client, url: str, interval_s: float, t0: float):
        self.client, self.url, self.interval_s, self.t0 = client, url, interval_s, t0
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None
        self._warned = False

    async def sample(self) -> None:
        try:
            resp = await self.client.get(self.url)
            resp.raise_for_status()
            values = parse_metrics_text(resp.text)
        except Exception as e:  # noqa: BLE001 - a server without /metrics must not fail the run
            if not self._warned:
                log.warning("could not read %s (%s); no server metrics will be recorded", self.url, e)
                self._warned = True
            return
        self.samples.append({"t": time.perf_counter() - self.t0, **values})

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[dict]:
        """Stop polling, take one last sample (the state at the end), return all samples."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.sample()
        return self.samples

    def frame(self):
        import pandas as pd
        return pd.DataFrame(self.samples, columns=COLUMNS)
