"""Issue 25: named routes behind one server, the routing policy, decision records, attacks.

Two tiny-llama engines (fp32 ``stable``, int4 ``int4``) behind one app with API keys: the
canary is configured with criteria that need more samples than these tests send, so it never
rolls back here (test_canary.py does that)."""

import random
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from live_server import live_server
from minserve.engine.llm_engine import LLMEngine
from minserve.server import Auth, Principal
from minserve.server.admission import Ticket
from minserve.server.decisions import RoutingMetrics, outcome_of
from minserve.server.routed_app import create_routed_app
from minserve.server.router import Router
from minserve.server.routes import parse_route_flag, routes_config

ADMIN, ACME = {"Authorization": "Bearer k-admin"}, {"Authorization": "Bearer k-acme"}
BATCH = {"x-priority-class": "batch"}
NEVER = {"min_samples": 1000, "window": 1000}  # no rollback within these tests
BODY = {"prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}


def config(**canary):
    return routes_config({"model": "tiny-llama", "default": "stable",
                          "routes": {"stable": {}, "int4": {"quantization": "int4"}},
                          "canary": {"route": "int4", "share": 0.5, "classes": ["batch"], "seed": 7,
                                     "criteria": NEVER, **canary}})


@pytest.fixture(scope="module")
def srv():
    cfg = config()
    engines = {n: LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=64, **a) for n, a in cfg.routes.items()}
    auth = Auth({"k-admin": Principal("ops", admin=True), "k-acme": Principal("acme")})
    app = create_routed_app(engines, cfg, auth=auth)
    with TestClient(app) as client:
        yield SimpleNamespace(client=client, engines=engines, router=app.state.minserve.router, app=app)


def post(srv, headers=None, **body):
    return srv.client.post("/v1/completions", json={**BODY, **body}, headers={**ACME, **(headers or {})})


def test_interactive_traffic_stays_on_the_baseline_with_its_decision_in_headers_and_records(srv):
    before = len(srv.router.log.recent())
    for _ in range(4):
        r = post(srv)
        assert r.status_code == 200, r.text
        assert r.headers["x-minserve-route"] == "stable"
        assert r.headers["x-minserve-decision"] == ("reason=default; precision=none/float32; kv=auto; "
                                                    "spec=off; cached_tokens=0")
    recs = srv.router.log.recent()[before:]
    assert [(x["route"], x["reason"], x["outcome"], x["status"], x["output_tokens"], x["tenant"])
            for x in recs] == [("stable", "default", "ok", 200, 4, "acme")] * 4
    assert all(x["e2e_s"] >= x["ttft_s"] > 0 for x in recs)


def test_the_canary_gets_the_seeded_share_of_eligible_batch_traffic(srv):
    draws = random.Random(7)
    routes = [post(srv, BATCH).headers["x-minserve-route"] for _ in range(12)]
    expected = ["int4" if draws.random() < 0.5 else "stable" for _ in range(12)]
    assert routes == expected  # interactive requests (the tests before) draw nothing
    assert 0 < routes.count("int4") < 12


def test_a_tenant_cannot_force_itself_onto_the_canary(srv):
    before = len(srv.router.log.recent())
    for name, status, code in (("int4", 403, "route_forbidden"), ("x" * 10_000, 400, "invalid_route"),
                               ("no-such", 403, "route_forbidden")):
        r = post(srv, {"x-minserve-route": name})
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
        assert len(r.text) < 1000  # a huge name is not echoed back
    assert len(srv.router.log.recent()) == before  # refused names are neither recorded nor labels
    r = srv.client.post("/v1/completions", json=BODY, headers={**ADMIN, "x-minserve-route": "no-such"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"
    r = srv.client.post("/v1/completions", json=BODY, headers={**ADMIN, "x-minserve-route": "int4"})
    assert r.status_code == 200 and r.headers["x-minserve-route"] == "int4"
    assert r.headers["x-minserve-decision"].startswith("reason=explicit; precision=int4/float32")
    assert 'route="no-such"' not in srv.client.get("/metrics", headers=ADMIN).text


def test_routes_view_and_controls_need_an_admin_key(srv):
    for path in ("/routes", "/routes/decisions"):
        assert srv.client.get(path, headers=ACME).status_code == 403
        assert srv.client.get(path).status_code == 401
    assert srv.client.post("/routes/canary/stop", headers=ACME).status_code == 403
    view = srv.client.get("/routes", headers=ADMIN).json()
    assert view["default"] == "stable" and set(view["routes"]) == {"stable", "int4"}
    assert view["routes"]["int4"]["precision"] == "int4/float32"
    assert view["canary"]["state"] == "running" and view["canary"]["share"] == 0.5
    shares = [r["traffic_share"] for r in view["routes"].values()]
    assert abs(sum(shares) - 1) < 1e-9
    assert view["routes"]["stable"]["recent"]["samples"] >= 4


def test_metrics_carry_a_route_label_and_the_failure_split(srv):
    text = srv.client.get("/metrics", headers=ADMIN).text
    served = {n: r.served for n, r in srv.router.routes.items()}
    for name, n in served.items():
        line = f'vllm:e2e_request_latency_seconds_count{{model_name="tiny-llama",route="{name}"}} {float(n)}'
        assert line in text
    assert 'minserve:request_failures_total{reason="client_cancelled",route="int4"}' in text
    assert 'minserve:admission_admitted_total{priority_class="batch",route="int4"}' in text
    assert text.count("# TYPE process_cpu_seconds_total counter") == 1


def test_an_abort_mid_stream_is_recorded_as_a_client_cancellation():
    cfg = routes_config({"model": "tiny-llama", "routes": {"stable": {}}, "explicit_route": "anyone"})
    engine = LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=64)
    app = create_routed_app({"stable": engine}, cfg)
    router = app.state.minserve.router
    with live_server(app) as base:
        body = {**BODY, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            assert r.headers["x-minserve-route"] == "stable"
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 10
        while router.log.recent()[-1]["outcome"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rec = router.log.recent()[-1]
        assert (rec["outcome"], rec["status"]) == ("client_cancelled", 499)
        assert 0 < rec["output_tokens"] < 400
        text = httpx.get(base + "/metrics").text
        assert 'minserve:request_failures_total{reason="client_cancelled",route="stable"} 1.0' in text
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.has_unfinished_requests()


@pytest.mark.parametrize("doc, message", [
    ({"routes": {}}, "routes: must be a non-empty object"),
    ({"routes": {"a": {"quantizaton": "int4"}}}, "routes.a.quantizaton: unknown engine argument; allowed:"),
    ({"routes": {"a" * 100: {}}}, "route name 'aaaa"),
    ({"routes": {"a": {}}, "default": "b"}, "default: 'b' is not a route; allowed: ['a']"),
    ({"routes": {"a": {}}, "canary": {"route": "a"}}, "canary.route: 'a' must be a route other than"),
    ({"routes": {"a": {}, "b": {}}, "canary": {"route": "b", "share": 2}}, "canary.share: must be a number in [0, 1]"),
    ({"routes": {"a": {}, "b": {}}, "canary": {"route": "b", "criteria": {"min_samples": 0}}},
     "canary.criteria.min_samples: must be an int >= 1"),
    ({"routes": {"a": {}, "b": {}}, "canary": {"route": "b", "criteria": {"p99": 1}}},
     "canary.criteria.p99: unknown field; allowed:"),
    ({"routes": {"a": {}, "b": {}}, "downgrade": {"urgent": ["b"]}}, "downgrade.urgent: unknown field"),
    ({"routes": {"a": {}, "b": {}}, "downgrade": {"batch": ["a"]}}, "downgrade.batch: 'a' must be a route other"),
    ({"routes": {"a": {}}, "explicit_route": "everyone"}, "explicit_route: must be one of ['admin', 'anyone']"),
    ({"routes": {"a": {}}, "canaries": {}}, "routes file.canaries: unknown field"),
])
def test_a_routes_file_with_errors_names_the_field_and_the_allowed_values(doc, message):
    with pytest.raises(ValueError) as e:
        routes_config(doc)
    assert message in str(e.value) and len(str(e.value)) < 1000


def test_route_flags_parse_engine_arguments():
    assert parse_route_flag("int4:quantization=int4,max-num-seqs=4") == (
        "int4", {"quantization": "int4", "max_num_seqs": 4})
    with pytest.raises(ValueError, match="must be KEY=VALUE"):
        parse_route_flag("a:quantization")


def fake_router(**canary) -> Router:
    states = {n: SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(
        quantization=None, dtype="float32", kv_cache_dtype="auto", speculative_config=None,
        max_num_seqs=1, scheduling_policy="fcfs"), max_model_len=64)) for n in ("stable", "int4")}
    from prometheus_client import CollectorRegistry
    return Router(config(**canary), states, RoutingMetrics(CollectorRegistry(), list(states)))


def test_the_split_is_reproducible_bounded_and_limited_to_eligible_tickets():
    def ticket(cls="batch", tenant="t"):
        return Ticket(tenant, cls, 4, 4)

    def split(router, n=2000, **kw):
        return [router.candidates(None, None, ticket(**kw))[0][0] for _ in range(n)]

    a, b = split(fake_router(share=0.1)), split(fake_router(share=0.1))
    assert a == b  # same seed, same order: the same split
    assert 150 <= a.count("int4") <= 250  # 10 % of 2000, well within binomial noise (sd ~13)
    assert set(split(fake_router(share=1.0), cls="interactive")) == {"stable"}
    only = fake_router(share=1.0, tenants=["beta"])
    assert set(split(only, 50, tenant="acme")) == {"stable"} and set(split(only, 50, tenant="beta")) == {"int4"}
    assert fake_router(share=1.0).candidates(None, None, ticket())[1] == ("stable", "canary_overflow")


@pytest.mark.parametrize("status, code, outcome", [
    (500, None, "model_error"), (429, "deadline", "overload"), (503, "draining", "overload"),
    (503, None, "dependency_failure"), (499, "aborted", "client_cancelled"),
    (504, "deadline_exceeded", "deadline_exceeded"), (400, "unsatisfiable_constraints", "invalid_request")])
def test_outcomes_keep_model_errors_overload_dependencies_and_cancellations_apart(status, code, outcome):
    assert outcome_of(status, code) == outcome


def test_a_notebook_serves_routes_on_a_local_port_and_again_after_a_stop(srv):
    from minserve.lab.local_server import LocalServer
    cfg = routes_config({"model": "tiny-llama", "routes": {"stable": {}, "int4": {}}, "explicit_route": "anyone"})
    engines = {n: LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=32) for n in cfg.routes}
    for _ in range(2):  # a second server on the same engines registers its series again
        with LocalServer(engines, routes=cfg) as local:
            r = httpx.post(local.base_url + "/v1/completions", json=BODY, headers={"x-minserve-route": "int4"})
            assert r.status_code == 200 and r.headers["x-minserve-route"] == "int4"
            assert local.router.routes["int4"].served == 1


def test_cli_route_flags_and_a_routes_file(tmp_path):
    from minserve.server.cli import parse_args, routes_config_of
    a = parse_args(["tiny-llama", "--route", "stable", "--route", "int4:quantization=int4"])
    cfg = routes_config_of(a)
    assert (cfg.model, cfg.default, cfg.routes) == ("tiny-llama", "stable", {"stable": {}, "int4": {"quantization": "int4"}})
    assert routes_config_of(parse_args(["tiny-llama"])) is None
    path = tmp_path / "routes.json"
    path.write_text('{"model": "tiny-llama", "routes": {"a": {}}}')
    assert routes_config_of(parse_args(["--routes", str(path)])).model == "tiny-llama"
    assert routes_config_of(parse_args(["smollm2-135m", "--routes", str(path)])).model == "smollm2-135m"
    with pytest.raises(ValueError, match="--route: each name once"):
        routes_config_of(parse_args(["--route", "a", "--route", "a"]))
    path.write_text("{oops")
    with pytest.raises(ValueError, match="is not JSON"):
        routes_config_of(parse_args(["--routes", str(path)]))
