"""Issue 25: a canary rolls back on its own when it breaks the criteria declared before it started.

Two tiny-llama engines per test: ``stable`` and a ``canary`` with a planted fault (every step
raises, or every step is 40 ms slower). The criteria are the only ones the test needs, so what
triggers the rollback is the plant, not this machine's noise."""

import time

import pytest
from fastapi.testclient import TestClient

from minserve.engine.llm_engine import LLMEngine
from minserve.server.canary import breaches, quantile
from minserve.server.routed_app import create_routed_app
from minserve.server.routes import CanaryCriteria, routes_config

BODY = {"prompt": "The quick brown fox", "max_tokens": 6, "ignore_eos": True}
OFF = {"max_ttft_p90_ratio": None, "max_tpot_p50_ratio": None, "max_e2e_p90_ratio": None,
       "max_failure_rate": None, "max_bad_answer_increase": None}


def canary_server(plant, share: float, **criteria):
    cfg = routes_config({"model": "tiny-llama", "routes": {"stable": {}, "canary": {}},
                         "canary": {"route": "canary", "share": share, "seed": 3,
                                    "criteria": {**OFF, **criteria}}})
    engines = {n: LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=64) for n in cfg.routes}
    real = engines["canary"].runner.execute
    engines["canary"].runner.execute = lambda *a, **kw: plant(real, *a, **kw)
    app = create_routed_app(engines, cfg)
    return app, engines


def failing(real, *a, **kw):
    raise RuntimeError("planted fault")


def slow(real, *a, **kw):
    time.sleep(0.04)
    return real(*a, **kw)


def metric(client, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start}")


def send_until_rolled_back(client, limit: int):
    statuses = []
    for _ in range(limit):
        r = client.post("/v1/completions", json=BODY)
        statuses.append((r.status_code, r.headers.get("x-minserve-route")))
        if client.get("/routes").json()["canary"]["state"] == "rolled_back":
            break
    return statuses


def test_a_canary_that_fails_every_request_rolls_back_after_min_samples():
    app, engines = canary_server(failing, share=1.0, min_samples=5, max_failure_rate=0.2)
    with TestClient(app) as client:
        statuses = send_until_rolled_back(client, 20)
        assert statuses == [(500, "canary")] * 5  # each failure answered, the fifth triggers it
        after = [client.post("/v1/completions", json=BODY) for _ in range(3)]
        assert [(r.status_code, r.headers["x-minserve-route"]) for r in after] == [(200, "stable")] * 3
        canary = client.get("/routes").json()["canary"]
        assert canary["share"] == 0.0
        (decision,) = canary["decisions"]
        assert (decision["decision"], decision["criterion"]) == ("rollback", "failure_rate")
        ev = decision["evidence"]
        assert ev["candidate"]["samples"] == 5 and ev["candidate"]["failure_rate"] == 1.0
        assert ev["breaches"][0] == {"criterion": "failure_rate", "observed": 1.0, "limit": 0.2}
        assert ev["criteria"]["min_samples"] == 5
        assert metric(client, 'minserve:canary_decisions_total{criterion="failure_rate",decision="rollback",'
                              'route="canary"}') == 1
        assert metric(client, 'minserve:request_failures_total{reason="model_error",route="canary"}') == 5
        assert metric(client, 'minserve:canary_share{route="canary"}') == 0
        records = client.get("/routes/decisions").json()["data"]
        assert [(x["route"], x["outcome"]) for x in records] == ([("canary", "model_error")] * 5
                                                                + [("stable", "ok")] * 3)
    for e in engines.values():
        assert e.kv.pool.num_free == e.kv.pool.num_blocks and not e.has_unfinished_requests()


def test_a_canary_with_a_planted_slowdown_breaks_its_latency_ratio_and_rolls_back():
    app, _ = canary_server(slow, share=0.5, min_samples=6, max_e2e_p90_ratio=2.0)
    with TestClient(app) as client:
        statuses = send_until_rolled_back(client, 60)
        assert all(s == 200 for s, _ in statuses)
        view = client.get("/routes").json()
        (decision,) = view["canary"]["decisions"]
        assert decision["criterion"] == "e2e_p90_ratio" and decision["evidence"]["breaches"][0]["observed"] > 2.0
        ev = decision["evidence"]
        assert ev["candidate"]["samples"] >= 6 and ev["baseline"]["samples"] >= 6
        assert view["routes"]["canary"]["recent"]["e2e_p50_s"] > view["routes"]["stable"]["recent"]["e2e_p50_s"]
        # Rolled back: the canary gets nothing more, however many requests come.
        assert {client.post("/v1/completions", json=BODY).headers["x-minserve-route"] for _ in range(5)} == {"stable"}


def test_an_admin_starts_stops_and_promotes_a_canary():
    app, _ = canary_server(lambda real, *a, **kw: real(*a, **kw), share=0.0)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=BODY).headers["x-minserve-route"] == "stable"
        bad = client.post("/routes/canary/start", json={"share": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "share"
        bad = client.post("/routes/canary/start", json={"criteria": {"min_samples": -1}})
        assert bad.status_code == 400 and "canary.criteria.min_samples" in bad.text
        bad = client.post("/routes/canary/start", json={"criteria": {"p99": 1}})
        assert bad.status_code == 400 and "canary.criteria.p99: unknown field" in bad.text
        started = client.post("/routes/canary/start", json={"share": 1.0, "criteria": {"min_samples": 50, "window": 50}})
        assert started.status_code == 200 and started.json()["evidence"]["share"] == 1.0
        assert client.post("/v1/completions", json=BODY).headers["x-minserve-route"] == "canary"
        assert client.post("/routes/canary/stop").json()["decision"] == "stop"
        assert client.post("/v1/completions", json=BODY).headers["x-minserve-route"] == "stable"
        assert client.post("/routes/canary/promote").json()["decision"] == "promote"
        r = client.post("/v1/completions", json=BODY)
        assert r.headers["x-minserve-route"] == "canary" and r.headers["x-minserve-decision"].startswith("reason=default")
        view = client.get("/routes").json()
        assert view["default"] == "canary" and view["canary"]["state"] == "promoted"
        assert [d["decision"] for d in view["canary"]["decisions"]] == ["start", "stop", "promote"]
        assert client.post("/routes/canary/launch").status_code == 404


def summary(samples, failure_rate=0.0, bad=0.0, e2e=1.0, ttft=0.1, tpot=0.05):
    return {"samples": samples, "failure_rate": failure_rate, "bad_answer_rate": bad, "e2e_p90_s": e2e,
            "ttft_p90_s": ttft, "tpot_p50_s": tpot}


@pytest.mark.parametrize("cand, base, found", [
    (summary(19, failure_rate=1.0), summary(50), []),                       # too few samples yet
    (summary(20, failure_rate=0.06), summary(0), ["failure_rate"]),         # needs no baseline
    (summary(20, e2e=2.1), summary(19), []),                                # baseline too small
    (summary(20, e2e=2.1), summary(20), ["e2e_p90_ratio"]),
    (summary(20, e2e=1.9, tpot=0.074), summary(20), []),
    (summary(20, tpot=0.08, ttft=0.3), summary(20), ["ttft_p90_ratio", "tpot_p50_ratio"]),
    (summary(20, bad=0.5), summary(20, bad=0.25), ["bad_answer_increase"]),
    (summary(20, bad=0.4), summary(20, bad=0.25), []),
])
def test_the_criteria_decide_only_on_enough_samples(cand, base, found):
    assert [b[0] for b in breaches(CanaryCriteria(), cand, base)] == found


def test_quantiles_interpolate():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([0.0, 10.0], 0.9) == 9.0
