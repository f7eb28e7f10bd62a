"""Lab 09 (release gates): every check passes on the right answer and fails on a wrong one with its
reason, and under CI the reference solution agrees with the measurement; the naive threshold's
false-alarm count on known values; the eval rows' shape the gate reads; the canary drive against a
tiny-llama routed app in process (a planted slowdown rolls back, later requests go to stable)."""

import itertools
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from course import lab09
from course import lab09_measure as me
from lab_check_helpers import not_ci, verified_under_ci  # noqa: F401 (not_ci: autouse)
from minserve.bench import gate

SAME = [10.0, 10.3, 10.9, 9.6, 10.1]   # p50 TPOT per run (ms) of one build


def test_naive_false_alarms_counts_pairs_beyond_the_threshold():
    flagged, pairs = me.naive_false_alarms(SAME)
    assert pairs == 10
    by_hand = sum(abs(b / a - 1) > 0.05 for a, b in itertools.combinations(SAME, 2))
    assert flagged == by_hand == 6   # 10.9 against each other run, 10.3 vs 9.6, 9.6 vs 10.1
    assert me.naive_false_alarms(SAME, 0.10)[0] == 1          # only 10.9 vs 9.6 (13.5 %)
    assert me.naive_false_alarms([5.0, 5.0, 5.0]) == (0, 3)


def gate_result(perf: str, qual: str):
    g = SimpleNamespace(performance=gate.Verdict(perf, [f"perf {perf}"]),
                        quality=gate.Verdict(qual, [f"qual {qual}"]))
    g.decision = gate.REJECT if gate.FAIL in (perf, qual) else gate.APPROVE
    return g


@pytest.mark.parametrize("perf, qual, truth", [("fail", "skipped", "performance"), ("pass", "fail", "quality"),
                                               ("fail", "fail", "both"), ("pass", "pass", "neither"),
                                               ("inconclusive", "fail", "quality")])
def test_which_gate_names_the_failed_verdict(perf, qual, truth, monkeypatch):
    q = lab09.q_which_gate("Exercise 2", gate_result(perf, qual), "c")
    assert q.evaluate(truth).ok and q.evaluate(truth.upper()).ok
    wrong = next(x for x in lab09.VERDICTS if x != truth)
    v = q.evaluate(wrong)
    assert not v.ok and "not what this run shows" in v.message
    assert not q.evaluate("latency").ok
    assert verified_under_ci(q, monkeypatch)


ROWS = [{"format": "fp32", "quantization": None, "perplexity": 20.0, "mean_kl": 0.0, "exact_match": 0.75},
        {"format": "int4:group_size=64", "quantization": "int4", "perplexity": 26.8, "mean_kl": 0.3,
         "exact_match": 0.5}]


def test_the_eval_rows_break_the_int4_floors():
    # The rows are what the gate reads (minserve eval --json's keys): this candidate breaks them.
    assert gate.quality_verdict(ROWS, gate.load_policy()["quality"]).status == gate.FAIL


DECISION = {"decision": "rollback", "criterion": "tpot_p50_ratio",
            "evidence": {"breaches": [{"criterion": "tpot_p50_ratio", "observed": 3.2, "limit": 1.5}],
                         "candidate": {"tpot_p50_s": 0.032, "e2e_p90_s": 0.9},
                         "baseline": {"tpot_p50_s": 0.010, "e2e_p90_s": 0.2},
                         "criteria": {"max_tpot_p50_ratio": 1.5}}}


# (the check, right answers, a near miss, [(a named mistake, words its message must say)])
NUMBER_CHECKS = {
    "q1 naive share": (lambda: lab09.q1_naive_share(SAME), [0.6], 0.4,
                       [(6, "count"), (60, "percentage"), (0.1, "10 %")]),
    "q3 perplexity": (lambda: lab09.q3_ppl_increase(ROWS), [34.0, 34.2], 30.0,
                      [(1.34, "ratio"), (0.34, "fraction"), (6.8, "points"), (-25.37, "upside down")]),
    "q5 rollback ratio": (lambda: lab09.q5_rollback_ratio(DECISION), [3.2], 2.5,
                          [(0.3125, "upside down"), (1.5, "limit"), (4.5, "E2E")]),
}


@pytest.mark.parametrize("name", list(NUMBER_CHECKS))
def test_number_checks_accept_the_value_and_name_each_mistake(name, monkeypatch):
    make, right, near_miss, mistakes = NUMBER_CHECKS[name]
    q = make()
    assert all(q.evaluate(x).ok for x in right)
    for wrong, words in mistakes:
        v = q.evaluate(wrong)
        assert not v.ok and words in v.message, (wrong, v.message)
    assert not q.evaluate(near_miss).ok
    assert not q.indistinct_mistakes()
    assert verified_under_ci(q, monkeypatch)


@pytest.fixture(scope="module")
def canary_timeline():
    from minserve import LLM
    from minserve.engine.observers import PlantedSlowdown
    from minserve.server.routed_app import create_routed_app
    from minserve.server.routes import routes_config
    cfg = routes_config({"model": "tiny-llama", "routes": {"stable": {}, "canary": {}},
                         "canary": {"route": "canary", "share": 0.5, "seed": 0,
                                    "criteria": {"max_ttft_p90_ratio": None, "max_e2e_p90_ratio": None,
                                                 "max_bad_answer_increase": None, "min_samples": 4,
                                                 "max_tpot_p50_ratio": 1.5}}})
    llms = {n: LLM("tiny-llama", max_num_seqs=2, num_kv_blocks=32) for n in cfg.routes}
    llms["canary"].llm_engine.add_step_observer(PlantedSlowdown(5.0))
    app = create_routed_app({n: x.llm_engine for n, x in llms.items()}, cfg)
    with TestClient(app) as client:
        frame = me.drive_canary(client, {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True},
                                limit=60, after_rollback=3)
        view = client.get("/routes").json()
    return frame, view


def test_the_canary_drive_sees_the_rollback_and_stable_afterwards(canary_timeline):
    frame, view = canary_timeline
    decision = me.rollback_decision(view)
    assert decision is not None and decision["criterion"] == "tpot_p50_ratio"
    rolled = frame[frame.state == "rolled_back"]
    assert len(rolled) == 4                                   # the breaking request + 3 after it
    assert set(rolled.route.iloc[1:]) == {"stable"} and set(frame.reason) <= {"default", "canary_share"}
    assert rolled.tpot_ratio.iloc[0] > 1.5
    assert lab09.q5_rollback_ratio(decision).evaluate(rolled.tpot_ratio.iloc[0]).ok
    assert me.rollback_decision({"canary": {"decisions": [{"decision": "start"}]}}) is None


def test_result_set_plants_and_removes_the_slowdown():
    from minserve import LLM
    from minserve.bench.datasets import SampleRequest
    llm = LLM("tiny-llama", max_num_seqs=2, num_kv_blocks=32)
    reqs = [SampleRequest("one two three four", 4, 4, str(i)) for i in range(2)]
    runs = me.result_set(llm.llm_engine, reqs, 2, slowdown=0.5)
    assert len(runs) == 2 and all(r.summary["completed"] == 2 for r in runs)
    assert len(me.per_run(runs)) == 2
    assert llm.llm_engine._observers is None    # the plant is gone after the runs


def test_gate_summary_shows_both_verdicts_and_cuts_long_lists():
    g = gate.GateResult(gate.Verdict("fail", [f"reason {i}" for i in range(5)]), gate.Verdict("skipped", ["no eval"]))
    text = me.gate_summary(g, shown=2)
    assert "performance verdict: fail" in text and "quality verdict: skipped" in text
    assert "reason 1" in text and "reason 2" not in text and "3 more" in text
    assert text.endswith("decision: reject (exit 1)")
