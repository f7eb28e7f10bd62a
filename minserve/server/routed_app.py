"""A server with named routes: one engine (its own engine thread and admission) per route, the
router between them (router.py), the canary (canary.py), decision records (decisions.py).

:func:`create_routed_app` builds the same app as :func:`~minserve.server.app.create_app` on the
default route's engine (its tokenizer prepares every request: every route serves the same model)
and adds, for the others, their engine threads to the app's lifespan. A request's life is app.py's
with two additions: the router picks the route whose admission takes it, and a
:class:`_RoutedFlight` records how it ended when it closes, exactly once, whatever the path
(answer, failure, deadline, client gone, drain).

HTTP (with API keys configured, every ``/routes`` path needs an admin key, auth.py):

- ``GET /routes``: each route's configuration, share of traffic, recent TTFT/TPOT/E2E quantiles,
  failures and bad-answer rate, and the canary's state, criteria and decisions with evidence;
- ``GET /routes/decisions?limit=N``: the latest decision records;
- ``POST /routes/canary/start`` ``{"share": 0.2, "criteria": {...}}``, ``POST /routes/canary/stop``,
  ``POST /routes/canary/promote``.

``/metrics`` merges every route's registry, each sample with a ``route`` label next to vLLM's
``model_name``, plus the ``minserve:`` routing series.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from minserve.metrics.prometheus import PROCESS_COLLECTORS
from minserve.sampling_params import RequestOutputKind
from minserve.server import app as base
from minserve.server.async_engine import RequestFailed
from minserve.server.auth import PRINCIPAL_SCOPE_KEY
from minserve.server.decisions import ROUTE_HEADER, outcome_of
from minserve.server.protocol import ApiError
from minserve.server.responses import full_response
from minserve.server.router import Router
from minserve.server.routes import RoutesConfig, canary_criteria
from minserve.server.decisions import RoutingMetrics

PROCESS_PREFIXES = ("process_", "python_")  # every engine registry has them; exported once


class RouteLabelledCollector:
    """Every route registry's families merged, each sample labelled with its route."""

    def __init__(self, registries: dict):
        self.registries = registries

    def collect(self):
        merged: dict[str, Metric] = {}
        for route, reg in self.registries.items():
            for fam in reg.collect():
                if fam.name.startswith(PROCESS_PREFIXES):
                    continue
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                out.samples += [s._replace(labels={**s.labels, "route": route}) for s in fam.samples]
        return list(merged.values())


class _Recording:
    """app.py's outputs, noting each prompt's latest output and the first failure."""

    def __init__(self, inner, flight):
        self.inner, self.flight = inner, flight

    async def next(self, st, request=None):
        i, item = await self.inner.next(st, request)
        if isinstance(item, RequestFailed):
            self.flight.failure = self.flight.failure or item
        else:
            self.flight.last[i] = item
        return i, item

    def close(self) -> None:
        self.inner.close()


class _RoutedFlight(base._Flight):
    def __init__(self, route_st, request_ids, tickets, home, rec, router):
        super().__init__(route_st, request_ids, tickets)
        self.home, self.rec, self.router = home, rec, router
        self.failure: RequestFailed | None = None
        self.last: list = [None] * len(request_ids)
        if home is not route_st:
            home.open_flights += 1  # the drain (cli.py) waits on the home state's count

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self.home is not self.st:
            self.home.open_flights -= 1
        rec = self.rec
        if self.failure is not None:
            rec.outcome, rec.status = outcome_of(self.failure.status, self.failure.code), self.failure.status
        elif all(self.finished):
            rec.outcome, rec.status = "ok", 200
        else:  # closed before the answer was complete: its client left
            rec.outcome, rec.status = "client_cancelled", 499
        outs = [o for o in self.last if o is not None]
        rec.finish_reasons = [c.finish_reason for o in outs for c in o.outputs if c.finish_reason]
        # A stream's last output holds only its last tokens; the metrics count them all.
        rec.output_tokens = sum(o.metrics.num_generation_tokens if o.metrics else
                                sum(len(c.token_ids) for c in o.outputs) for o in outs)
        if outs and outs[0].metrics is not None:
            m = outs[0].metrics
            rec.ttft_s, rec.tpot_s, rec.e2e_s = m.ttft_s, m.tpot_s, m.e2e_s
        if outs:
            rec.cached_tokens = sum(o.num_cached_tokens for o in outs)
        self.router.finish(rec)


async def serve_routed(router: Router, request: Request, body, kind: str):
    """app._serve, with the route chosen at admission and the request's record kept."""
    home = request.app.state.minserve
    arrived = base.time.monotonic()
    p = await base._prepare(home, body, kind)
    tickets = base._tickets(request, body, p)
    for ticket in tickets:
        ticket.waited_s = base.time.monotonic() - arrived
    cands = router.candidates(request.headers.get(ROUTE_HEADER), request.scope.get(PRINCIPAL_SCOPE_KEY),
                              tickets[0])
    route, reason = router.admit(cands, tickets, base._admit, p.request_id)
    rec = router.record(p.request_id, route, reason, tickets[0])
    st = route.state
    flight = _RoutedFlight(st, p.engine_request_ids(), tickets, home, rec, router)
    deadline_at = None if tickets[0].deadline_s is None else arrived + tickets[0].deadline_s
    try:
        outputs = flight.outputs = _Recording(base._submit(st, body, p, flight, deadline_at), flight)
    except BaseException:
        flight.close()
        raise
    if p.params.output_kind is RequestOutputKind.DELTA:
        response = base._SSEResponse(base._stream(outputs, p, st, flight), flight)
        response.headers.update(rec.headers())
        return response
    try:
        finals = await base._final_outputs(outputs, flight, st, request)
        rec.cached_tokens = sum(o.num_cached_tokens for o in finals)
        return JSONResponse(full_response(p, finals, st.engine.tokenizer), headers=rec.headers())
    except base.ClientGone:
        return Response(status_code=499)
    except ApiError as e:
        e.headers = {**(e.headers or {}), **rec.headers()}  # a failure says where it failed too
        raise
    finally:
        flight.close()


def _admin_routes(app, router: Router) -> None:
    @app.get("/routes")
    async def routes_view():
        return router.view()

    @app.get("/routes/decisions")
    async def decisions(limit: int = 100):
        return {"data": router.log.recent(max(0, min(limit, 10_000)))}

    @app.post("/routes/canary/{action}")
    async def canary_action(action: str, request: Request):
        if router.canary is None:
            raise ApiError(409, "no canary is configured on this server (routes file: canary)", code="no_canary")
        if action == "start":
            body = await request.json() if await request.body() else {}
            if not isinstance(body, dict):
                raise ApiError(400, "body must be a JSON object: {\"share\": ..., \"criteria\": {...}}", "body")
            share = body.get("share")
            if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                      or not 0 <= share <= 1):
                raise ApiError(400, f"share must be a number in [0, 1], got {share!r}"[:200], "share")
            crit = body.get("criteria")  # a ValueError naming the field is a 400 (app.py)
            criteria = None if crit is None else canary_criteria(crit)
            return router.canary.start(share, criteria)
        if action == "stop":
            return router.canary.stop()
        if action == "promote":
            return router.promote()
        raise ApiError(404, "canary actions: start, stop, promote", "action", "not_found")


def create_routed_app(engines: dict, config: RoutesConfig, *, admission=None, **app_kwargs):
    """The app serving ``engines`` (route name -> LLMEngine, one per route of ``config``); the
    other keyword arguments are create_app's (``admission`` an AdmissionConfig, applied to each
    route with that route's engine shape)."""
    missing = sorted(set(config.routes) ^ set(engines))
    if missing:
        raise ValueError(f"engines: one per route of the config; mismatched: {missing}")
    home_engine = engines[config.default]
    app = base.create_app(home_engine, admission=admission, **app_kwargs)
    home = app.state.minserve
    states = {n: home if e is home_engine else
              base.server_state(e, home.model_name, admission, home.limits, home.tools)
              for n, e in engines.items()}
    registry = CollectorRegistry()
    registry.register(RouteLabelledCollector({n: e.metrics.registry for n, e in engines.items()}))
    for collector in PROCESS_COLLECTORS:
        registry.register(collector)
    home.router = Router(config, states, RoutingMetrics(registry, list(engines)))
    home.metrics_registry = registry
    _admin_routes(app, home.router)
    _with_other_engines(app, [st for st in states.values() if st is not home])
    return app


def _with_other_engines(app, others: list) -> None:
    """The home engine starts and stops in create_app's lifespan; the others around it."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        for st in others:
            st.async_engine.start()
        try:
            async with inner(a):  # prompts are prepared on the home state's pool, for every route
                yield
        finally:
            for st in others:
                st.admission.begin_drain()
                await base.asyncio.to_thread(st.async_engine.stop)

    app.router.lifespan_context = lifespan


def build_route_engines(config: RoutesConfig) -> dict:
    """One LLMEngine per route, from its engine arguments (the CLI's path)."""
    from minserve.engine.llm_engine import LLMEngine
    return {name: LLMEngine.from_engine_args(config.model, **args) for name, args in config.routes.items()}
