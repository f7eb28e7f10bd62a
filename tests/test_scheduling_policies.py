"""Scheduling policies as classes behind a registry (engine/scheduling_policy.py): the built-in
fcfs and priority are two registered classes; others are registered from outside the package or
named "package.module:Class", and the scheduler follows their orders."""

from __future__ import annotations

import textwrap

import pytest

import minserve
from minserve import EngineConfig, LLMEngine, SamplingParams
from minserve.engine.scheduling_policy import (FCFSPolicy, PriorityPolicy, SchedulingPolicy,
                                               registered_scheduling_policies, unregister_scheduling_policy)


class ShortestFirst(SchedulingPolicy):
    """Fewest tokens left to compute and generate first (max_tokens is known: ignore_eos)."""
    name = "shortest"

    def key(self, req):
        return (req.num_prompt_tokens + req.max_tokens - req.num_computed_tokens, req.arrival_s, req.request_id)


class OldestVictim(SchedulingPolicy):
    """FCFS order, but the *oldest* running request gives its blocks back first."""

    def preemption_victim(self, running):
        return running[0]


@pytest.fixture
def shortest():
    minserve.register_scheduling_policy("shortest", ShortestFirst)
    yield "shortest"
    unregister_scheduling_policy("shortest")


def _engine(policy, **kw):
    args = dict(max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=128, scheduling_policy=policy)
    return LLMEngine.from_engine_args("tiny-llama", **{**args, **kw})


def _finish_order(eng, lengths: dict[str, int]) -> list[str]:
    for rid, n in lengths.items():
        eng.add_request(rid, list(range(300, 308)), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    return order


def test_builtins_are_registered_classes():
    assert registered_scheduling_policies()[:2] == ["fcfs", "priority"]
    assert type(_engine("fcfs").scheduler.policy) is FCFSPolicy
    assert type(_engine("priority").scheduler.policy) is PriorityPolicy


def test_registered_policy_orders_the_queue(shortest):
    lengths = {"long": 30, "mid": 12, "short": 3, "tiny": 1}
    assert _finish_order(_engine("fcfs"), lengths) == ["long", "mid", "short", "tiny"]
    assert _finish_order(_engine(shortest), lengths) == ["tiny", "short", "mid", "long"]


def test_config_names_the_registered_policies(shortest):
    assert "shortest" in registered_scheduling_policies()
    with pytest.raises(ValueError, match=r"must be one of \['fcfs', 'priority', 'shortest'\], got 'lifo' "
                                         r"\(register one with minserve.register_scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="built in and cannot be replaced"):
        minserve.register_scheduling_policy("fcfs", ShortestFirst)
    with pytest.raises(ValueError, match="is not a subclass of minserve.engine.scheduling_policy.SchedulingPolicy"):
        minserve.register_scheduling_policy("bad", dict)
    unregister_scheduling_policy("shortest")
    with pytest.raises(ValueError, match=r"one of \['fcfs', 'priority'\], got 'shortest'"):
        EngineConfig(scheduling_policy="shortest")


def test_qualified_names_and_classes(tmp_path, monkeypatch):
    (tmp_path / "sched_plugin.py").write_text(textwrap.dedent("""
        from test_scheduling_policies import ShortestFirst as Plugged
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    lengths = {"long": 20, "mid": 8, "tiny": 1}
    by_name = _finish_order(_engine("sched_plugin:Plugged"), lengths)
    assert by_name == _finish_order(_engine(ShortestFirst), lengths) == ["tiny", "mid", "long"]
    minserve.register_scheduling_policy("lazy", "sched_plugin:Plugged")  # imported on first use
    try:
        assert type(_engine("lazy").scheduler.policy).__name__ == "ShortestFirst"
    finally:
        unregister_scheduling_policy("lazy")
    with pytest.raises(ValueError, match="cannot import module 'nowhere'"):
        EngineConfig(scheduling_policy="nowhere:Policy")


def test_cli_accepts_registered_and_qualified_names(shortest, tmp_path, monkeypatch):
    from minserve.server.cli import build_parser, engine_kwargs
    (tmp_path / "sched_cli.py").write_text("from test_scheduling_policies import OldestVictim\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("priority", shortest, "sched_cli:OldestVictim"):
        assert engine_kwargs(build_parser().parse_args(["--scheduling-policy", name]))["scheduling_policy"] == name
    for bad in ("lifo", "sched_cli:Missing"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--scheduling-policy", bad])


def test_policy_chooses_the_preemption_victim():
    seen = []
    for policy in ("fcfs", OldestVictim):
        eng = _engine(policy, max_num_seqs=3, block_size=4, num_kv_blocks=10)
        for rid in "abc":  # 3 blocks each to start, 6 at the end: the pool cannot hold them all
            eng.add_request(rid, list(range(100, 110)), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        first = None
        while eng.has_unfinished_requests() and first is None:
            eng.step()
            first = next((r for r in "abc" if eng.requests.get(r) and eng.requests[r].num_preemptions), None)
        seen.append(first)
    assert seen == ["c", "a"]  # fcfs gives back the newest, OldestVictim the oldest
