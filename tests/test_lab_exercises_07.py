"""Lab 07 (overload and goodput): every check passes on the right answer, fails on a wrong one and
names the typical mistake; under CI the reference solution agrees with the measurement. Plus the
toolkit pieces the lab adds: the in-notebook server (local_server.py) and traffic with headers
(traffic.py). Fast: synthetic frames and tiny-llama."""

import math
from types import SimpleNamespace

import httpx
import numpy as np
import pandas as pd
import pytest

from course import lab07
from lab_check_helpers import not_ci, verified_under_ci  # noqa: F401 (not_ci: autouse)
from minserve.lab import traffic as tr
from minserve.lab.local_server import LocalServer, serve
from minserve.server import AdmissionConfig, ClassLimits


# ---- lab 07 checks ------------------------------------------------------------------------------

def sweep_table(goodput=(2.17, 3.83, 4.45, 2.36), throughput=(2.17, 3.83, 5.47, 3.41)):
    rates = [2.62, 5.25, 10.49, 20.98]
    dur = [1.85, 2.09, 2.92, 3.81]
    good = [round(g * d) for g, d in zip(goodput, dur)]
    answered = [round(t * d) for t, d in zip(throughput, dur)]
    return pd.DataFrame({"throughput (req/s)": [a / d for a, d in zip(answered, dur)],
                         "goodput (req/s)": [g / d for g, d in zip(good, dur)],
                         "answered": answered, "good": good, "duration (s)": dur},
                        index=pd.Index(rates, name="offered (req/s)"))


def test_q1_goodput(monkeypatch):
    t = sweep_table()
    q = lab07.q1_goodput(t, 20.98)
    g, thr = t.loc[20.98, "goodput (req/s)"], t.loc[20.98, "throughput (req/s)"]
    assert q.evaluate(round(g, 2)).ok
    assert "raw throughput" in q.evaluate(thr).message
    assert "offered load" in q.evaluate(20.98).message
    assert "divide by the run's duration" in q.evaluate(int(t.loc[20.98, "good"])).message
    assert "share of answers" in q.evaluate(t.loc[20.98, "good"] / t.loc[20.98, "answered"]).message
    assert verified_under_ci(q, monkeypatch)
    # The solution names the row by a plain float (numpy 2 would print np.float64(...)).
    assert "np.float64" not in lab07.q1_goodput(t, np.float64(20.98)).solution_code


def test_q2_knee(monkeypatch):
    t = sweep_table()
    q = lab07.q2_knee(t)
    assert q.evaluate(10.49).ok
    assert "not one of the offered loads" in q.evaluate(7.0).message
    assert "past its peak" in q.evaluate(20.98).message
    assert "before its peak" in q.evaluate(2.62).message
    assert "should be one of the offered loads" in q.evaluate("10").message
    assert verified_under_ci(q, monkeypatch)
    # Throughput's peak somewhere goodput is not: the message says why that is not the knee.
    t2 = sweep_table(goodput=(2.0, 4.0, 3.0, 1.0), throughput=(2.0, 4.0, 5.0, 5.5))
    v = lab07.q2_knee(t2).evaluate(20.98)
    assert not v.ok and "raw throughput is highest" in v.message
    # A neighbour within 10 % of the best goodput is accepted, and told so.
    t3 = sweep_table(goodput=(2.0, 4.3, 4.45, 1.0))
    v = lab07.q2_knee(t3).evaluate(5.25)
    assert v.ok and "within 10%" in v.message


def test_q3_deadline_prediction(monkeypatch):
    P, N, p, d = 32, 8, 2.29e-3, 49.2e-3
    q = lab07.q3_deadline_prediction(P, N, p, d, P * p + N * d)
    assert q.evaluate(1000 * (P * p + N * d)).ok
    assert "prefill alone" in q.evaluate(1000 * P * p).message
    assert "decode alone" in q.evaluate(1000 * N * d).message
    assert "one decode step short" in q.evaluate(1000 * (P * p + (N - 1) * d)).message
    assert "unit mix-up" in q.evaluate(P * p + N * d).message    # seconds
    assert verified_under_ci(q, monkeypatch)
    # On this lab's numbers (a run's p = 3 ms per prompt token, d = 41.8 ms) no slip is within the
    # tolerance of the right answer: each one is told apart.
    typical = lab07.q3_deadline_prediction(32, 8, 3e-3, 41.8e-3, 32 * 3e-3 + 8 * 41.8e-3)
    assert typical.indistinct_mistakes() == []


def test_q3_counting_one_step_short_is_named_when_the_prefill_costs_a_step():
    """Issue 19: when the prompt's prefill costs about one decode step (P * p close to d), the
    answer P * p + (N - 1) * d equals N * d, and the check called it "the decode alone": a wrong
    diagnosis for the learner who counted N - 1 steps. Now the check names that slip (and, as the
    two give the same number, the other one as well)."""
    P, N, d = 32, 8, 41.8e-3
    p = 1.01 * d / P                       # prefill of the prompt: one decode step and 1 %
    q = lab07.q3_deadline_prediction(P, N, p, d, P * p + N * d)
    v = q.evaluate(1000 * (P * p + (N - 1) * d))
    assert not v.ok and "one decode step short" in v.message
    assert v.message.index("one decode step short") < v.message.index("decode alone")
    v = q.evaluate(1000 * N * d)           # the decode alone: named too, never called right
    assert not v.ok and "decode alone" in v.message
    assert q.evaluate(1000 * (P * p + N * d)).ok


def test_merged_mistakes_name_every_slip_that_gives_the_value():
    from minserve.lab.checks import Mistake
    ms = lab07.merged([Mistake("slip A.", value=100.0), Mistake("slip B.", value=110.0),
                       Mistake("slip C.", value=100.5), Mistake("any negative", test=lambda a: a < 0)],
                      rel_tol=0.01)
    assert len(ms) == 3
    assert "slip A." in ms[0].message and "slip C." in ms[0].message and "2 slips" in ms[0].message
    assert ms[1].message == "slip B." and ms[2].test is not None


def test_q1_and_q2_tell_every_mistake_apart_on_a_typical_run():
    """On a typical sweep (goodput past the knee below throughput, as the lab's lesson checks) no
    named mistake of Exercise 1 can be mistaken for the right answer."""
    t = sweep_table()
    assert lab07.q1_goodput(t, 20.98).indistinct_mistakes() == []


def test_q4_shed_class(monkeypatch):
    counts = pd.DataFrame({"ok": [7, 4], "shed": [13, 0]}, index=pd.Index(["batch", "interactive"]))
    q = lab07.q4_shed_class(counts)
    assert q.evaluate("batch").ok and "13 batch requests got 429" in q.evaluate("batch").message
    assert not q.evaluate("interactive").ok and not q.evaluate("both").ok
    assert verified_under_ci(q, monkeypatch)
    none_shed = pd.DataFrame({"ok": [20, 4]}, index=pd.Index(["batch", "interactive"]))
    assert lab07.q4_shed_class(none_shed).evaluate("neither").ok


# ---- the server in the notebook, and traffic with headers ---------------------------------------

@pytest.fixture(scope="module")
def seats2():
    from minserve import LLM
    return LLM("tiny-llama", max_num_seqs=2, max_num_batched_tokens=128, num_kv_blocks=128)


def slow_steps(llm, seconds: float):
    """Make each engine step take at least ``seconds`` so queues form on any machine."""
    import time
    runner = llm.llm_engine.runner
    real = runner.execute

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    runner.execute = slow
    return lambda: setattr(runner, "execute", real)


def test_local_server_serves_stops_and_serves_again(seats2):
    srv = serve(seats2, admission=AdmissionConfig())
    try:
        assert srv.running and "serving at" in repr(srv)
        assert httpx.get(srv.base_url + "/health").status_code == 200
        r = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                       json={"model": srv.model_name, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert srv.admission_counts().loc["interactive", "admitted"] == 1
        # A second server on the same engine replaces the first (its admission series too).
        srv2 = serve(seats2, admission=AdmissionConfig(interactive=ClassLimits(max_queued_requests=1)))
        assert not srv.running and srv2.running and srv2.base_url != srv.base_url
        assert srv2.admission.config.interactive.max_queued_requests == 1
        srv2.stop()
        srv2.stop()  # idempotent
    finally:
        srv.stop()
    # The engine is the notebook's again.
    from minserve import SamplingParams
    out = seats2.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with LocalServer(seats2) as s3:
        assert httpx.get(s3.base_url + "/health").status_code == 200
    assert not s3.running


def test_offer_records_what_each_request_got(seats2):
    restore = slow_steps(seats2, 0.02)
    try:
        reqs = [SimpleNamespace(prompt=f"request number {i} " * 4, prompt_len=20, expected_output_len=6,
                                request_id=str(i), scenario="") for i in range(8)]
        bounded = AdmissionConfig(interactive=ClassLimits(max_queued_requests=1),
                                  batch=ClassLimits(max_queued_requests=1))
        with serve(seats2, admission=bounded) as srv:
            calls = tr.calls(reqs, label="burst", priority_class="batch")
            res = tr.offer(srv.base_url, calls, slo=tr.SLO(ttft_ms=60_000), live=False)
            counts = srv.admission_counts()
        df = res.requests
        assert set(df.outcome) == {"ok", "shed"}
        shed = df[df.outcome == "shed"]
        assert (shed.status == 429).all() and (shed.retry_after_s >= 1).all()
        assert (shed.error_code == "queue_full_requests").all()
        ok = df[df.outcome == "ok"]
        assert (ok.output_tokens == 6).all() and (ok.ttft_s > 0).all() and ok.tpot_s.notna().all()
        assert counts.loc["batch", "shed: queue_full_requests"] == len(shed)
        g = res.goodput(tr.SLO(ttft_ms=60_000))
        assert g["good"] == g["answered"] == len(ok) and g["shed"] == len(shed)
        assert g["goodput_rps"] == pytest.approx(len(ok) / res.duration_s)
        assert res.counts().loc["burst", "shed"] == len(shed)
        assert tr.SLO(ttft_ms=0.001).met(df).sum() == 0

        # Deadlines: a model that believes steps are free admits everything; the queued ones
        # expire (504 deadline_exceeded as a stream error event), the first ones finish. Steps of
        # >= 100 ms make it hold on a busy machine too: a pair of 6-token answers takes >= 0.6 s, so
        # the third pair cannot finish within 1.5 s, while the first has 0.9 s to spare.
        optimist = AdmissionConfig(prior_prefill_s_per_token=1e-9, prior_decode_s_per_step=1e-9,
                                   ewma_alpha=1e-9)
        slower = slow_steps(seats2, 0.08)
        try:
            with serve(seats2, admission=optimist) as srv:
                late = tr.offer(srv.base_url, tr.calls(reqs, deadline_ms=1500), live=False)
        finally:
            slower()
        out = late.requests
        assert "expired" in set(out.outcome) and "ok" in set(out.outcome)
        assert (out[out.outcome == "expired"].error_code == "deadline_exceeded").all()
        assert (out[out.outcome == "expired"].status == 504).all()

        # Impatient clients give up; the server aborts their requests and frees the seats.
        with serve(seats2, admission=AdmissionConfig()) as srv:
            gone = tr.offer(srv.base_url, tr.calls(reqs), patience_s=0.15, live=False)
        assert "gave up" in set(gone.requests.outcome)
    finally:
        restore()
    assert not seats2.llm_engine.has_unfinished_requests()
    pool = seats2.llm_engine.kv.pool
    assert pool.num_free == pool.num_blocks


def test_experiment_is_what_the_panel_calls(seats2, monkeypatch):
    monkeypatch.setattr(tr, "_tokenizer", lambda model: seats2.get_tokenizer())
    with serve(seats2) as srv:
        res = tr.experiment(None, base_url=srv.base_url, num_requests=3, request_rate=math.inf,
                            prompt_tokens=16, output_tokens=3, live=False)
    assert len(res.requests) == 3 and (res.requests.outcome == "ok").all()
    assert list(res.percentiles().columns) == ["p50", "p90", "p99", "answered"]
    # The final figure exists without a live view, and shows as a PNG (the lab shows the last
    # calibration run before pyplot has drawn anything, when a bare Figure would print as text).
    assert res.figure is not None and len(res.figure.axes) == 3
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: shown.append(obj))
    res.show()
    assert shown and shown[0].format == "png" and shown[0].data[:8] == b"\x89PNG\r\n\x1a\n"


def test_offer_sends_each_calls_api_key(seats2):
    from minserve.server import Auth, Principal
    auth = Auth({"sk-a": Principal("acme"), "sk-ops": Principal("ops", admin=True)})
    with serve(seats2, auth=auth) as srv:
        cs = [tr.Call("hello there", 2, api_key="sk-a", label="with key"),
              tr.Call("hello there", 2, send_s=0.01, label="no key")]
        res = tr.offer(srv.base_url, cs, live=False, metrics_api_key="sk-ops")
    by = res.requests.set_index("label")
    assert by.loc["with key", "outcome"] == "ok" and by.loc["with key", "output_tokens"] == 2
    assert by.loc["no key", "status"] == 401 and by.loc["no key", "error_code"] == "invalid_api_key"
    assert res.settings["model"] == "tiny-llama" and len(res.state) > 0


def test_service_time_is_a_calibration_measurement(seats2):
    """The lab scales every rate and objective from repeated runs (lab.calibrate), not from one
    cold run; each run's first wave (the requests seated first) gives the sample."""
    from minserve.lab import calibrate
    restore = slow_steps(seats2, 0.01)
    try:
        reqs = [SimpleNamespace(prompt=f"request number {i} " * 4, prompt_len=20, expected_output_len=4,
                                request_id=str(i), scenario="") for i in range(4)]
        with serve(seats2) as srv:
            service = lab07.ServiceTime(srv.base_url, reqs, seats=2)
            cal = calibrate(service, name="service", repeats=2, max_runs=3, tolerance=10.0, echo=False)
    finally:
        restore()
    assert len(service.runs) == len(cal.samples) == 3 and len(cal.kept) == 2
    assert cal.samples[0] not in cal.kept or cal.samples.count(cal.samples[0]) > 1   # first dropped
    assert cal.median > 4 * 0.01                       # at least its steps' sleeps
    assert all(t > 0 for t in service.tpot_s)
    assert all(0 < x < s for x, s in zip(service.decode_s, cal.samples))
    assert service.kept(service.decode_s, cal) == pytest.approx(float(np.median(service.decode_s[-2:])))


def test_speed_drift_is_a_measured_cause_only_when_the_speed_changed():
    frame = pd.DataFrame({"outcome": ["ok", "ok", "shed"], "ttft_s": [0.1, 0.2, np.nan],
                          "e2e_s": [0.5, 0.6, 0.01]})       # decode 0.4 s
    assert lab07.speed_drift(0.38, [frame]) == []
    slower = lab07.speed_drift(0.2, [frame])
    assert len(slower) == 1 and "100% slower" in slower[0] and "400 ms against 200 ms" in slower[0]
    assert "faster" in lab07.speed_drift(0.8, [frame])[0]
    assert lab07.speed_drift(0.2, []) == [] and lab07.speed_drift(0.2, [frame.iloc[2:]]) == []


def test_lab07_panel_shows_the_servers_real_seats(seats2):
    """Issue 19: the lab's panel showed "max_num_seqs (server's) 16" for a 4-seat server. The lab
    passes its engine with the server's base_url, and the disabled sliders show its real values."""
    import re
    from pathlib import Path
    pytest.importorskip("ipywidgets")
    from minserve import lab
    source = (Path(__file__).resolve().parent.parent / "labs" / "07_overload_and_goodput.py").read_text()
    call = re.search(r"lab\.control_panel\((.*?)\)\n", source, re.S).group(1)
    assert "base_url=srv.base_url" in call and "engine=llm" in call
    with serve(seats2) as srv:
        panel = lab.control_panel(run=tr.experiment, base_url=srv.base_url, engine=seats2)
    def widgets(w):
        yield w
        for c in getattr(w, "children", ()):
            yield from widgets(c)

    seqs = [c for c in widgets(panel.widget) if getattr(c, "description", "").startswith("max_num_seqs")]
    assert seqs and seqs[0].value == 2 and seqs[0].disabled and "(server's)" in seqs[0].description
