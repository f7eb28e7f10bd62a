"""Lab 08 (the optimization lab): every check passes on the right answer, fails on a wrong one with
its reason, and under CI the reference solution agrees with the measurement; the measurements
(SLO attainment, the bottleneck rule, the noise-aware verdict, the burst's recovery, the long
requests' cost to the others, what a KV cut shows) on synthetic frames with known answers; the
quality gate's two branches (a numerics change runs it and a failed gate blocks the win, any other
change does not run it); the restart and removal drills, and a restart onto another engine,
against tiny-llama servers in process."""

import math
from types import SimpleNamespace

import httpx
import numpy as np
import pandas as pd
import pytest

from course import lab08
from course import lab08_drills as drills
from course import lab08_measure as me
from lab_check_helpers import not_ci, verified_under_ci  # noqa: F401 (not_ci: autouse)

SLOS = {"short_qa": {"ttft": 100.0, "tpot": 20.0}, "agent": {"e2el": 500.0}}


def frame(rows):
    """A RunResult.requests frame from (label, ttft_ms, tpot_ms, e2e_ms, queue_ms, prompt_tokens)."""
    df = pd.DataFrame(rows, columns=["label", "ttft", "tpot", "e2e", "queue", "prompt_tokens"])
    return pd.DataFrame({"label": df.label, "ttft_s": df.ttft / 1000, "tpot_s": df.tpot / 1000,
                         "e2e_s": df.e2e / 1000, "queue_s": df.queue / 1000,
                         "prompt_tokens": df.prompt_tokens, "output_tokens": 4, "num_preemptions": 0,
                         "success": True, "token_times_s": [[0.0, 0.01, 0.03]] * len(df)})


def run(rows, kv=0.3, duration=2.0):
    return SimpleNamespace(requests=frame(rows), duration_s=duration,
                           state=pd.DataFrame({"t_s": [0.0, 1.0], "kv_cache_usage": [0.1, kv]}))


def test_met_judges_each_request_by_its_own_class():
    df = frame([("short_qa", 90, 10, 200, 0, 50), ("short_qa", 90, 30, 200, 0, 50),
                ("agent", 900, 300, 400, 0, 50), ("agent", 10, 1, 600, 0, 50)])
    assert me.met(df, SLOS).tolist() == [True, False, True, False]   # agent: only E2E counts


def test_attainment_and_where_each_class_leaves_its_slo(monkeypatch):
    light = run([("short_qa", 50, 10, 100, 0, 40)] * 4 + [("agent", 10, 1, 100, 0, 40)] * 2)
    heavy = run([("short_qa", 50, 10, 100, 0, 40), ("short_qa", 500, 10, 900, 400, 40)] * 2
                + [("agent", 10, 1, 100, 0, 40)] * 2)
    table = me.attainment({1.0: light, 4.0: heavy}, SLOS)
    assert table.loc[4.0, "short_qa"] == 0.5 and table.loc[1.0, "short_qa"] == 1.0
    assert me.leaves_slo(table) == {"agent": None, "short_qa": 4.0}
    q = lab08.q3_leaves_slo(table, "short_qa")
    assert q.evaluate(4.0).ok and q.evaluate("4").ok
    v = q.evaluate(1.0)
    assert not v.ok and "still held" in v.message
    assert not q.evaluate("never").ok
    assert lab08.q3_leaves_slo(table, "agent").evaluate("never").ok
    assert verified_under_ci(q, monkeypatch)


def test_slo_factor_gives_headroom_at_light_load():
    w = SimpleNamespace(class_slos=lambda: {"short_qa": {"slo": {"ttft": 100.0, "tpot": 20.0}}})
    r = run([("short_qa", 300, 10, 500, 0, 40)] * 9 + [("short_qa", 5000, 10, 500, 0, 40)])
    f = me.slo_factor(r, w)
    assert f == pytest.approx(6.0)           # 2 x the median 300 / 100 (the one stall does not count)
    assert 2 * 300 <= 100 * f


def signals(queue_ms, growth=3.0, kv=0.3, prompt_corr=True, tpot=10):
    light = run([("short_qa", 40, 10, 100, 0, 40 + i) for i in range(10)])
    rows = [("short_qa", 40 * growth + (i if prompt_corr else 0), tpot, 200, queue_ms, 40 + i) for i in range(10)]
    return me.signals(light, run(rows, kv=kv), SLOS)


def test_bottleneck_rules_on_measured_signals():
    assert me.classify(signals(queue_ms=100)) == "queue"           # 100 of ~124 ms queued, 3x growth
    assert me.classify(signals(queue_ms=100, kv=0.95)) == "kv"     # a full pool comes first
    assert me.classify(signals(queue_ms=0, growth=1.0)) == "prefill"
    assert me.classify(signals(queue_ms=0, growth=1.0, prompt_corr=False, tpot=50)) == "decode"


def test_q4_names_the_rule_and_its_evidence(monkeypatch):
    q = lab08.q4_bottleneck(signals(queue_ms=100))
    assert q.evaluate("queue").ok
    v = q.evaluate("kv")
    assert not v.ok and "peak KV use 30%" in v.message and "does not hold" in v.message
    assert "queue time is" in q.evaluate("none").message
    assert verified_under_ci(q, monkeypatch)


def test_compare_needs_the_test_and_the_interval_to_agree():
    rng = np.random.default_rng(0)

    def runs(values):
        return [run([("short_qa", float(v), 10, 100, 0, 40) for v in values])]
    base = rng.normal(200, 20, 40)
    better = me.compare(runs(base), runs(base - 80), "short_qa")
    assert better["verdict"] == "better" and better["p90 change CI"][1] < 0
    same = me.compare(runs(base), runs(rng.normal(200, 20, 40)), "short_qa")
    assert same["verdict"] == "no clear change"
    assert me.compare(runs(base), runs(base + 80), "short_qa")["verdict"] == "worse"


def test_no_verdict_names_its_measured_cause():
    """A change within the class's spread: the cause is the interval that spans zero; an interval
    that excludes zero while the rank test does not: the tail moved. A verdict needs no cause."""
    rng = np.random.default_rng(1)

    def runs(values):
        return [run([("short_qa", float(v), 10, 100, 0, 40) for v in values])]
    base = rng.normal(200, 60, 6)
    spread = me.compare(runs(base), runs(base + 5), "short_qa")
    assert spread["verdict"] == "no clear change"
    (cause,) = me.unclear_causes(spread)
    assert "includes no change" in cause and "6 and 6 requests" in cause
    disagree = {**spread, "p90 change CI": (40.0, 400.0), "p (Mann-Whitney)": 0.3}
    assert "the tail moved" in me.unclear_causes(disagree)[0]
    bulk = rng.normal(200, 1, 30)
    assert me.unclear_causes(me.compare(runs(bulk), runs(bulk - 80), "short_qa")) == []


def test_q5_verdict(monkeypatch):
    row = {"class": "short_qa", "verdict": "no clear change", "n before": 20, "n after": 20,
           "p50 before": 200.0, "p50 after": 190.0, "p (Mann-Whitney)": 0.4, "p90 change CI": (-40.0, 25.0)}
    q = lab08.q5_verdict(row)
    assert q.evaluate("no clear change").ok
    v = q.evaluate("better")
    assert not v.ok and "within what repeats" in v.message
    assert verified_under_ci(q, monkeypatch)
    few = lab08.q5_verdict({"class": "agent", "verdict": "too few requests", "n before": 2, "n after": 2})
    assert few.evaluate("too few requests").ok and not few.evaluate("better").ok
    assert verified_under_ci(few, monkeypatch)


def test_q1_most_prompt_tokens(monkeypatch):
    shapes = pd.DataFrame({"workload": ["short_qa"] * 5 + ["rag"] * 2,
                           "prefix_tokens": [10] * 7, "body_tokens": [5] * 5 + [100] * 2})
    q = lab08.q1_most_prompt_tokens(shapes)
    assert q.evaluate("rag").ok
    v = q.evaluate("short_qa")
    assert not v.ok and "most requests" in v.message
    assert "answer with one of" in q.evaluate("codegen").message
    assert verified_under_ci(q, monkeypatch)


def test_q2_p90_ttft(monkeypatch):
    rows = ([("short_qa", 100 + 10 * i, 10, 900 + i, 40 + i, 40) for i in range(10)]
            + [("agent", 1000 + i, 10, 2000, 0, 40) for i in range(10)])
    base = run(rows).requests
    q = lab08.q2_p90_ttft(base, "short_qa")
    e = float(np.percentile(100 + 10 * np.arange(10), 90))
    assert q.evaluate(e).ok
    assert "median" in q.evaluate(float(np.median(100 + 10 * np.arange(10)))).message
    assert "every class" in q.evaluate(1000 * base.ttft_s.quantile(0.9)).message
    assert "end-to-end" in q.evaluate(1000 * base[base.label == "short_qa"].e2e_s.quantile(0.9)).message
    assert "unit mix-up" in q.evaluate(e / 1000).message
    assert q.indistinct_mistakes() == []
    assert verified_under_ci(q, monkeypatch)


def test_q6_lost_requests(monkeypatch):
    outcomes = pd.DataFrame({"status": [0, 200, 503], "outcome": ["error", "ok", "shed"],
                             "requests": [5, 20, 3]})
    rep = drills.RestartReport(1.0, 0.4, outcomes, lost=8, retried_ok=8)
    q = lab08.q6_lost(rep)
    assert q.evaluate(8).ok
    assert "connections refused" in q.evaluate(5).message
    assert "cut off at the stop" in q.evaluate(3).message
    assert "after the retry" in q.evaluate(0).message
    assert verified_under_ci(q, monkeypatch)


def test_burst_report_detects_and_times_the_recovery():
    slo = {"short_qa": {"ttft": 100.0}}
    sends = [0.0, 0.5, 1.0, 1.0, 1.0, 1.5, 2.0, 2.5]
    ttft = [50, 50, 300, 300, 300, 200, 60, 50]          # late from the burst until 1.5 s
    req = pd.DataFrame({"label": "short_qa", "send_s": sends, "outcome": "ok", "ttft_s": np.array(ttft) / 1000,
                        "tpot_s": 0.01, "e2e_s": 0.5})
    state = pd.DataFrame({"t_s": [0.2, 0.7, 1.1, 1.6, 2.1], "num_waiting": [0, 0, 3, 1, 0]})
    rep = drills.burst_report(SimpleNamespace(requests=req, state=state), slo, burst_at_s=1.0)
    assert rep.detected_after_s == pytest.approx(0.1) and rep.peak_waiting == 3
    assert rep.late_after_burst == 4 and rep.recovered_after_s == pytest.approx(1.0)
    req.loc[7, "ttft_s"] = 0.5                            # still late at the end: never recovered
    assert math.isinf(drills.burst_report(SimpleNamespace(requests=req, state=state), slo, 1.0).recovered_after_s)


def test_restart_drill_against_a_server_in_process():
    from minserve import LLM
    from minserve.lab.local_server import serve
    from minserve.lab.workload import make_requests
    llm = LLM("tiny-llama", max_num_seqs=4, num_kv_blocks=64)
    reqs = make_requests(llm.get_tokenizer(), 16, 8, num_requests=24, seed=3)
    srv = serve(llm)
    port = srv.base_url
    rep = drills.restart_drill(srv, drills.class_calls(reqs, rate=24, seed=1), restart_at_s=0.4, down_s=0.3)
    try:
        assert rep.server.base_url == port and not srv.running      # same address, a new server
        assert rep.back_after_s >= 0.3 and math.isfinite(rep.back_after_s)
        assert rep.outcomes.requests.sum() == 24
        assert rep.lost == int(rep.outcomes[rep.outcomes.outcome != "ok"].requests.sum()) > 0
        assert rep.retried_ok == rep.lost                           # the server is back: all answered
    finally:
        rep.server.stop()


def test_removal_drill_fails_over_to_the_replica_left():
    from minserve import LLM
    from minserve.lab.local_server import serve
    from minserve.lab.workload import make_requests
    a, b = (LLM("tiny-llama", max_num_seqs=4, num_kv_blocks=64) for _ in range(2))
    reqs = make_requests(a.get_tokenizer(), 16, 8, num_requests=24, seed=5)
    kept, removed = serve(a), serve(b)
    try:
        rep = drills.removal_drill(kept, removed, drills.class_calls(reqs, rate=24, seed=1), remove_at_s=0.4)
        assert not removed.running
        assert rep.outcomes.sum().tolist() == [12, 12]                # round robin: half each
        assert rep.outcomes.loc["ok", "A (kept)"] == 12               # the replica left answered all
        assert rep.failed_over == 12 - rep.outcomes["B (removed)"].get("ok", 0) > 0
        assert rep.failover_ok == rep.failed_over                     # and took over the rest
    finally:
        kept.stop()
        removed.stop()



def test_a_replica_removed_before_its_first_call_still_fails_over():
    """Removed at once, as a busy machine can make it happen before B's client has asked anything:
    B's calls fail one by one and go to A, the drill does not fail (it named the model itself)."""
    from minserve import LLM
    from minserve.lab.local_server import serve
    from minserve.lab.workload import make_requests
    a, b = (LLM("tiny-llama", max_num_seqs=4, num_kv_blocks=64) for _ in range(2))
    reqs = make_requests(a.get_tokenizer(), 16, 8, num_requests=8, seed=5)
    kept, removed = serve(a), serve(b)
    try:
        removed.stop()
        rep = drills.removal_drill(kept, removed, drills.class_calls(reqs, rate=24, seed=1), remove_at_s=0.0)
        assert rep.outcomes["B (removed)"].get("ok", 0) == 0 and rep.failed_over == 4
        assert rep.failover_ok == 4 and rep.outcomes.loc["ok", "A (kept)"] == 4
    finally:
        kept.stop()

# ---- step 6: the quality gate runs only when the change touched numerics ----------------------

@pytest.mark.parametrize("passes", [True, False])
def test_a_numerics_change_runs_the_gate_and_a_failed_gate_blocks_the_win(passes):
    calls = []

    def gate():
        calls.append(1)
        return passes
    win, passed = me.gated_win("better", {"quantization": "int8"}, gate)
    assert calls == [1] and passed is passes
    assert win is passes                          # "better" latency, but only a passed gate makes it a win
    assert me.gated_win("no clear change", {"kv_cache_dtype": "int8"}, lambda: True) == (False, True)


def test_a_change_that_keeps_every_token_does_not_run_the_gate():
    def gate():
        raise AssertionError("the gate ran for a change that keeps the numerics")
    for args in ({"max_num_seqs": 8}, {"enable_chunked_prefill": False}, {"num_kv_blocks": 32},
                 {"speculative_config": {"method": "ngram"}}):
        assert not me.touches_numerics(args)
        assert me.gated_win("better", args, gate) == (True, None)
        assert me.gated_win("worse", args, gate) == (False, None)


# ---- long requests and the KV cut ---------------------------------------------------------------

def http_run(rows, state=None):
    """A RunResult over HTTP: rows of (label, ttft_ms, tpot_ms); /metrics samples in ``state``."""
    df = frame([(lab, t, p, 10 * t, math.nan, 40) for lab, t, p in rows])
    st_ = state if state is not None else pd.DataFrame({"t_s": [0.0], "num_running": [1], "num_waiting": [0],
                                                        "kv_cache_usage": [0.2], "num_preemptions": [0]})
    return SimpleNamespace(requests=df, state=st_, duration_s=2.0)


def test_mix_in_spreads_the_long_requests_and_keeps_the_steady_order():
    from course import lab08_stress as st
    out = st.mix_in(list("abcdef"), ["L1", "L2"])
    assert out == ["a", "b", "L1", "c", "d", "L2", "e", "f"]
    assert st.mix_in([1, 2], []) == [1, 2]
    reqs = [SimpleNamespace(prompt_len=p, expected_output_len=o) for p, o in ((100, 20), (30, 5))]
    assert st.cut_kv_blocks(reqs, 16) == 9           # 120 tokens: 8 blocks, and one to spare


def test_long_report_and_q7(monkeypatch):
    from course import lab08_stress as st
    rng = np.random.default_rng(7)
    calm_ttft, slow = rng.normal(100, 10, 30), rng.normal(150, 40, 30)
    calm = http_run([("short_qa", t, 10) for t in calm_ttft])
    mixed = http_run([("short_qa", t, 14) for t in slow] + [(st.LONG, 2000.0 + 100 * k, 50) for k in range(6)])
    lr = st.long_report(calm, mixed, SLOS)
    e = np.percentile(slow, 90) / np.percentile(calm_ttft, 90)
    assert lr.ttft_growth == pytest.approx(e, rel=1e-3) and lr.tpot_growth == pytest.approx(1.4)
    assert lr.ttft["verdict"] == "worse" and st.LONG not in lr.table.index
    assert lr.table.loc["short_qa", "within SLO calm"] > lr.table.loc["short_qa", "within SLO mixed"]
    q = lab08.q7_ttft_growth(calm, mixed)
    assert q.evaluate(round(e, 2)).ok
    ok = mixed.requests
    assert "long requests themselves" in q.evaluate(1000 * ok.ttft_s.quantile(0.9) / np.percentile(calm_ttft, 90)).message
    assert "medians" in q.evaluate(float(np.median(slow) / np.median(calm_ttft))).message
    assert "difference in ms" in q.evaluate(np.percentile(slow, 90) - np.percentile(calm_ttft, 90)).message
    assert "upside down" in q.evaluate(1 / e).message
    assert not q.evaluate(1.0).ok
    assert q.indistinct_mistakes() == []
    assert verified_under_ci(q, monkeypatch)


def test_kv_cut_report_reads_the_metrics_and_the_objectives():
    from course import lab08_stress as st

    def gauges(kv, waiting, preempted):
        return pd.DataFrame({"t_s": [0.0, 0.5, 1.0], "num_running": [1, 2, 1], "num_waiting": [0, waiting, 0],
                             "kv_cache_usage": [0.1, kv, 0.2], "num_preemptions": [0, preempted, preempted]})
    full = http_run([("short_qa", 50, 10)] * 10, gauges(0.4, 0, 0))
    cut = http_run([("short_qa", 50, 10)] * 6 + [("short_qa", 400, 10)] * 4, gauges(1.0, 3, 2))
    rep = st.kv_cut_report(full, cut, SLOS)
    assert rep.observable and not rep.held                       # 60 % within SLO < 90 %
    assert rep.table.loc["preemptions", "cut KV pool"] == 2 and rep.table.loc["peak waiting", "full KV pool"] == 0
    assert rep.table.loc["within SLO", "cut KV pool"] == pytest.approx(0.6)
    calm = st.kv_cut_report(full, full, SLOS)
    assert not calm.observable and calm.held                     # nothing changed: nothing to see


def test_a_restart_can_come_back_on_another_engine():
    from minserve import LLM
    from minserve.lab.local_server import serve
    a, b = (LLM("tiny-llama", max_num_seqs=2, num_kv_blocks=n) for n in (64, 8))
    srv = serve(a)
    new = srv.restart(0.0, engine=b)
    try:
        assert new.base_url == srv.base_url and new.engine is b.llm_engine and not srv.running
        r = httpx.post(f"{new.base_url}/v1/completions", json={"model": new.model_name, "prompt": "hi",
                                                               "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        new.stop()
