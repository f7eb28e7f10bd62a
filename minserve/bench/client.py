"""HTTP load generator against any OpenAI-compatible server (vLLM, ``minserve serve``, ...).

Each request is one streaming POST to ``/v1/completions`` (backend ``openai``) or
``/v1/chat/completions`` (``openai-chat``) with ``stream: true``, ``stream_options:
{include_usage: true}`` (so the server reports the exact completion token count),
``temperature: 0``, ``max_tokens`` (``max_completion_tokens`` for chat) and, when asked, vLLM's
extra field ``ignore_eos``. The
response is read as server-sent events; the time of every chunk that carries output text feeds
TTFT and ITL (definitions in :mod:`minserve.bench.metrics`). Requests go out at the times of
:mod:`minserve.bench.arrivals`, at most ``max_concurrency`` at a time, while
:class:`~minserve.bench.server_metrics.MetricsPoller` samples ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass

import httpx

from minserve.bench.arrivals import arrival_times
from minserve.bench.datasets import SampleRequest
from minserve.bench.metrics import RequestRecord
from minserve.bench.results import BenchOptions, BenchResult, finalize
from minserve.bench.server_metrics import MetricsPoller

TIMEOUT_S = 6 * 60 * 60  # a long run must not be cut by the client; vLLM uses the same bound


@dataclass
class Target:
    api_url: str            # base_url + endpoint
    base_url: str           # for /v1/models and /metrics
    model: str
    chat: bool = False      # openai-chat: messages in, delta.content out
    tokenizer_id: str = ""


class SSEReader:
    """Server-sent events from a line stream: ``data:`` lines accumulate, a blank line ends the
    event. Comment lines (``:`` pings) and other fields (``event:``, ``id:``) are ignored."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        event, self._data = "\n".join(self._data), []
        return event


def build_payload(target: Target, req: SampleRequest, ignore_eos: bool) -> dict:
    payload = {"model": target.model, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    if target.chat:  # chat's current name for the output bound (vLLM's client sends it too)
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(data: dict, chat: bool) -> str | None:
    """The output text of one chunk; None when it carries no choices (e.g. the usage chunk)."""
    choices = data.get("choices")
    if not choices:
        return None
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class _Stream:
    """Folds the chunks of one response into a RequestRecord."""

    def __init__(self, rec: RequestRecord, chat: bool):
        self.rec, self.chat = rec, chat
        self.parts: list[str] = []
        self.first_choice_t: float | None = None
        self.last_t: float | None = None      # last content chunk
        self.end_t: float | None = None       # last chunk with choices

    def on_event(self, event: str, now: float) -> None:
        if event.strip() == "[DONE]":
            return
        data = json.loads(event)
        if data.get("error"):
            raise RuntimeError(f"server error in stream: {data['error']}")
        usage = data.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.rec.output_tokens = int(usage["completion_tokens"])
        text = _chunk_text(data, self.chat)
        if text is None:
            return
        self.end_t = now
        if self.first_choice_t is None:
            self.first_choice_t = now
        if not text:
            return  # role-only or finish chunks carry no token: they are not "first token"
        if self.last_t is None:
            self.rec.ttft = now - self.rec.start_time
        else:
            self.rec.itl.append(now - self.last_t)
        self.last_t = now
        self.parts.append(text)

    def finish(self) -> None:
        rec = self.rec
        rec.generated_text = "".join(self.parts)
        if self.first_choice_t is None:
            rec.error = "the stream ended without a single completion chunk"
            return
        if self.last_t is None:  # choices but no text at all (e.g. only special tokens)
            rec.ttft = self.first_choice_t - rec.start_time
        rec.latency = max(self.end_t, self.last_t or 0.0) - rec.start_time
        rec.success = True


async def send_request(client: httpx.AsyncClient, target: Target, req: SampleRequest,
                       ignore_eos: bool, scheduled_s: float = 0.0) -> RequestRecord:
    rec = RequestRecord(request_id=req.request_id, scenario=req.scenario, prompt_len=req.prompt_len,
                        expected_output_len=req.expected_output_len, scheduled_s=scheduled_s)
    stream, reader = _Stream(rec, target.chat), SSEReader()
    payload = build_payload(target, req, ignore_eos)
    rec.start_time = time.perf_counter()
    try:
        async with client.stream("POST", target.api_url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                return rec
            async for line in resp.aiter_lines():
                event = reader.feed(line)
                if event is not None:
                    stream.on_event(event, time.perf_counter())
        tail = reader.flush()  # a server may close without the final blank line
        if tail is not None:
            stream.on_event(tail, time.perf_counter())
        stream.finish()
    except Exception as e:  # noqa: BLE001 - every failure becomes a failed record, not a crash
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
    return rec


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $OPENAI_API_KEY`` when set, as `vllm bench serve` sends it, so the
    same command works against a server started with --api-key (for /metrics too)."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def fetch_model_id(base_url: str) -> str:
    """The first model the server lists at ``/v1/models`` (vLLM's default when --model is unset)."""
    try:
        async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as client:
            resp = await client.get(f"{base_url}/v1/models")
            resp.raise_for_status()
            models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"could not list models at {base_url}/v1/models ({type(e).__name__}: {e}); "
                         "is the server up? (or pass --model)") from e
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


async def _dispatch(client, target, requests, opts: BenchOptions, pbar) -> list[RequestRecord]:
    """Send each request at its arrival time; the semaphore caps requests in flight."""
    times = arrival_times(len(requests), opts.request_rate, opts.burstiness, opts.seed)
    limit = (asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency
             else contextlib.nullcontext())

    async def one(req, t):
        async with limit:
            rec = await send_request(client, target, req, opts.ignore_eos, float(t))
        if pbar is not None:
            pbar.update(1)
        return rec

    start = time.perf_counter()
    tasks = []
    for req, t in zip(requests, times):
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, t)))
    return list(await asyncio.gather(*tasks))


async def run_http(target: Target, requests: list[SampleRequest], opts: BenchOptions,
                   tokenizer=None, metrics_interval_s: float = 1.0) -> BenchResult:
    """One benchmark run at ``opts.request_rate``; returns vLLM's summary plus our frames."""
    from tqdm import tqdm
    limits = httpx.Limits(max_connections=opts.max_concurrency, max_keepalive_connections=None)
    headers = auth_headers()
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, headers=headers) as client, \
            httpx.AsyncClient(timeout=max(metrics_interval_s, 5.0), headers=headers) as metrics_client:
        t0 = time.perf_counter()
        poller = MetricsPoller(metrics_client, f"{target.base_url}/metrics", metrics_interval_s, t0)
        poller.start()
        pbar = None if opts.disable_tqdm else tqdm(total=len(requests))
        try:
            records = await _dispatch(client, target, requests, opts, pbar)
        finally:
            if pbar is not None:
                pbar.close()
            duration = time.perf_counter() - t0
            await poller.stop()
    meta = {"backend": "openai-chat" if target.chat else "openai", "model_id": target.model,
            "tokenizer_id": target.tokenizer_id or target.model, "num_prompts": len(requests)}
    summary, frame = finalize(records, duration, t0, meta, opts, tokenizer)
    return BenchResult(summary=summary, requests=frame, server_metrics=poller.frame())
