"""Issue 25: downgrade routes. With the baseline's two seats held by long streams, a request whose
deadline the baseline would miss goes to a cheaper route if its class allows it (200, the route
recorded), and is rejected as without routes otherwise (429 ``deadline``).

As in test_deadlines.py, the deadline model's rates are pinned (a tiny EWMA weight keeps the
priors), so what admission predicts is set by the test, not by this machine's speed. The cheap
route is int4 with a shorter context (max_model_len 64): a request that does not fit it is not
downgraded."""

import contextlib
import time

import httpx
import pytest

from live_server import live_server
from minserve.engine.llm_engine import LLMEngine
from minserve.server import AdmissionConfig
from minserve.server.routed_app import create_routed_app
from minserve.server.routes import routes_config

SEATS = 2
PROMPT = "The quick brown fox"


def delayed(execute, seconds: float):
    def run(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)
    return run


def hold_a_seat(base: str, streams: contextlib.ExitStack):
    """A long stream, running once its first event is read; its line iterator."""
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    lines = streams.enter_context(httpx.stream("POST", base + "/v1/completions", json=body, timeout=30)).iter_lines()
    next(line for line in lines if line.startswith("data: "))
    return lines


@pytest.fixture(scope="module")
def busy():
    """A routed server whose baseline seats are held by long streams; yields (base, router)."""
    cfg = routes_config({"model": "tiny-llama", "routes": {
        "stable": {"max_num_seqs": SEATS}, "cheap": {"quantization": "int4", "max_model_len": 64}},
        "downgrade": {"batch": ["cheap"]}})
    engines = {n: LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=64, max_num_batched_tokens=128, **a)
               for n, a in cfg.routes.items()}
    engines["stable"].runner.execute = delayed(engines["stable"].runner.execute, 0.01)  # 500 tokens: ~5 s
    pinned = AdmissionConfig(prior_decode_s_per_step=0.05, ewma_alpha=1e-9)
    app = create_routed_app(engines, cfg, admission=pinned)
    with live_server(app) as base, contextlib.ExitStack() as streams:
        readers = [hold_a_seat(base, streams) for _ in range(SEATS)]  # referenced: closed when collected
        assert len(readers) == SEATS
        yield base, app.state.minserve.router
    for e in engines.values():
        assert e.kv.pool.num_free == e.kv.pool.num_blocks and not e.has_unfinished_requests()


def post(base, cls: str, max_tokens: int = 4):
    return httpx.post(base + "/v1/completions", timeout=30, json={"prompt": PROMPT, "max_tokens": max_tokens},
                      headers={"x-deadline-ms": "2000", "x-priority-class": cls})


def sample(base, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_an_allowed_class_is_downgraded_instead_of_rejected(busy):
    base, router = busy
    r = post(base, "batch")
    assert r.status_code == 200, r.text
    assert r.headers["x-minserve-route"] == "cheap"
    assert r.headers["x-minserve-decision"].startswith("reason=downgrade_deadline; precision=int4/float32")
    rec = router.log.recent()[-1]
    assert (rec["route"], rec["reason"], rec["outcome"], rec["priority_class"]) == (
        "cheap", "downgrade_deadline", "ok", "batch")
    assert sample(base, 'minserve:route_decisions_total{reason="downgrade_deadline",route="cheap"}') == 1


def test_a_disallowed_class_is_rejected_as_today(busy):
    base, router = busy
    before = sample(base, 'minserve:request_failures_total{reason="overload",route="stable"}')
    r = post(base, "interactive")
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline", r.text
    # A shed request is recorded and says where it was refused, like every other request.
    assert "Retry-After" in r.headers and r.headers["x-minserve-route"] == "stable"
    assert r.headers["x-minserve-decision"].startswith("reason=default; precision=")
    rec = router.log.recent()[-1]
    assert (rec["route"], rec["reason"], rec["outcome"], rec["status"], rec["priority_class"]) == (
        "stable", "default", "overload", 429, "interactive")
    assert rec["request_id"].startswith("cmpl-")
    assert sample(base, 'minserve:request_failures_total{reason="overload",route="stable"}') == before + 1
    assert sample(base, 'minserve:admission_rejected_total{priority_class="interactive",reason="deadline",'
                        'route="stable"}') >= 1


def test_a_request_too_long_for_the_cheap_route_is_not_downgraded(busy):
    base, _ = busy
    r = post(base, "batch", max_tokens=60)  # prompt + 60 > the cheap route's 64 tokens
    assert r.status_code == 429 and r.json()["error"]["code"] == "deadline", r.text
