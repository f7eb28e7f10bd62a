"""scheduling_policy="priority": lower values run first, lower-priority requests are preempted
first, "fcfs" ignores priorities, and the server maps its classes onto engine priorities."""

import threading
import time
from collections import deque

import httpx
import pytest

from minserve import SamplingParams
from minserve.config import EngineConfig
from minserve.engine.llm_engine import LLMEngine
from minserve.engine.scheduler import PriorityQueue, priority_key
from minserve.server import AdmissionConfig, ClassLimits, create_app
from minserve.server.app import CLASS_STRIDE, engine_priority
from live_server import live_server

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(policy="priority", **kw):
    args = dict(max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=128, scheduling_policy=policy)
    return LLMEngine.from_engine_args("tiny-llama", **(args | kw))


def _drain(eng, max_steps=5000):
    """Step to the end; (finish order, first-scheduled order, outputs by id)."""
    finished, outs = [], {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                finished.append(o.request_id)
                outs[o.request_id] = o.outputs[0].token_ids
    assert not eng.has_unfinished_requests()
    pool = eng.kv.pool
    assert pool.num_free == pool.num_blocks and not eng.kv.block_tables
    started = sorted(eng.finished_requests, key=lambda r: r.timeline.first_scheduled_s)
    return finished, [r.request_id for r in started], outs


def _prompt(i):
    return list(range(100 + 20 * i, 110 + 20 * i))


def test_config_validates_scheduling_policy():
    assert EngineConfig().scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', 'priority'\], got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")


def test_priority_must_be_an_int():
    eng = _engine()
    with pytest.raises(ValueError, match="priority must be an integer"):
        eng.add_request("x", _prompt(0), GREEDY, priority="high")
    assert not eng.has_unfinished_requests() and not eng.requests


def test_priority_queue_orders_by_priority_then_arrival():
    q = PriorityQueue()
    eng = _engine()
    for rid, prio in [("a", 3), ("b", 0), ("c", 3), ("d", -1), ("e", 0)]:
        eng.add_request(rid, _prompt(0), GREEDY, priority=prio)
    assert [r.request_id for r in eng.scheduler.waiting] == ["d", "b", "e", "a", "c"]
    for r in list(eng.scheduler.waiting)[::-1]:
        q.appendleft(r)  # a preempted request goes back by the same order, not to the front
    assert [r.request_id for r in q] == ["d", "b", "e", "a", "c"]
    assert max(q, key=priority_key).request_id == "c"  # the first victim: lowest priority, latest


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_high_priority_behind_a_queue_of_low_priority_runs_first(policy):
    eng = _engine(policy)
    for i in range(5):
        eng.add_request(f"low{i}", _prompt(i), GREEDY, priority=5)
    eng.add_request("high", _prompt(9), GREEDY, priority=0)
    finished, started, outs = _drain(eng)
    lows = [f"low{i}" for i in range(5)]
    if policy == "priority":
        assert started == finished == ["high"] + lows
    else:  # "fcfs" is today's behaviour: priorities are ignored
        assert started == finished == lows + ["high"]
        assert isinstance(eng.scheduler.waiting, deque)
    # Order changes nothing else: every request gets the tokens it gets alone.
    alone = _engine("fcfs")
    alone.add_request("high", _prompt(9), GREEDY)
    assert outs["high"] == _drain(alone)[2]["high"]


def test_arriving_high_priority_preempts_a_lower_priority_runner_for_its_seat():
    eng = _engine()
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("low0", _prompt(0), long, priority=5)
    eng.add_request("low1", _prompt(1), long, priority=5)
    for _ in range(3):
        eng.step()  # low0 holds the only seat and decodes; low1 waits
    eng.add_request("same", _prompt(2), GREEDY, priority=5)  # equal priority: no preemption
    eng.step()
    assert [r.request_id for r in eng.scheduler.running] == ["low0"] and eng.scheduler.num_preemptions == 0
    eng.add_request("high", _prompt(3), GREEDY, priority=1)
    eng.step()  # the seat goes to "high" at once: low0 is preempted, to be recomputed later
    assert [r.request_id for r in eng.scheduler.running] == ["high"] and eng.scheduler.num_preemptions == 1
    finished, _, outs = _drain(eng)
    assert finished == ["high", "low0", "low1", "same"]
    ref = _engine("fcfs", max_num_seqs=4)
    ref.add_request("low0", _prompt(0), long)
    assert outs["low0"] == _drain(ref)[2]["low0"]  # recompute after preemption changes nothing


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_kv_preemption_victim_order(policy, monkeypatch):
    # 4 requests of 8-token prompts in blocks of 4 (2 blocks each) share 12 blocks: all start, then
    # growing outputs run the pool dry and someone must go.
    eng = _engine(policy, max_num_seqs=4, block_size=4, num_kv_blocks=12, max_num_batched_tokens=64)
    prios = {"a": 0, "b": 3, "c": 1, "d": 3}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, (rid, p) in enumerate(prios.items()):
        eng.add_request(rid, list(range(200 + 10 * i, 208 + 10 * i)), params, priority=p)
    sched, victims = eng.scheduler, []
    preempt = sched._preempt

    def spy(req):
        expect = max(sched.running, key=priority_key) if policy == "priority" else sched.running[-1]
        assert req is expect
        victims.append(req.request_id)
        preempt(req)
    monkeypatch.setattr(sched, "_preempt", spy)
    _, _, outs = _drain(eng)
    assert victims
    if policy == "priority":
        # lowest priority, latest arrival first: d, then b; the priority-0 request is never touched
        assert victims[:2] == ["d", "b"] and "a" not in victims
    else:
        assert victims[0] == "d"  # fcfs: the newest running request
    roomy = _engine("fcfs", max_num_seqs=4, block_size=4, num_kv_blocks=64)
    for i, rid in enumerate(prios):
        roomy.add_request(rid, list(range(200 + 10 * i, 208 + 10 * i)), params)
    assert outs == _drain(roomy)[2]


def test_waiting_high_priority_preempts_for_kv_blocks():
    eng = _engine(max_num_seqs=4, block_size=4, num_kv_blocks=8)
    long = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    eng.add_request("low", list(range(300, 312)), long, priority=2)   # 3 blocks, then up to 7
    eng.add_request("low2", list(range(400, 412)), long, priority=2)
    eng.step()
    assert {r.request_id for r in eng.scheduler.running} == {"low", "low2"}
    eng.add_request("high", list(range(500, 516)), GREEDY, priority=0)  # 4 blocks: only 2 free
    eng.step()
    assert "high" in [r.request_id for r in eng.scheduler.running]
    assert eng.scheduler.num_preemptions >= 1
    finished, _, _ = _drain(eng)
    assert finished[0] == "high"


def test_engine_priority_mapping():
    class E:
        class config:
            scheduling_policy = "priority"
    assert engine_priority(E, "interactive", 0) == 0
    assert engine_priority(E, "interactive", -7) == -7
    assert engine_priority(E, "batch", 3) == CLASS_STRIDE + 3
    # the class always wins: no body value lets a batch request pass an interactive one
    assert engine_priority(E, "batch", -10**30) > engine_priority(E, "interactive", 10**30)
    E.config.scheduling_policy = "fcfs"
    assert engine_priority(E, "batch", 3) == 3


def test_server_schedules_interactive_before_queued_batch_flood():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=1, max_num_batched_tokens=128,
                                        num_kv_blocks=64, scheduling_policy="priority")
    limits = ClassLimits(max_queued_requests=64)
    app = create_app(engine, admission=AdmissionConfig(interactive=limits, batch=limits))
    done: dict[str, float] = {}
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    # What was queued is read on the engine thread at the moment the interactive request joins
    # (not before posting it: on a slow machine batch requests took the seat in between).
    queued_at_arrival: list[int] = []
    real_add = engine.add_request

    def add_request(request_id, prompt, params=None, **kw):
        if kw.get("priority", 0) < CLASS_STRIDE:  # the interactive one
            queued_at_arrival.append(len(engine.scheduler.waiting))
        return real_add(request_id, prompt, params, **kw)

    engine.add_request = add_request
    # The engine steps only once the whole flood has queued (or after 30 s): on a loaded machine
    # the requests were posted slower than one seat served them, and the queue never built up.
    real_step, flood_queued = engine.step, threading.Event()
    hold_until = time.monotonic() + 30

    def step():
        if not flood_queued.is_set():
            if len(engine.scheduler.waiting) < 8 and time.monotonic() < hold_until:
                time.sleep(0.002)
                return []
            flood_queued.set()
        return real_step()

    engine.step = step

    with live_server(app) as base:
        def post(name, headers):
            r = httpx.post(base + "/v1/completions", headers=headers, json=body, timeout=120)
            assert r.status_code == 200, r.text
            done[name] = time.monotonic()

        flood = [threading.Thread(target=post, args=(f"batch{i}", {"x-priority-class": "batch"}))
                 for i in range(8)]
        for t in flood:
            t.start()
        assert flood_queued.wait(31) and len(engine.scheduler.waiting) >= 5, "the flood never queued up"
        post("interactive", {})
        for t in flood:
            t.join(120)
    after = sum(1 for k, v in done.items() if k.startswith("batch") and v > done["interactive"])
    # Every batch request still queued when it arrived ends after it.
    (queued,) = queued_at_arrival
    assert queued >= 1 and after >= queued, (after, queued)
    assert len(done) == 9


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_high_priority_arrival_gets_budget_before_a_running_low_priority_prefill(policy):
    eng = _engine(policy, max_num_seqs=4, max_num_batched_tokens=32)
    eng.add_request("low", list(range(1000, 1300)), GREEDY, priority=5)
    eng.step()  # the first 32 of 300 prompt tokens
    eng.add_request("high", _prompt(0), GREEDY, priority=0)
    eng.step()
    chunks = eng.step_stats[-1].prefill_chunks
    if policy == "priority":
        assert chunks == (("high", 0, 10), ("low", 32, 22))
    else:
        assert chunks == (("low", 32, 32),)
    _drain(eng)


def test_cli_flag_reaches_engine_args():
    from minserve.server.cli import build_parser, engine_kwargs
    assert engine_kwargs(build_parser().parse_args(["--scheduling-policy", "priority"]))["scheduling_policy"] == "priority"
    assert "scheduling_policy" not in engine_kwargs(build_parser().parse_args([]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--scheduling-policy", "lifo"])
