"""Labs 02 and 03: every check passes the right answer, fails a wrong one, names the typical
mistake with its teaching message, and under CI proves its reference solution; plus the toolkit
pieces the two labs stand on (minserve.lab.capacity), on tiny-llama and synthetic frames."""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from minserve import lab
from minserve.engine.llm_engine import LLMEngine
from minserve.lab import capacity, checks
from course import lab02, lab03
from minserve.lab.presets import CI_ENV
from minserve.lab.workload import RunResult

SEATS = 4


@pytest.fixture(autouse=True)
def not_ci(monkeypatch):
    monkeypatch.delenv(CI_ENV, raising=False)


def fake_run(batches, *, budget=512, name="run"):
    """A RunResult whose only records are steps computing ``batches[i]`` requests each."""
    steps = pd.DataFrame({"t_s": np.arange(len(batches), dtype=float), "step_time_s": 0.5,
                          "batch": batches})
    return RunResult(name=name, target="engine", requests=pd.DataFrame(), state=pd.DataFrame(),
                     summary={}, duration_s=float(len(batches)),
                     settings={"max_num_batched_tokens": budget}, steps=steps)


def assert_ci_proves(q, monkeypatch):
    monkeypatch.setenv(CI_ENV, "1")
    v = q.evaluate(None)
    assert v.status == checks.VERIFIED, v.message


# ---- lab 02 -----------------------------------------------------------------------------------

OUTS = [8, 5, 3, 3, 21, 32, 8, 11, 8, 32, 21, 3, 21, 3, 11, 3]   # the quick preset's mix


def test_static_steps_counts_each_batchs_longest_answer():
    assert lab02.static_steps(OUTS, 4) == 8 + 32 + 32 + 21
    assert lab02.static_steps([5, 1, 7], 2) == 5 + 7   # a last, partial batch
    assert lab02.static_steps(OUTS, 1) == sum(OUTS)


def test_q1_static_steps(monkeypatch):
    right = lab02.static_steps(OUTS, SEATS)
    q = lab02.q1_static_steps(OUTS, SEATS, right)
    assert q.evaluate(right).ok and "longest answer" in q.evaluate(right).message
    assert not q.evaluate(right - 3).ok and "exact count" in q.evaluate(right - 3).message
    v = q.evaluate(sum(OUTS))
    assert not v.ok and "one request ran at a time" in v.message
    v = q.evaluate(round(sum(OUTS) / SEATS))
    assert not v.ok and "cannot refill a seat" in v.message
    v = q.evaluate(right + len(OUTS) // SEATS)
    assert not v.ok and "prefills a batch also samples" in v.message
    v = q.evaluate(4 * max(OUTS))
    assert not v.ok and "its own longest answer" in v.message
    assert_ci_proves(q, monkeypatch)
    # Under CI a measurement that disagrees with the formula fails loudly.
    with pytest.raises(checks.CheckFailed):
        lab02.q1_static_steps(OUTS, SEATS, right + 1).evaluate(None)


def test_q2_empty_seats(monkeypatch):
    outs = [4, 1, 1, 2]                      # one batch of four: 4 steps, 8 of 16 seat-steps busy
    static = fake_run([4, 2, 1, 1])
    cont = fake_run([4, 4])
    q = lab02.q2_empty_seats(static, cont, SEATS, outs)
    assert capacity.seat_use(static, SEATS) == {"steps": 4, "seat_steps": 16, "busy_seat_steps": 8,
                                                "empty_share": 0.5}
    right = 0.5
    assert q.evaluate(right).ok and q.evaluate(round(right, 2)).ok
    assert "continuous run left only 0%" in q.evaluate(right).message
    assert not q.evaluate(right + 0.1).ok
    q = lab02.q2_empty_seats(fake_run([4, 3, 1, 1, 1]), cont, SEATS, [5, 1, 2, 1])  # 10/20 busy
    assert q.evaluate(0.5).ok
    q = lab02.q2_empty_seats(fake_run([4, 4, 1, 1]), cont, SEATS, [4, 2, 2, 2])     # 10/16 busy
    right = 1 - 10 / 16
    assert q.evaluate(right).ok
    v = q.evaluate(10 / 16)
    assert not v.ok and "*busy*" in v.message
    v = q.evaluate(0.0)
    assert not v.ok and "continuous run's empty share" in v.message
    v = q.evaluate(100 * right)
    assert not v.ok and "not a percentage" in v.message
    assert_ci_proves(q, monkeypatch)


def load_table(achieved):
    loads = [1.0, 2.0, 3.0, 4.5, 7.0]
    return pd.DataFrame({"achieved req/s": achieved}, index=pd.Index(loads, name="offered req/s"))


KEEPS_UP_TO_3 = [0.98, 1.9, 2.8, 3.6, 3.9]   # 98 %, 95 %, 93 %, then 80 % of 4.5: the knee


def test_knee_rule_is_the_first_load_the_engine_falls_short_of():
    assert lab02.knee_rule(load_table(KEEPS_UP_TO_3)) == (3.0, 4.5)
    assert lab02.knee_rule(load_table([0.85, 1.7, 2.0, 2.1, 2.1])) == (0.0, 1.0)
    prev, knee = lab02.knee_rule(load_table([1.0, 2.0, 3.0, 4.5, 6.9]))
    assert prev == 7.0 and math.isnan(knee)


def test_q3_knee_accepts_the_knee_point_and_names_the_mistakes(monkeypatch):
    q = lab02.q3_knee(load_table(KEEPS_UP_TO_3), capacity=3.25)
    for ok in (4.5, 4.4, 4.6):                 # the knee point, read off the axis (4 %)
        v = q.evaluate(ok)
        assert v.ok, (ok, v.message)
        assert "the knee lies between the two" in v.message
    v = q.evaluate(7.0)
    assert not v.ok and "heaviest load" in v.message
    v = q.evaluate(3.0)
    assert not v.ok and "last load before the knee" in v.message
    v = q.evaluate(3.6)                        # the knee point's achieved throughput (y axis)
    assert not v.ok and "x axis" in v.message
    v = q.evaluate(3.25)                       # the capacity line
    assert not v.ok and "red line" in v.message
    v = q.evaluate(1.0)
    assert not v.ok and "too low" in v.message and "Hint" in v.message
    assert not q.evaluate("4.5").ok and "should be a number" in q.evaluate("4.5").message
    assert_ci_proves(q, monkeypatch)


def test_q3_knee_no_longer_accepts_any_value_below_the_knee():
    # Issue 19: with the lightest load past the knee, the old check accepted anything in
    # (0, knee]; and between two loads it accepted the whole bracket. Only the knee point is right.
    first_past = lab02.q3_knee(load_table([0.85, 1.7, 2.0, 2.1, 2.1]))
    assert lab02.knee_rule(load_table([0.85, 1.7, 2.0, 2.1, 2.1])) == (0.0, 1.0)
    assert first_past.evaluate(1.0).ok
    for wrong in (0.3, 0.5, 0.8):
        assert not first_past.evaluate(wrong).ok, wrong
    q = lab02.q3_knee(load_table(KEEPS_UP_TO_3))
    for wrong in (3.3, 3.9, 4.1):              # inside the old bracket (3.0, 4.5]
        assert not q.evaluate(wrong).ok, wrong


def test_q3_knee_names_the_plateau_even_inside_the_bracket():
    # Issue 19: on a loaded run the plateau height (y axis) lay between the last load kept up with
    # and the knee, and was accepted as the knee. It is named now.
    t = load_table([0.98, 1.9, 2.9, 3.5, 3.4])   # kept up to 3.0; knee 4.5; plateau 3.5
    q = lab02.q3_knee(t)
    v = q.evaluate(3.5)
    assert not v.ok and "plateau" in v.message and "x axis" in v.message
    assert q.evaluate(4.5).ok
    assert q.indistinct_mistakes() == []


def test_q3_knee_without_a_crossing_says_to_go_higher():
    v = lab02.q3_knee(load_table([1.0, 2.0, 3.0, 4.5, 6.9])).evaluate(7.0)
    assert not v.ok and "higher rates" in v.message


# ---- lab 02's load sweep, on a simulated engine --------------------------------------------------

def simulated_run(rate, services, seats=SEATS):
    """A RunResult of ``services`` (seconds each, in arrival order) offered at ``rate`` req/s at
    fixed intervals to a first-come first-served engine of ``seats`` seats: what the lab's runs
    record, without the noise, so that the measurement itself can be tested."""
    n = len(services)
    arrival = np.arange(1, n + 1) / rate            # bench/arrivals.py: the first one at 1 / rate
    free = [0.0] * seats
    admitted, finished = np.zeros(n), np.zeros(n)
    for i, s in enumerate(services):
        k = int(np.argmin(free))
        admitted[i] = max(arrival[i], free[k])
        finished[i] = free[k] = admitted[i] + s
    queue = admitted - arrival
    requests = pd.DataFrame({
        "success": True, "arrival_s": arrival, "first_scheduled_s": admitted,
        "first_token_s": admitted + 0.05, "finished_s": finished, "queue_s": queue,
        "ttft_s": queue + 0.05, "prefill_s": 0.05, "decode_s": np.asarray(services) - 0.05,
        "tpot_s": 0.02, "e2e_s": finished - arrival})
    waiting = [int(((arrival <= t) & (admitted > t)).sum()) for t in admitted]
    state = pd.DataFrame({"t_s": admitted, "num_waiting": waiting, "num_preemptions": 0})
    duration = float(finished.max())
    return RunResult(name=f"{rate} req/s", target="engine", requests=requests, state=state,
                     summary={"request_throughput": n / duration, "output_throughput": math.nan},
                     duration_s=duration, settings={"max_num_seqs": seats})


SERVICES = [0.25, 0.2, 0.15, 0.15, 0.6, 0.9, 0.25, 0.35] * 4   # mixed answers; mean 0.356 s
CAPACITY = SEATS / np.mean(SERVICES)                            # about 11.2 req/s, seats full


def test_achieved_rate_is_the_offered_load_while_the_engine_keeps_up():
    # Issue 19: N / run time counts the drain after the last arrival, so a run where nobody waited
    # read below 90 % of the load offered and was called past the knee.
    run = simulated_run(4.0, SERVICES[:15] + [0.9])    # 16 requests, a long answer last
    assert run.requests.queue_s.max() == 0
    assert capacity.achieved_rate(run) == pytest.approx(4.0)
    assert run.summary["request_throughput"] < 0.9 * 4.0   # the old measure: the drain
    t = lab.load_table({4.0: run})
    assert t.loc[4.0, "achieved req/s"] == pytest.approx(4.0)
    assert t.loc[4.0, "whole-run req/s"] == pytest.approx(run.summary["request_throughput"])
    assert math.isnan(lab02.knee_rule(t)[1])


def test_achieved_rate_is_the_capacity_once_the_seats_are_full():
    for rate in (2 * CAPACITY, 4 * CAPACITY, math.inf):
        run = simulated_run(rate if math.isfinite(rate) else 1e9, SERVICES)
        assert capacity.achieved_rate(run) == pytest.approx(CAPACITY, rel=0.15), rate


def test_achieved_rate_does_not_depend_on_which_answer_came_last():
    # Issue 19: the whole-run measure was not monotone: a lighter load whose last answer happened
    # to be short read higher than a heavier one whose last answer was long.
    short_last = simulated_run(4.0, [0.3] * 15 + [0.05])
    long_last = simulated_run(5.0, [0.3] * 15 + [1.5])
    assert short_last.summary["request_throughput"] > long_last.summary["request_throughput"]
    assert capacity.achieved_rate(short_last) == pytest.approx(4.0)
    assert capacity.achieved_rate(long_last) == pytest.approx(5.0)


def test_achieved_rate_falls_back_without_admission_times():
    run = simulated_run(4.0, SERVICES)
    run.requests["first_scheduled_s"] = math.nan            # over HTTP: first tokens instead
    assert capacity.achieved_rate(run) == pytest.approx(4.0)
    tiny = simulated_run(4.0, SERVICES[:1])
    assert capacity.achieved_rate(tiny) == tiny.summary["request_throughput"]


def test_over_http_the_seats_are_the_most_requests_the_server_showed_running():
    # A server's max_num_seqs is not in a client's settings: the /metrics samples stand in.
    run = simulated_run(1e9, SERVICES)                      # every request at once, 4 seats
    run.requests["first_scheduled_s"] = math.nan
    run.settings = {}
    run.state["num_running"] = [min(SEATS, i + 1) for i in range(len(run.state))]
    assert capacity.achieved_rate(run) == pytest.approx(CAPACITY, rel=0.15)
    # Seats for every request (vLLM's default of hundreds): nobody waited, no steady state to read.
    run.state["num_running"] = len(SERVICES)
    assert capacity.achieved_rate(run) == run.summary["request_throughput"]


def simulated_sweep(capacity_estimate, speed=1.0):
    rate_b = round(0.65 * capacity_estimate, 2)
    rates = [rate_b] + lab02.sweep_rates(rate_b, capacity_estimate)
    return {r: simulated_run(r, [s / speed for s in SERVICES]) for r in rates}


def test_sweep_rates_are_spread_and_clear_of_the_capacity():
    rates = lab02.sweep_rates(6.5, 10.0)
    assert rates == [8.5, 11.5, 15.0, 20.0, 27.0]
    gaps = np.array(rates[1:]) / np.array(rates[:-1])
    assert (gaps >= lab02.SWEEP_GAP).all()
    assert all(abs(r / 10.0 - 1) > 0.14 for r in rates)
    assert lab02.sweep_rates(7.8, 10.0)[0] == 11.5       # 8.5 would be too close to B's 7.8


def test_the_knee_of_a_simulated_sweep_and_its_lesson():
    t = lab.load_table(simulated_sweep(CAPACITY))
    prev, knee = lab02.knee_rule(t)
    assert prev > 0 and knee == pytest.approx(1.15 * CAPACITY, abs=0.01)
    shown, why = lab02.knee_evidence(t)
    assert shown and "offered grew" in why
    q = lab02.q3_knee(t, CAPACITY)
    assert q.indistinct_mistakes() == []                # every named mistake is apart from the knee
    assert q.evaluate(knee).ok
    assert not q.evaluate(float(t["achieved req/s"].max())).ok
    assert lab02.speed_causes(t, CAPACITY) == []


def test_knee_evidence_not_shown_when_throughput_keeps_rising():
    t = load_table([0.98, 1.9, 2.8, 3.6, 6.0])   # achieved 3.6 -> 6.0 while offered 4.5 -> 7
    shown, why = lab02.knee_evidence(t)
    assert not shown and "achieved 1.67x" in why
    assert not lab02.knee_evidence(load_table([0.85, 1.7, 2.0, 2.1, 2.1]))[0]
    assert not lab02.knee_evidence(load_table([1.0, 2.0, 3.0, 4.5, 6.9]))[0]
    causes = lab02.speed_causes(t, capacity=3.6)
    assert causes and "speed moved" in causes[0]


def test_settle_sweep_adds_a_lighter_or_a_heavier_load():
    # The machine got 2.5 times as slow after the calibration: the lightest load is already past
    # the knee, and a lighter one is added.
    slow = simulated_sweep(CAPACITY, speed=0.4)
    assert lab02.knee_rule(lab.load_table(slow))[0] == 0
    added = []

    def run_at(rate, speed=0.4):
        added.append(rate)
        return simulated_run(rate, [s / speed for s in SERVICES])
    out, notes = lab02.settle_sweep(dict(slow), run_at)
    assert added and min(out) == added[0] < min(slow) and list(out) == sorted(out)
    assert lab02.knee_rule(lab.load_table(out))[0] > 0
    assert "already fell short of the lightest load" in notes[0]
    # Three times as fast: the engine keeps up with every load, and a heavier one is added.
    fast = simulated_sweep(CAPACITY, speed=3.0)
    added.clear()
    out, notes = lab02.settle_sweep(dict(fast), lambda r: run_at(r, speed=3.0))
    assert added and max(out) > max(fast) and "kept up with every load" in notes[0]
    assert not math.isnan(lab02.knee_rule(lab.load_table(out))[1])
    # A sweep that brackets its knee is left alone.
    calm = simulated_sweep(CAPACITY)
    assert lab02.settle_sweep(dict(calm), run_at) == (calm, [])


def test_settle_sweep_runs_a_contradicted_load_again():
    # A run slowed down by other programs mid-sweep fell short of B's light load, although the
    # engine kept up with a heavier one: it is run again, and the faster try is kept.
    sweep = simulated_sweep(CAPACITY)
    light = min(sweep)
    sweep[light] = simulated_run(light, [3 * s for s in SERVICES])   # a stalled run
    t = lab.load_table(sweep)
    assert lab02.knee_rule(t)[1] == light                             # the rule is fooled
    assert "kept up with a heavier load" in lab02.suspects(t)[light]
    again = []
    out, notes = lab02.settle_sweep(dict(sweep), lambda r: again.append(r) or simulated_run(r, SERVICES))
    assert again == [light] and "run again" in notes[0] and "faster of the two" in notes[0]
    assert lab02.knee_rule(lab.load_table(out))[0] >= light
    # Past the knee, a load far below the others' plateau is suspect too.
    t = load_table([0.98, 1.9, 2.9, 2.0, 3.4])
    assert "another load past the knee" in lab02.suspects(t)[4.5]


def test_sooner_evidence_and_busiest():
    rows = [{"pair": k, "batching": b, "mean TTFT (ms)": v}
            for k, (s, c) in enumerate([(850, 690), (800, 700), (600, 720)], start=1)
            for b, v in (("static", s), ("continuous", c))]
    shown, why = lab02.sooner_evidence(pd.DataFrame(rows))
    assert shown and "700 ms with continuous batching against 800 ms" in why and "2 of 3" in why
    rows = [dict(r, **{"mean TTFT (ms)": 1000 - r["mean TTFT (ms)"]}) for r in rows]
    assert not lab02.sooner_evidence(pd.DataFrame(rows))[0]
    quiet, busy = lab.Load(0.05, 2, 3.0), lab.Load(0.9, 2, 3.0)
    runs = [SimpleNamespace(load=quiet), SimpleNamespace(load=busy), SimpleNamespace(load=None)]
    assert lab02.busiest(runs) is busy


def phase_frame(queue, prefill, decode):
    f = pd.DataFrame({"queue_s": queue, "prefill_s": prefill, "decode_s": decode})
    f["e2e_s"] = f.sum(axis=1)
    return f


def test_q4_where_the_latency_goes(monkeypatch):
    light = phase_frame([0.0, 0.0], [0.1, 0.1], [0.5, 0.6])
    heavy = phase_frame([0.9, 1.5], [0.2, 0.2], [1.0, 1.2])      # a slower machine, and a queue
    t = lab02.latency_shares(light, heavy)
    assert t["share growth"].idxmax() == "queue"
    assert t.loc["queue", "share at lightest"] == 0 and t["share at heaviest"].sum() == pytest.approx(1)
    q = lab02.q4_where_it_goes(light, heavy, SEATS)
    assert q.evaluate("queue").ok and q.evaluate(" Queue ").ok
    v = q.evaluate("decode")
    assert not v.ok and "cannot grow past the 4 seats" in v.message
    assert not q.evaluate("prefill").ok
    assert "answer with one of" in q.evaluate("network").message
    assert_ci_proves(q, monkeypatch)
    # A uniform slowdown moves the seconds, not the shares: the answer is this run's data.
    slow_decode = phase_frame([0.0, 0.0], [0.1, 0.1], [2.5, 2.6])
    assert lab02.q4_where_it_goes(light, slow_decode, SEATS).evaluate("decode").ok


def test_queue_evidence():
    light = phase_frame([0.0, 0.0], [0.1, 0.1], [0.5, 0.6])
    heavy = phase_frame([0.9, 1.5], [0.2, 0.2], [1.0, 1.2])
    shown, why = lab02.queue_evidence(lab02.latency_shares(light, heavy))
    assert shown and "grew the most: queue" in why
    calm = phase_frame([0.01, 0.0], [0.1, 0.1], [0.9, 1.0])
    assert not lab02.queue_evidence(lab02.latency_shares(light, calm))[0]


# ---- lab 03 -----------------------------------------------------------------------------------

ALLOC = {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, "block_size": 16,
         "bytes_per_token": 46080, "formula_bytes_per_token": 46080, "num_blocks": 28}


def test_q1_bytes_per_token(monkeypatch):
    q = lab03.q1_bytes_per_token(ALLOC, num_heads=9)
    assert q.evaluate(46080).ok and "3x" in q.evaluate(46080).message
    for wrong, words in ((23040, "K *and* V"), (2 * 30 * 9 * 64 * 4, "9 attention heads"),
                         (8 * 46080, "bits"), (46080 // 30, "one layer's share"),
                         (16 * 46080, "whole block")):
        v = q.evaluate(wrong)
        assert not v.ok and words in v.message, (wrong, v.message)
    assert "Hint" in q.evaluate(46000).message
    assert_ci_proves(q, monkeypatch)


def test_q2_peak_blocks(monkeypatch):
    q = lab03.q2_peak_blocks(4, 56, 32, 16, measured_blocks=24, num_blocks=28)
    assert q.evaluate(24).ok and "ceil(88 / 16) = 6" in q.evaluate(24).message
    for wrong, words in ((16, "prompts only"), (22, "rounds once"), (352, "number of tokens"),
                         (6, "one request's blocks"), (86, "percentage")):
        v = q.evaluate(wrong)
        assert not v.ok and words in v.message, (wrong, v.message)
    assert_ci_proves(q, monkeypatch)


def test_q3_planned_capacity_against_the_real_planner(monkeypatch):
    from minserve.plan import plan
    p = plan("tiny-llama", hardware="h100", precision="fp32", kv_cache_memory=2**20, context_len=40)
    per_block = p.kv_bytes_per_token * p.block_size
    assert p.num_kv_blocks == 2**20 // per_block
    assert p.max_num_seqs == p.num_kv_blocks // math.ceil(40 / p.block_size)
    q = lab03.q3_planned_capacity(p, 2**20)
    assert q.evaluate(p.max_num_seqs).ok
    assert_ci_proves(q, monkeypatch)


def test_q3_planned_capacity_names_the_block_rounding_mistake():
    # 20 MiB of SmolLM2-135M's 46080-byte tokens: 28 blocks, 6 per 88-token sequence -> 4;
    # dividing bytes by 88 tokens says 5 (blocks are not shared).
    p = SimpleNamespace(kv_bytes_per_token=46080, block_size=16, context_len=88, max_num_seqs=4)
    q = lab03.q3_planned_capacity(p, 20 * 2**20)
    assert q.evaluate(4).ok and "28 blocks, 6 per sequence" in q.evaluate(4).message
    v = q.evaluate(5)
    assert not v.ok and "share blocks" in v.message
    v = q.evaluate(28)
    assert not v.ok and "number of blocks" in v.message
    v = q.evaluate(9)                           # 56 blocks // 6: bytes per token without the 2
    assert not v.ok and "factor 2" in v.message


def pressure(rows):
    cols = ["max running", "max waiting", "preemptions", "most extra steps"]
    return pd.DataFrame(rows, columns=["c"] + cols).set_index("c")


SWEEP = pressure([(1, 1, 0, 0, 0), (2, 2, 0, 0, 0), (4, 4, 0, 0, 0), (5, 5, 1, 1, 7),
                  (6, 6, 2, 2, 23), (8, 7, 4, 3, 32)])


def test_measured_capacity_and_q4(monkeypatch):
    assert lab03.measured_capacity(SWEEP) == 4
    q = lab03.q4_measured_capacity(SWEEP)
    assert q.evaluate(4).ok
    v = q.evaluate(5)
    assert not v.ok and "already had to make a request wait" in v.message
    v = q.evaluate(7)
    assert not v.ok and "admits a request when its *prompt* fits" in v.message
    assert_ci_proves(q, monkeypatch)
    # A gap below a clean row does not count: capacity is the top of the clean run from 1 up.
    gap = pressure([(1, 1, 0, 0, 0), (2, 2, 1, 1, 3), (3, 3, 0, 0, 0)])
    assert lab03.measured_capacity(gap) == 1


def test_what_limited_and_q5(monkeypatch):
    assert lab03.what_limited(SWEEP.loc[8], 16) == "kv cache"
    seat_bound = pd.Series({"max running": 4, "max waiting": 3, "preemptions": 0})
    assert lab03.what_limited(seat_bound, 4) == "max_num_seqs"
    assert lab03.what_limited(SWEEP.loc[2], 16) == "compute"
    q = lab03.q5_what_limited(SWEEP, 8, 16)
    assert q.evaluate("KV cache").ok
    v = q.evaluate("max_num_seqs")
    assert not v.ok and "16 seats" in v.message
    assert not q.evaluate("compute").ok
    assert_ci_proves(q, monkeypatch)


def test_deterioration_point():
    assert lab03.deterioration_point(SWEEP, output_tokens=32) == 5
    mild = pressure([(4, 4, 0, 0, 0), (5, 5, 0, 1, 2), (6, 6, 0, 2, 9)])
    assert lab03.deterioration_point(mild, output_tokens=32) == 6   # 2 steps is within 10 %
    assert lab03.deterioration_point(pressure([(1, 1, 0, 0, 0)]), 32) is None


def test_pressure_evidence():
    shown, why = lab03.pressure_evidence(SWEEP, planned=4)
    assert shown and "3 of 3 runs at or below it" in why and "3 of 3 runs above it" in why
    early = pressure([(1, 1, 0, 0, 0), (4, 4, 0, 1, 3), (5, 5, 1, 1, 7)])   # a preemption at c = 4
    assert not lab03.pressure_evidence(early, planned=4)[0]
    calm = pressure([(4, 4, 0, 0, 0), (5, 5, 0, 0, 0)])                      # nothing past the plan
    assert not lab03.pressure_evidence(calm, planned=4)[0]


@pytest.mark.parametrize("stem", ["02_continuous_batching", "03_kv_cache_detective"])
def test_control_panels_show_the_labs_own_engine(stem):
    # Issue 19: lab 03's KV slider showed the preset's 32 blocks where the lab's engine has 28. A
    # panel given engine= shows that engine's real values (minserve/lab/controls.py).
    jupytext = pytest.importorskip("jupytext")
    from lab_sources import LABS
    cells = [c.source for c in jupytext.read(str(LABS / f"{stem}.py")).cells if c.cell_type == "code"]
    panels = [c for c in cells if "lab.control_panel(" in c]
    assert panels and all("engine=llm" in c for c in panels)


def test_a_panel_given_the_engine_shows_its_kv_blocks():
    from minserve.lab.controls import engine_settings
    eng = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=256,
                                     num_kv_blocks=28, enable_prefix_caching=False)
    assert engine_settings(eng)["num_kv_blocks"] == 28 and engine_settings(eng)["max_num_seqs"] == 8


# ---- the toolkit under the labs (tiny-llama) ----------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args("tiny-llama", max_num_seqs=SEATS, max_num_batched_tokens=256,
                                      num_kv_blocks=64, enable_prefix_caching=False)


def test_mixed_lengths_are_seeded_and_bounded():
    a = capacity.mixed_lengths(40, 32, 48, seed=3)
    assert a == capacity.mixed_lengths(40, 32, 48, seed=3) != capacity.mixed_lengths(40, 32, 48, seed=4)
    prompts, outs = a
    assert all(8 <= p <= 32 for p in prompts) and set(outs) <= {4, 8, 12, 16, 32, 48}
    with pytest.raises(ValueError, match="num_requests"):
        capacity.mixed_lengths(0, 32, 48)


def test_static_batches_take_the_steps_of_their_longest_member(engine):
    reqs = lab.mixed_requests(engine.tokenizer, 10, 24, 12, seed=1)
    outs = [r.expected_output_len for r in reqs]
    static = lab.run_static(engine, reqs, SEATS, live=False)
    assert static.requests.success.all() and len(static.requests) == 10
    assert len(static.steps) == lab02.static_steps(outs, SEATS)
    assert [len(b) for b in static.settings["static_batches"]] == [4, 4, 2]
    # Later batches waited at the gate, and that wait is their queue time and shows as waiting.
    q = static.requests.set_index("request_id").queue_s
    first_batch = [r.request_id for r in reqs[:SEATS]]
    assert q.drop(first_batch).min() > q[first_batch].max()
    assert static.state.num_waiting.max() >= 10 - SEATS - 1
    assert not engine.has_unfinished_requests()
    cont = lab.run_workload(engine, reqs, live=False)
    s, c = lab.seat_use(static, SEATS), lab.seat_use(cont, SEATS)
    assert s["busy_seat_steps"] == c["busy_seat_steps"] == sum(outs)
    assert c["steps"] < s["steps"] and c["empty_share"] < s["empty_share"]
    t, busy = lab.running_over_time(static)
    assert len(t) == len(busy) == s["steps"] and busy.max() == SEATS


def test_static_batcher_checks_its_batch_size_and_refuses_at_the_gate(engine):
    with pytest.raises(ValueError, match="max_num_seqs"):
        capacity.StaticBatcher(engine, SEATS + 1)
    with pytest.raises(ValueError, match="batch_size"):
        capacity.StaticBatcher(engine, 0)
    gate = capacity.StaticBatcher(engine, SEATS)
    gate.add_request("a", "hello there")
    with pytest.raises(ValueError, match="already in use"):
        gate.add_request("a", "hello again")
    with pytest.raises(ValueError, match="max_model_len"):
        gate.add_request("b", {"prompt_token_ids": [5] * engine.max_model_len})
    gate.abort_request("a")
    assert not gate.has_unfinished_requests() and not engine.has_unfinished_requests()


def test_steps_taken_is_output_length_for_an_undisturbed_request(engine):
    reqs = lab.make_requests(engine.tokenizer, [20, 300], [5, 7])  # 300 > budget: 2 prefill chunks
    run = lab.run_workload(engine, reqs, max_concurrency=1, live=False)
    assert list(lab.steps_taken(run)) == [5, 2 + 7 - 1]
    assert list(lab.extra_steps(run)) == [0, 0]


def test_load_table_has_a_row_per_load(engine):
    reqs = lab.make_requests(engine.tokenizer, 16, 4, num_requests=6)
    runs = {rate: lab.run_workload(engine, reqs, request_rate=rate, burstiness=math.inf, live=False)
            for rate in (50.0, math.inf)}
    t = lab.load_table(runs)
    assert list(t.index) == [50.0, math.inf]
    assert {"achieved req/s", "p90 queue (ms)", "median E2E (ms)", "max waiting"} <= set(t.columns)
    assert t.loc[math.inf, "max waiting"] >= 6 - SEATS - 1


def test_kv_allocation_matches_the_formula_and_pressure_shows_up():
    eng = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=256,
                                     num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    a = lab.kv_allocation(eng)
    assert a["formula_bytes_per_token"] == a["bytes_per_token"]
    assert a["tensor_bytes"] == a["num_blocks"] * a["block_size"] * a["bytes_per_token"]
    # 40 + 24 tokens = 4 blocks each: 3 fit in 12 blocks, a 4th must be preempted or wait.
    runs = {c: lab.run_workload(eng, lab.make_requests(eng.tokenizer, 40, 24, num_requests=c), live=False)
            for c in (3, 4)}
    t = lab.pressure_table(runs)
    assert t.loc[3, "peak KV blocks"] == 12 and t.loc[3, "preemptions"] == 0
    assert t.loc[3, "most extra steps"] == 0
    assert t.loc[4, "preemptions"] + t.loc[4, "max waiting"] > 0 and t.loc[4, "most extra steps"] > 0
    assert lab03.measured_capacity(t) == 3
