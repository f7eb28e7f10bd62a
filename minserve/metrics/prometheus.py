"""Prometheus metrics with vLLM's names, so a Grafana dashboard or a scrape script built for vLLM's
``/metrics`` reads a minserve engine unchanged.

Each :class:`EngineMetrics` owns its own ``CollectorRegistry``: registering on prometheus_client's
global default registry would make a second engine in the same notebook fail with "Duplicated
timeseries". Every series carries the label ``model_name``.

What each latency means is defined once, in :mod:`minserve.metrics.latency`; here is when it is
observed (all from the request's timeline, perf_counter seconds):

- TTFT (``vllm:time_to_first_token_seconds``): in the step that brings a request its first
  tokens. It contains the wait in the queue and the whole prefill.
- ITL (``vllm:inter_token_latency_seconds``): once per step that brings a request new tokens after
  its first: the time since its previous emission. A step that accepts several tokens at once
  (speculative decoding) is one observation, not several with 0 s between them. A preemption
  shows up as one long gap (the recompute), which is exactly what the streaming client saw.
- TPOT (``vllm:request_time_per_output_token_seconds``): (last token - first token) / (output
  tokens - 1), one value per finished request with at least two tokens.
- E2E (``vllm:e2e_request_latency_seconds``): finished minus arrival.
- queue (``vllm:request_queue_time_seconds``): first admission to the running set minus arrival.
- prefill (``vllm:request_prefill_time_seconds``): first token minus first admission.
- decode (``vllm:request_decode_time_seconds``): last token minus first token.

Token counters: ``vllm:prompt_tokens`` grows by a request's whole prompt length once, when its
first token appears (like vLLM, prefix-cache hits are included; chunks and recomputes are not
counted twice; a request with n > 1 counts it once, for sample 0); ``vllm:generation_tokens``
grows by the tokens each step appended, every sample's. Per-request series (TTFT, the latency
histograms, ``vllm:request_success``) take one observation per sample, as vLLM's children do. The
per-request token histograms and the request-level latencies are observed when a request
finishes, whatever the reason (an aborted request that never got a token observes E2E and, if it
was scheduled, queue time; the phases it never reached are skipped).
``vllm:iteration_tokens_total`` takes one sample per engine step: the prefill plus decode tokens
the step computed.

Buckets are vLLM's own boundaries, so SLO rules written against ``le="..."`` series of a vLLM
server keep meaning the same thing here.
"""

from __future__ import annotations

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry,
                               Counter, Gauge, Histogram, generate_latest)

from minserve.metrics.latency import step_itl_s, timeline_latencies, ttft_s
from minserve.metrics.spec import SpecDecodeMetrics

# vLLM's boundaries (vllm/v1/metrics/loggers.py). TTFT spans 1 ms .. 43 min; per-token latencies
# 10 ms .. 80 s (a CPU decode step is ~10-200 ms, so they land in the middle); request-level
# latencies 0.3 s .. 2 h.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
PER_TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

FINISHED_REASONS = ("stop", "length", "abort", "error")
REQUEST_N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's for vllm:request_params_n
# The process-wide collectors prometheus_client puts on its default registry (process_* from
# /proc on Linux, python_info, python_gc_*): vLLM serves them, and dashboards chart memory and CPU.
PROCESS_COLLECTORS = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    """The ``vllm:*`` series of one engine, fed once per step by :meth:`record_step`.

    ``enabled=False`` (the engine's ``disable_log_stats=True``) makes every method return at once;
    the registry still exists (empty of samples) so a server's ``/metrics`` route keeps working.
    ``max_model_len`` only sizes the token-count histograms (vLLM does the same).
    """

    def __init__(self, model_name: str, enabled: bool = True, max_model_len: int = 8192):
        self.model_name = model_name
        self.enabled = enabled
        self.registry = CollectorRegistry()
        if not enabled:
            return
        # Counters are named without "_total": prometheus_client appends it in the exposition,
        # giving exactly vLLM's "vllm:prompt_tokens_total".
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        # The labelled children are resolved once here: .labels() hashes and locks on every call,
        # which the per-step path should not pay.
        self._running = gauge("vllm:num_requests_running", "Number of requests in the running set.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to run.")
        self._kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._pc_queries = counter("vllm:prefix_cache_queries",
                                   "Prefix cache queries, in terms of number of queried tokens.")
        self._pc_hits = counter("vllm:prefix_cache_hits",
                                "Prefix cache hits, in terms of number of cached tokens.")
        self._preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.spec = SpecDecodeMetrics(reg, model_name)
        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens",
                                          "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                          labels + ["finished_reason"], registry=reg)
        self._success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}

        tok_buckets = build_1_2_5_buckets(max_model_len)
        self._ttft = histogram("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._itl = histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", PER_TOKEN_BUCKETS)
        self._tpot = histogram("vllm:request_time_per_output_token_seconds",
                               "Histogram of time per output token in seconds (per request).",
                               PER_TOKEN_BUCKETS)
        self._e2e = histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self._queue = histogram("vllm:request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request.",
                                REQUEST_LATENCY_BUCKETS)
        self._prefill = histogram("vllm:request_prefill_time_seconds",
                                  "Histogram of time spent in PREFILL phase for request.",
                                  REQUEST_LATENCY_BUCKETS)
        self._decode = histogram("vllm:request_decode_time_seconds",
                                 "Histogram of time spent in DECODE phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self._req_prompt = histogram("vllm:request_prompt_tokens",
                                     "Number of prefill tokens processed.", tok_buckets)
        self._req_generation = histogram("vllm:request_generation_tokens",
                                         "Number of generation tokens processed.", tok_buckets)
        self._iteration_tokens = histogram("vllm:iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.",
                                           ITERATION_TOKENS_BUCKETS)
        self._inference = histogram("vllm:request_inference_time_seconds",
                                    "Histogram of time spent in RUNNING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self._params_n = histogram("vllm:request_params_n",
                                   "Histogram of the n request parameter.", REQUEST_N_BUCKETS)
        self._params_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", tok_buckets)
        for collector in PROCESS_COLLECTORS:  # shared, read-only collectors: safe in many registries
            reg.register(collector)

    def set_cache_config(self, block_size: int, num_blocks: int, cache_dtype: str,
                         enable_prefix_caching: bool, num_blocks_override: int | None,
                         gpu_memory_utilization: float) -> None:
        """``vllm:cache_config_info``: value 1, the KV cache's configuration in its labels (vLLM's
        names, as strings). ``num_gpu_blocks`` is the size of the KV pool wherever it lives (a CPU
        engine's too), as a dashboard computes cache capacity from it and ``block_size``."""
        if not self.enabled:
            return
        labels = {"block_size": str(block_size), "cache_dtype": cache_dtype,
                  "enable_prefix_caching": str(enable_prefix_caching),
                  "gpu_memory_utilization": str(gpu_memory_utilization),
                  "num_cpu_blocks": "None", "num_gpu_blocks": str(num_blocks),
                  "num_gpu_blocks_override": str(num_blocks_override),
                  "prefix_caching_hash_algo": "sha256", "engine": "0"}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels),
              registry=self.registry).labels(**labels).set(1)

    # ---- recording (engine hot path) -----------------------------------------------------------

    def record_step(self, stats, sampled: list, finished: list) -> None:
        """Record one engine step.

        ``stats`` is the step's StepStats. ``sampled`` lists the requests that got new output
        tokens this step, as ``(request, num_new_tokens)`` pairs: those tokens are the last
        ``num_new_tokens`` of ``request.timeline.token_s``, all stamped with the step's time (a
        bare request is accepted too and means one token). ``finished`` lists the requests retired
        this step (final status, ``timeline.finished_s`` set). A request may be in both lists.
        """
        if not self.enabled:
            return
        self.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self._pc_queries.inc(stats.prefix_cache_queries)
            self._pc_hits.inc(stats.prefix_cache_hits)
        self._iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)

        for item in sampled:
            # A bare request: the one-token-per-step form, kept while callers move to pairs.
            req, num_new = item if isinstance(item, tuple) else (item, 1)
            if num_new < 1:
                continue
            self._generation_tokens.inc(num_new)
            times = req.timeline.token_s
            itl = step_itl_s(times, num_new)
            if itl is not None:
                self._itl.observe(itl)
            elif times:
                # Its first tokens: TTFT, and the prompt is counted now, once. A recompute after
                # preemption keeps the tokens already out, so it never lands here twice.
                self._ttft.observe(ttft_s(req.timeline.arrival_s, times[0]))
                if getattr(req, "sample_index", 0) == 0:  # n > 1: the prompt once per request
                    self._prompt_tokens.inc(len(req.prompt_token_ids))
        for req in finished:
            self._record_finished(req, req.status.value)

    def set_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Refresh the three gauges (also outside a step: an abort changes them at once)."""
        if not self.enabled:
            return
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_usage.set(kv_cache_usage)

    def record_abort(self, request) -> None:
        """A request aborted outside a step (``abort_request``): count it under ``abort`` and
        observe whatever latencies it reached."""
        if not self.enabled:
            return
        self._record_finished(request, "abort")

    def _record_finished(self, req, reason: str) -> None:
        self._success[reason].inc()
        lat = timeline_latencies(req.timeline)
        for hist, value in ((self._e2e, lat.e2e_s), (self._queue, lat.queue_s),
                            (self._prefill, lat.prefill_s), (self._decode, lat.decode_s),
                            (self._tpot, lat.tpot_s)):
            if value is not None:  # a phase the request never reached is not observed
                hist.observe(value)
        self._req_prompt.observe(len(req.prompt_token_ids))
        self._req_generation.observe(len(req.output_token_ids))
        if lat.prefill_s is not None and lat.decode_s is not None:
            self._inference.observe(lat.prefill_s + lat.decode_s)  # first scheduled -> last token
        if getattr(req, "sample_index", 0) == 0:  # once per client request, not per sample of n
            parent = getattr(req, "parent", None)  # parallel sampling: each sample has params.n=1
            self._params_n.observe(parent.n if parent is not None else req.params.n)
            self._params_max_tokens.observe(req.max_tokens)  # as resolved for this prompt (vLLM's too)

    # ---- reading ---------------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text format of this engine's registry (what ``/metrics`` serves)."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """Current values for notebooks and tests, keyed by vLLM name.

        Gauges and counters under their name (counters without the ``_total`` suffix), histograms
        as ``{name}_count`` and ``{name}_sum``. ``vllm:request_success`` is the total over reasons,
        and each reason is also given as ``vllm:request_success{finished_reason="stop"}`` etc.
        """
        out: dict[str, float] = {}
        for family in self.registry.collect():
            name = family.name
            if family.type == "gauge":
                for s in family.samples:
                    out[name] = s.value
            elif family.type == "counter":
                total = 0.0
                for s in family.samples:
                    if not s.name.endswith("_total"):
                        continue  # the _created timestamp
                    total += s.value
                    reason = s.labels.get("finished_reason")
                    if reason is not None:
                        out[f'{name}{{finished_reason="{reason}"}}'] = s.value
                out[name] = total
            elif family.type == "histogram":
                for s in family.samples:
                    if s.name.endswith("_count") or s.name.endswith("_sum"):
                        out[s.name] = s.value
        return out
