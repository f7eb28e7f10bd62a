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


def test_q3_knee_accepts_the_bracket_and_names_the_mistakes(monkeypatch):
    q = lab02.q3_knee(load_table(KEEPS_UP_TO_3))
    for ok in (4.5, 4.0, 3.1, 4.7):           # above 3.0, up to 4.5 (+5 % reading slack)
        v = q.evaluate(ok)
        assert v.ok, (ok, v.message)
        assert "the knee lies between them" in v.message
    assert q.evaluate(3.9).ok                  # the plateau, here inside the bracket: consistent
    v = lab02.q3_knee(load_table([0.98, 1.9, 2.75, 2.8, 2.82])).evaluate(2.82)  # plateau (y axis)
    assert not v.ok and "x axis" in v.message
    v = q.evaluate(7.0)
    assert not v.ok and "heaviest load" in v.message
    v = q.evaluate(3.0)
    assert not v.ok and "last load it kept up with" in v.message
    v = q.evaluate(1.0)
    assert not v.ok and "below this run's knee" in v.message and "Hint" in v.message
    assert not q.evaluate("4.5").ok and "should be an offered load" in q.evaluate("4.5").message
    assert_ci_proves(q, monkeypatch)


def test_q3_knee_without_a_crossing_says_to_go_higher():
    v = lab02.q3_knee(load_table([1.0, 2.0, 3.0, 4.5, 6.9])).evaluate(7.0)
    assert not v.ok and "higher rates" in v.message


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
