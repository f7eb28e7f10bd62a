"""The routing policy: which route serves a request, and the record of why.

In order (docs/serving/routes.md):

1. ``x-minserve-route: NAME`` names a route explicitly. Allowed to admin API keys only, unless
   the routes file says ``"explicit_route": "anyone"``: otherwise any tenant could put itself on
   the canary (or keep off it) and bias the comparison. A name that is not a route's is a 404,
   a malformed or huge one a 400, a non-admin caller a 403 ``route_forbidden``. Refused names
   are never recorded nor used as metric labels (unbounded label values would bloat /metrics).
2. The canary, while running: an eligible request (its priority class in ``classes``, its
   tenant in ``tenants`` when listed) goes to the candidate with probability ``share``, drawn
   from a generator seeded by the policy's ``seed``: the same arrival order gives the same
   split, and no field the client sends moves its draw. If the candidate sheds it, it falls back
   to the default route (reason ``canary_overflow``): the canary may not cost a client a refusal.
3. Otherwise the default route (the baseline).
4. Downgrade: when the default route sheds a request because its deadline would be missed
   (admission reason ``deadline``), and the request's class lists cheaper routes in
   ``downgrade``, each is tried in turn (only those whose ``max_model_len`` holds the request);
   the first that predicts it in time serves it (reason ``downgrade_deadline``). Otherwise the
   default route's refusal is the answer, exactly as without routes.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from minserve.server.canary import Canary, RouteWindow
from minserve.server.decisions import DecisionLog, DecisionRecord, RoutingMetrics, outcome_of, precision_of
from minserve.server.protocol import ApiError
from minserve.server.routes import CanaryCriteria, RoutesConfig, check_route_name


@dataclass
class Route:
    name: str
    state: object                          # the app's ServerState for this route's engine
    window: RouteWindow
    served: int = 0                        # requests routed here since start
    describe: dict = field(default_factory=dict)


def describe_engine(engine) -> dict:
    c = engine.config
    return {"precision": precision_of(c), "quantization": c.quantization, "dtype": c.dtype,
            "kv_cache_dtype": c.kv_cache_dtype, "speculation": bool(c.speculative_config),
            "max_model_len": engine.max_model_len, "max_num_seqs": c.max_num_seqs,
            "scheduling_policy": c.scheduling_policy}


class Router:
    def __init__(self, config: RoutesConfig, states: dict, metrics: RoutingMetrics):
        window = config.canary.criteria.window if config.canary else CanaryCriteria().window
        self.config = config
        self.default = config.default
        self.routes = {n: Route(n, st, RouteWindow(window), describe=describe_engine(st.engine))
                       for n, st in states.items()}
        self.metrics = metrics
        self.canary = Canary(config.canary, metrics) if config.canary else None
        self.log = DecisionLog()
        self._rng = random.Random(config.canary.seed if config.canary else 0)
        self._lock = threading.Lock()

    def states(self) -> list:
        return [r.state for r in self.routes.values()]

    async def serve(self, request, body, kind: str):
        from minserve.server.routed_app import serve_routed  # the HTTP half lives there
        return await serve_routed(self, request, body, kind)

    # ---- choosing ------------------------------------------------------------------------

    def _explicit(self, asked: str, principal) -> str:
        try:
            check_route_name(asked, "header x-minserve-route")
        except ValueError as e:
            raise ApiError(400, str(e), "x-minserve-route", "invalid_route") from None
        if self.config.explicit_route == "admin" and not (principal is not None and principal.admin):
            raise ApiError(403, "header x-minserve-route needs an admin API key on this server",
                           "x-minserve-route", "route_forbidden")
        if asked not in self.routes:
            raise ApiError(404, f"route {asked!r} does not exist; routes: {sorted(self.routes)}",
                           "x-minserve-route", "route_not_found")
        return asked

    def _canary_draw(self, ticket) -> bool:
        c = self.canary
        if c is None or c.state != "running" or c.policy.route == self.default:
            return False
        p = c.policy
        if ticket.priority_class not in p.classes or (p.tenants is not None and ticket.tenant not in p.tenants):
            return False
        with self._lock:  # one draw per eligible request, in arrival order
            return self._rng.random() < c.share

    def candidates(self, asked: str | None, principal, ticket) -> list[tuple[str, str]]:
        """(route, reason) in the order they are tried (module docstring, 1-3)."""
        if asked is not None:
            return [(self._explicit(asked, principal), "explicit")]
        if self._canary_draw(ticket):
            return [(self.canary.policy.route, "canary_share"), (self.default, "canary_overflow")]
        return [(self.default, "default")]

    def _fits(self, name: str, tickets) -> bool:
        limit = self.routes[name].describe["max_model_len"]
        return all(t.prompt_tokens + t.max_tokens <= limit for t in tickets)

    def admit(self, cands: list[tuple[str, str]], tickets, admit_all, request_id: str = "") -> tuple[Route, str]:
        """Admit ``tickets`` on the first candidate that takes them, then a downgrade route
        (module docstring, 4). ``admit_all(state, tickets)`` raises ApiError on a refusal; the
        refusal that reaches the client carries the decision headers of the route that refused it,
        and the request is recorded (outcome ``overload``) like every other."""
        refusal = None
        for name, reason in cands:
            try:
                admit_all(self.routes[name].state, tickets)
                return self._chosen(name, reason)
            except ApiError as e:
                if refusal is None or name == self.default:
                    refusal, refused = e, (name, reason)  # the default route's answer is the one a client knows
        if refusal.code == "deadline":
            for name in self.config.downgrade.get(tickets[0].priority_class, ()):
                if name == self.default or not self._fits(name, tickets):
                    continue
                try:
                    admit_all(self.routes[name].state, tickets)
                    return self._chosen(name, "downgrade_deadline")
                except ApiError:
                    continue
        self._shed(request_id, refused, tickets[0], refusal)
        raise refusal

    def _shed(self, request_id: str, refused: tuple[str, str], ticket, refusal: ApiError) -> None:
        """A request refused at admission: its record (kept out of the route's window, so shedding
        on the baseline does not make a canary look better) and its headers on the refusal."""
        rec = self.record(request_id, self.routes[refused[0]], refused[1], ticket)
        rec.outcome, rec.status = outcome_of(refusal.status, refusal.code), refusal.status
        self.metrics.failures.labels(rec.route, rec.outcome).inc()
        refusal.headers = {**(refusal.headers or {}), **rec.headers()}

    def _chosen(self, name: str, reason: str) -> tuple[Route, str]:
        route = self.routes[name]
        with self._lock:
            route.served += 1
        self.metrics.decisions.labels(name, reason).inc()
        return route, reason

    def record(self, request_id: str, route: Route, reason: str, ticket) -> DecisionRecord:
        d = route.describe
        rec = DecisionRecord(request_id, route.name, reason, ticket.priority_class, ticket.tenant,
                             d["precision"], d["kv_cache_dtype"], d["speculation"])
        self.log.add(rec)
        return rec

    # ---- after the request -----------------------------------------------------------------

    def finish(self, rec: DecisionRecord) -> None:
        """The request ended: count its outcome, window it, and let the canary judge."""
        if rec.outcome != "ok":
            self.metrics.failures.labels(rec.route, rec.outcome).inc()
        self.routes[rec.route].window.add(rec)
        c = self.canary
        if c is not None and rec.route == c.policy.route and rec.route != self.default:
            c.check(self.routes[rec.route].window.summary(), self.routes[self.default].window.summary())

    # ---- admin -------------------------------------------------------------------------------

    def promote(self) -> dict:
        """The candidate becomes the default route; the old default stays, reachable explicitly."""
        if self.canary is None:
            raise ApiError(409, "no canary is configured on this server", code="no_canary")
        entry = self.canary.stop("promote")
        self.default = self.canary.policy.route
        return entry

    def view(self) -> dict:
        total = sum(r.served for r in self.routes.values()) or 1
        return {"default": self.default, "explicit_route": self.config.explicit_route,
                "downgrade": {c: list(v) for c, v in self.config.downgrade.items()},
                "canary": self.canary.view() if self.canary else None,
                "routes": {n: {**r.describe, "served": r.served, "traffic_share": r.served / total,
                               "recent": r.window.summary()} for n, r in self.routes.items()}}
