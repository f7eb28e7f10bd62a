"""The OpenAI-compatible HTTP app: routes, error mapping, and the life of one request.

One request, end to end: the body's size is bounded (limits.py), it is validated (protocol.py)
and turned into token ids and SamplingParams (serving.py, off the event loop: tokenizing a long
prompt takes long enough to stall every other connection); admission classifies it and admits
or sheds it (admission.py); the engine thread runs it (async_engine.py) and its outputs come back
on an asyncio queue; the reply (responses.py) is one JSON body or a stream of SSE chunks ending
with ``data: [DONE]``. A completions request with a list of prompts is one engine request per
prompt, each with its own admission ticket (admitted all together or not at all), answered as one
response. Whatever way the request ends (finished, failed, deadline passed, client gone, server
stopping), ``_Flight.close`` aborts what is still in the engine and gives the admission slots
back, exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minserve.sampling_params import RequestOutputKind
from minserve.server.admission import (PRIORITY_CLASSES, AdmissionConfig, AdmissionController, Ticket,
                                       classify)
from minserve.server.async_engine import AsyncEngine, RequestFailed
from minserve.server.auth import PRINCIPAL_SCOPE_KEY, Auth, AuthMiddleware, effective_salt
from minserve.server.limits import BodyLimitMiddleware, RequestLimits
from minserve.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                      error_body, error_response, validation_error_to_api, value_error)
from minserve.server import openapi
from minserve.server.endpoints import add_routes, get_and_head, model_card
from minserve.server.responses import StreamFormatter, full_response, sse
from minserve.server.serving import Prepared, prepare
from minserve.server.tool_parsers.plan import ToolConfig

log = logging.getLogger("minserve.server")
POLL_S = 0.5  # how often a waiting handler checks for a vanished client or a dead engine
PREPARE_THREADS = 2  # tokenizer threads: enough to overlap requests, few enough to spare the engine


@dataclass
class ServerState:
    engine: object
    async_engine: AsyncEngine
    admission: AdmissionController
    model_name: str
    created: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    prepare_pool: ThreadPoolExecutor | None = None  # lives with the app's lifespan
    tools: ToolConfig | None = None                 # --enable-auto-tool-choice, --tool-call-parser
    open_flights: int = 0                           # admitted requests not yet closed (drain waits)
    router: object | None = None                    # named routes (routed_app.py); None: one engine
    metrics_registry: object | None = None          # /metrics; None: the engine's own registry

    def begin_drain(self) -> None:
        for st in self.router.states() if self.router else (self,):
            st.admission.begin_drain()

    def fail_all(self, failure: RequestFailed) -> None:
        for st in self.router.states() if self.router else (self,):
            st.async_engine.fail_all(failure)


class ClientGone(Exception):
    pass


class _Flight:
    """Cleanup for one admitted HTTP request: its engine requests (one per prompt) and their
    admission tickets; ``close`` is idempotent."""

    def __init__(self, st: ServerState, request_ids: list[str], tickets: list[Ticket]):
        self.st, self.request_ids, self.tickets = st, request_ids, tickets
        self.finished = [False] * len(request_ids)  # per engine request: the engine let go of it
        self.outputs: _Outputs | None = None        # its forwarding tasks end with the flight
        self.closed = False
        st.open_flights += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.st.open_flights -= 1
        if self.outputs is not None:  # also when a stream never started: no task left waiting
            self.outputs.close()
        for rid, done in zip(self.request_ids, self.finished):
            if not done:
                self.st.async_engine.abort(rid)
        for ticket in self.tickets:
            self.st.admission.release(ticket)


class _Outputs:
    """The outputs of one HTTP request's engine requests as ``(prompt index, item)``, in the
    order they arrive. One prompt reads its queue directly; a batch forwards every queue into
    one (a task per prompt), so a stream interleaves its prompts as the engine produces them."""

    def __init__(self, queues: list[asyncio.Queue]):
        self.queues = queues
        self.merged: asyncio.Queue | None = None
        self.tasks: list[asyncio.Task] = []
        if len(queues) > 1:
            self.merged = asyncio.Queue()
            self.tasks = [asyncio.create_task(self._forward(i, q)) for i, q in enumerate(queues)]

    async def _forward(self, i: int, q: asyncio.Queue) -> None:
        while True:
            item = await q.get()
            self.merged.put_nowait((i, item))
            if isinstance(item, RequestFailed) or item.finished:
                return

    async def next(self, st: ServerState, request: Request | None = None) -> tuple[int, object]:
        if self.merged is None:
            return 0, await next_item(self.queues[0], st, request)
        item = await next_item(self.merged, st, request)
        return (0, item) if isinstance(item, RequestFailed) else item  # the engine thread died

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


class _SSEResponse(StreamingResponse):
    """A stream that always cleans up. Starlette cancels the body iterator when the client
    disconnects, but an iterator that never started, or a send that failed, would leave it
    suspended forever; this ``finally`` runs in every case."""

    def __init__(self, content, flight: _Flight):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.flight = flight

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the client went away while we wrote to it
        finally:
            self.flight.close()


async def next_item(q: asyncio.Queue, st: ServerState, request: Request | None = None):
    """The next output of a request; fails instead of hanging if the engine thread is gone, and
    raises ClientGone when ``request``'s client disconnected."""
    while True:
        if not q.empty():
            return q.get_nowait()  # the common case while streaming: no timer task needed
        try:
            return await asyncio.wait_for(q.get(), POLL_S)
        except asyncio.TimeoutError:
            if not st.async_engine.alive and q.empty():
                return RequestFailed(f"the engine is not running ({st.async_engine.error or 'stopped'})", 503)
            if request is not None and await request.is_disconnected():
                raise ClientGone() from None


async def _stream(outputs: _Outputs, p: Prepared, st: ServerState, flight: _Flight):
    """The events of one stream. The flight is closed (its admission seats released, what is left
    of it aborted) before the last event is written: a client that reads ``[DONE]`` and sends its
    next request at once finds its tenant's seat free. _SSEResponse closes it again (a no-op) or,
    when the client left first, for the first time."""
    fmt = StreamFormatter(p, st.engine.tokenizer)
    try:
        while not all(flight.finished):
            i, item = await outputs.next(st)
            if isinstance(item, RequestFailed):
                flight.finished[i] = True  # the engine already let go of it
                # vLLM's convention: an error event, then the end marker so clients stop reading.
                # One failed prompt of a batch ends the stream; close() aborts the others.
                yield fmt.error(item.status, item.message, item.code)
                flight.close()
                yield sse("[DONE]")
                return
            for chunk in fmt.delta(item, i):
                yield chunk
            if item.finished:
                flight.finished[i] = True
        tail = fmt.end()
        flight.close()
        for chunk in tail:
            yield chunk
    except Exception as e:  # a bug formatting this one stream: tell its client, spare the rest
        log.exception("stream %s failed", p.request_id)
        yield fmt.error(500, f"internal error while streaming: {type(e).__name__}: {e}")
        flight.close()
        yield sse("[DONE]")


async def _prepare(st: ServerState, body, kind: str) -> Prepared:
    # Tokenizing runs at ~1.3 s per MB and chat templates are Python: on the event loop they would
    # freeze /health and every stream for that long. The tokenizer releases the GIL while it works.
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(st.prepare_pool, prepare, body, kind, st.engine,
                                      st.model_name, st.limits, st.tools)


# Under scheduling_policy="priority" the class decides first, the body's ``priority`` second:
# engine priority = class rank x CLASS_STRIDE + body priority clamped to +-(CLASS_STRIDE / 2 - 1),
# so every interactive request (rank 0) is served before every batch one (rank 1), whatever
# ``priority`` a client sends, and within a class a lower ``priority`` goes first.
CLASS_STRIDE = 1 << 32


def engine_priority(engine, priority_class: str, priority: int) -> int:
    """The ``priority`` the engine schedules by (see CLASS_STRIDE). Under "fcfs" the body's value
    is passed on unchanged (the engine ignores it)."""
    if engine.config.scheduling_policy != "priority":
        return priority
    half = CLASS_STRIDE // 2 - 1
    return PRIORITY_CLASSES.index(priority_class) * CLASS_STRIDE + max(-half, min(half, priority))


def _tickets(request: Request, body, p: Prepared) -> list[Ticket]:
    """One admission ticket per engine request: a batch of prompts is counted prompt by prompt,
    and ``n`` samples by their outputs (they share the prompt's KV blocks, not their own)."""
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)  # set by AuthMiddleware when keys are configured
    try:
        return [classify(request.headers, user=body.user, priority=body.priority,
                         deadline_ms=body.deadline_ms, prompt_tokens=len(ids),
                         max_tokens=params.max_tokens * params.n,
                         tenant=principal.tenant if principal else None,
                         max_class=principal.max_class if principal else None)
                for ids, params in zip(p.prompts, p.batch_params)]
    except ValueError as e:  # "header x-deadline-ms must ..." or "deadline_ms must ..."
        words = str(e).split()
        raise ApiError(400, str(e), words[1] if words[0] == "header" else words[0]) from None


def _admit(st: ServerState, tickets: list[Ticket]) -> None:
    """Admit every ticket or none: a batch either fits the waiting room whole or is shed whole
    (the tickets admitted before the refusal are given back)."""
    admitted = []
    for ticket in tickets:
        decision = st.admission.try_admit(ticket)
        if not decision.admitted:
            for t in admitted:
                st.admission.release(t)
            headers = None if decision.retry_after_s is None else {"Retry-After": str(decision.retry_after_s)}
            raise ApiError(decision.status, decision.message, None, decision.reason, headers)
        admitted.append(ticket)


def _submit(st: ServerState, body, p: Prepared, flight: _Flight, deadline_at: float | None) -> _Outputs:
    # The tenant is always part of the cache key: no cross-tenant prefix hits, salt or not.
    salt = effective_salt(flight.tickets[0].tenant, body.cache_salt)
    queues = []
    for rid, ids, params, ticket in zip(flight.request_ids, p.prompts, p.batch_params, flight.tickets):
        queues.append(st.async_engine.submit(
            rid, ids, params, cache_salt=salt,
            priority=engine_priority(st.engine, ticket.priority_class, body.priority),
            on_started=lambda t=ticket: st.admission.mark_started(t), deadline_at=deadline_at,
            on_expired=lambda t=ticket: st.admission.record_expired(t)))
    return _Outputs(queues)


async def _final_outputs(outputs: _Outputs, flight: _Flight, st: ServerState, request: Request) -> list:
    """The final output of every prompt, in prompt order; the first failure is the answer."""
    finals: list = [None] * len(flight.request_ids)
    while not all(flight.finished):
        i, item = await outputs.next(st, request)
        flight.finished[i] = isinstance(item, RequestFailed) or item.finished
        if isinstance(item, RequestFailed):
            raise ApiError(item.status, item.message, code=item.code)
        if item.finished:
            finals[i] = item
    return finals


async def _serve(request: Request, body, kind: str):
    st: ServerState = request.app.state.minserve
    if st.router is not None:
        return await st.router.serve(request, body, kind)
    arrived = time.monotonic()  # deadlines count from here
    p = await _prepare(st, body, kind)
    tickets = _tickets(request, body, p)
    for ticket in tickets:
        ticket.waited_s = time.monotonic() - arrived
    _admit(st, tickets)
    flight = _Flight(st, p.engine_request_ids(), tickets)
    deadline_at = None if tickets[0].deadline_s is None else arrived + tickets[0].deadline_s
    try:
        outputs = flight.outputs = _submit(st, body, p, flight, deadline_at)
    except BaseException:
        flight.close()
        raise
    if p.params.output_kind is RequestOutputKind.DELTA:
        return _SSEResponse(_stream(outputs, p, st, flight), flight)  # it closes the flight itself
    try:
        return JSONResponse(full_response(p, await _final_outputs(outputs, flight, st, request),
                                          st.engine.tokenizer))
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    finally:
        flight.close()


def _routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, body, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(request, body, "chat")

    @get_and_head(app, "/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [model_card(request.app.state.minserve)]}

    @get_and_head(app, "/health")
    async def health(request: Request):
        st: ServerState = request.app.state.minserve
        if st.admission.draining:
            return JSONResponse(error_body(503, "draining: the server is shutting down", code="draining"),
                                status_code=503)
        if not st.async_engine.alive:
            return JSONResponse(error_body(503, f"the engine loop is not running "
                                           f"({st.async_engine.error or 'stopped'})"), status_code=503)
        return Response(status_code=200)

    @get_and_head(app, "/metrics")
    async def metrics(request: Request):
        st: ServerState = request.app.state.minserve
        registry = st.metrics_registry or st.engine.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response(validation_error_to_api(exc))

    @app.exception_handler(ValueError)
    async def value_error_handler(_: Request, exc: ValueError):
        return error_response(value_error(exc))  # the message's leading field is the param

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        # FastAPI's answer to a body json.loads could not take (e.g. nested too deep) names nothing.
        param = "body" if exc.status_code == 400 and "parsing the body" in str(exc.detail) else None
        return error_response(ApiError(exc.status_code, str(exc.detail), param, headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        log.exception("request failed", exc_info=exc)
        return error_response(ApiError(500, f"internal error while serving this request: "
                                       f"{type(exc).__name__}: {exc}"))


def server_state(engine, served_model_name: str | None = None,
                 admission: AdmissionConfig | AdmissionController | None = None,
                 limits: RequestLimits | None = None, tools: ToolConfig | None = None) -> ServerState:
    """The pieces serving one engine: its engine thread and its admission (create_app's)."""
    if not isinstance(admission, AdmissionController):
        # The budgets and the deadline model need the engine's shape, which only it knows.
        cfg = dataclasses.replace(admission or AdmissionConfig(),
                                  parallel_slots=engine.config.max_num_seqs,
                                  kv_bytes_per_token=engine.kv_spec.bytes_per_token)
        admission = AdmissionController(cfg, engine.metrics.registry)
    # A step's decode rows include verified proposals (speculative decoding): admission counts
    # the tokens a step produced, not its rows.
    on_step = (lambda s: admission.observe_step(s.step_time_s, s.num_prefill_tokens, s.num_decode_tokens,
                                                s.num_spec_tokens, s.num_accepted_spec_tokens))
    return ServerState(engine, AsyncEngine(engine, on_step, on_running=admission.observe_running),
                       admission, served_model_name or engine.config.model, int(time.time()),
                       limits or RequestLimits(), tools=tools)


def create_app(engine, *, served_model_name: str | None = None,
               admission: AdmissionConfig | AdmissionController | None = None,
               auth: Auth | None = None, limits: RequestLimits | None = None,
               tools: ToolConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an LLMEngine). The engine thread starts and stops with
    the app's lifespan; ``app.state.minserve`` holds the pieces (tests and the CLI use it).
    One app per engine: the admission counters are registered in the engine's registry.
    ``auth``: API keys, their tenants and the /metrics policy (auth.py); None serves without keys.
    ``limits``: body size, prompt characters and stop strings (limits.py; None: the defaults).
    ``tools``: the tool-call flags (tool_parsers/plan.py; None: "auto" tool choice is refused)."""
    st = server_state(engine, served_model_name, admission, limits, tools)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        st.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="minserve-prepare")
        st.async_engine.start()
        try:
            yield
        finally:
            st.admission.begin_drain()  # this engine's: a routed app drains the others (routed_app.py)
            # The join blocks; keep it off the event loop.
            await asyncio.to_thread(st.async_engine.stop)
            st.prepare_pool.shutdown(wait=False)

    app = FastAPI(title="minserve", lifespan=lifespan)
    app.state.minserve = st
    _routes(app)
    add_routes(app)  # /tokenize, /detokenize, /tokenizer_info, /version, /v1/models/{id}
    _error_handlers(app)
    openapi.install(app)  # its 400s where FastAPI would document 422s
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=st.limits.max_body_bytes)
    if auth is not None:  # added last, so it runs first: no body is read for a refused key
        app.add_middleware(AuthMiddleware, auth=auth)
    return app
