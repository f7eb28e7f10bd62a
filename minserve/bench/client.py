"""HTTP load generator against any OpenAI-compatible server (vLLM, ``minserve serve``, ...).

Each request is one streaming POST to ``/v1/completions`` (backend ``openai``) or
``/v1/chat/completions`` (``openai-chat``) with ``stream: true``, ``stream_options:
{include_usage: true}`` (so the server reports the exact completion token count),
``temperature: 0``, ``max_tokens`` (``max_completion_tokens`` for chat) and, when asked, vLLM's
extra field ``ignore_eos``. The
response is read as server-sent events; the time of every chunk that carries output (an
*emission*) feeds TTFT and ITL (definitions in :mod:`minserve.bench.metrics`).

When TTFT starts: at the first chunk whose choice carries output text or a token, not at the
first byte, nor at a chunk with only the role (chat streams open with ``{"role": "assistant"}``),
only a ``finish_reason`` or only ``usage``. vLLM's client stamps the first chunk with choices
whatever it holds; that is the same moment against a vLLM server, which sends the role together
with the first token, but a server that opens the stream with the role at once (OpenAI's
convention) would show a TTFT of about 0. Waiting for output measures the same thing on both.

Requests go out at the times of :mod:`minserve.bench.arrivals`, at most ``max_concurrency`` at a
time, while :class:`~minserve.bench.server_metrics.MetricsPoller` samples ``/metrics``.
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
from minserve.bench.metrics import RequestRecord, set_latencies
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
    api_key: str | None = None  # None: $OPENAI_API_KEY (see auth_headers)


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


def _choice_output(data: dict, chat: bool) -> tuple[str, bool] | None:
    """``(text, is_emission)`` of one chunk's first choice; None when the chunk has no choices
    (the usage chunk). A choice is an emission when it carries output text, or a token whose
    text is empty (a special token, a partial character): token ids, logprobs or reasoning."""
    choices = data.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        # vLLM's reasoning parsers stream thinking tokens apart from the content.
        token = bool(delta.get("reasoning_content") or delta.get("reasoning"))
    else:
        text, token = choice.get("text") or "", False
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):  # completions: {"tokens": [...]}; chat: {"content": [...]}
        token = token or bool(logprobs.get("tokens") or logprobs.get("content"))
    token = token or bool(choice.get("token_ids"))  # vLLM's return_token_ids extension
    return text, bool(text) or token


class _Stream:
    """Folds the chunks of one response into a RequestRecord."""

    def __init__(self, rec: RequestRecord, chat: bool):
        self.rec, self.chat = rec, chat
        self.parts: list[str] = []
        self.emissions: list[float] = []      # times of the chunks that carried output
        self.first_choice_t: float | None = None
        self.end_t: float | None = None       # last chunk with choices

    def on_event(self, event: str, now: float) -> None:
        if event.strip() == "[DONE]":
            return
        data = json.loads(event)
        if data.get("error"):
            raise RuntimeError(f"server error in stream: {data['error']}")
        if data.get("id") and not self.rec.response_id:
            self.rec.response_id = str(data["id"])
        usage = data.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.rec.output_tokens = int(usage["completion_tokens"])
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.rec.cached_tokens = int(cached)
        out = _choice_output(data, self.chat)
        if out is None:
            return
        text, emission = out
        self.end_t = now
        if self.first_choice_t is None:
            self.first_choice_t = now
        if emission:  # role-only and finish-only chunks carry no token: not an emission
            self.emissions.append(now)
        if text:
            self.parts.append(text)

    def finish(self) -> None:
        rec = self.rec
        rec.generated_text = "".join(self.parts)
        if self.first_choice_t is None:
            rec.error = "the stream ended without a single completion chunk"
            return
        # Choices but no output in any of them (a server that sends neither text nor tokens,
        # e.g. for only special tokens): the first chunk with choices is all that is left, which
        # is vLLM's rule.
        set_latencies(rec, self.emissions or [self.first_choice_t], self.end_t)
        rec.success = True


async def send_request(client: httpx.AsyncClient, target: Target, req: SampleRequest,
                       ignore_eos: bool, scheduled_s: float = 0.0) -> RequestRecord:
    rec = RequestRecord(request_id=req.request_id, scenario=req.scenario, prompt_len=req.prompt_len,
                        expected_output_len=req.expected_output_len, scheduled_s=scheduled_s)
    stream, reader = _Stream(rec, target.chat), SSEReader()
    payload = build_payload(target, req, ignore_eos)
    rec.start_time = time.perf_counter()
    try:
        # A workload's request class (minserve serve's admission header; vLLM ignores it).
        headers = {"x-priority-class": req.priority_class} if req.priority_class else None
        async with client.stream("POST", target.api_url, json=payload, headers=headers) as resp:
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


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """``Authorization: Bearer <api_key>``, else ``Bearer $OPENAI_API_KEY`` when set, as `vllm
    bench serve` sends it, so the same command works against a server started with --api-key
    (for /metrics too). ``api_key`` is for callers that hold several keys in one process (a
    workshop test playing four participants): an environment variable is one per process."""
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def fetch_model_id(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at ``/v1/models`` (vLLM's default when --model is unset)."""
    try:
        async with httpx.AsyncClient(timeout=30, headers=auth_headers(api_key)) as client:
            resp = await client.get(f"{base_url}/v1/models")
            resp.raise_for_status()
            models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"could not list models at {base_url}/v1/models ({type(e).__name__}: {e}); "
                         "is the server up? (or pass --model)") from e
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


async def warm_up(target: Target, req: SampleRequest, ignore_eos: bool, count: int = 1,
                  max_concurrency: int | None = None) -> list[RequestRecord]:
    """Send ``req`` ``count`` times (at most ``max_concurrency`` at once) and return the records,
    measured by nobody: the initial test run and ``--num-warmups`` of :mod:`minserve.bench.cli`."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(client):
        async with limit:
            return await send_request(client, target, req, ignore_eos)

    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=auth_headers(target.api_key)) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(count))))


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
    headers = auth_headers(target.api_key)
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
