"""The engine thread's failure policy (async_engine.py), against a scripted stand-in engine: a
request the engine lists in ``last_step_failures`` fails with its own reason, a request retired
by a step that raised gets the step's error, and a step that raised before recording anything
aborts everything. Fast: no model."""

import asyncio
from types import SimpleNamespace

import pytest

from minserve.engine.client import RunningWork
from minserve.server.async_engine import AsyncEngine, RequestFailed

IDS = ("a", "b", "c")


class ScriptedEngine:
    """Holds requests by id; each ``step()`` runs the next function of ``script`` on it. Steps
    start once every request of IDS is in, so the script sees them all."""

    def __init__(self, *script):
        self.script = list(script)
        self.requests: dict[str, SimpleNamespace] = {}
        self.last_step_failures: dict[str, str] = {}
        self.last_step_stats = None
        self.aborted: list[str] = []
        self.stepped = False

    def add_request(self, request_id, prompt, params, **kwargs):
        self.requests[request_id] = SimpleNamespace(request_id=request_id)

    def abort_request(self, request_ids):
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) and (self.stepped or len(self.requests) == len(IDS))

    # the read-only view the server asks for (engine/client.py EngineClient): nothing runs
    def running_work(self) -> RunningWork:
        return RunningWork()

    def holds_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def step(self):
        self.stepped = True
        self.last_step_failures = {}
        return self.script.pop(0)(self)

    # what a step function does to the engine
    def fail(self, rid: str, why: str) -> SimpleNamespace:
        self.requests.pop(rid)
        self.last_step_failures[rid] = why
        return SimpleNamespace(request_id=rid, finished=True, error=why)

    def finish(self, rid: str) -> SimpleNamespace:
        self.requests.pop(rid)
        return SimpleNamespace(request_id=rid, finished=True, error=None)


def serve(engine) -> dict:
    """Submit IDS, run the engine thread until each got its first item; id -> that item."""
    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            queues = {rid: ae.submit(rid, [1, 2, 3], None) for rid in IDS}
            return {rid: await asyncio.wait_for(q.get(), 10) for rid, q in queues.items()}
        finally:
            ae.stop()
    return asyncio.run(main())


def test_a_listed_failure_gets_its_own_reason_and_the_others_their_outputs():
    def step(e):
        return [e.fail("a", "ValueError: bad logits"), e.finish("b"), e.finish("c")]
    got = serve(ScriptedEngine(step))
    assert isinstance(got["a"], RequestFailed) and got["a"].status == 500
    assert got["a"].message == "the request failed in the engine: ValueError: bad logits"
    assert got["b"].request_id == "b" and got["c"].request_id == "c"


def test_a_step_that_raised_fails_what_it_listed_and_retired_and_spares_the_rest():
    def step1(e):
        e.fail("a", "RuntimeError: its own")
        e.finish("c")  # retired, but its output is lost with the step
        raise RuntimeError("boom")

    def step2(e):
        return [e.finish("b")]
    engine = ScriptedEngine(step1, step2)
    got = serve(engine)
    assert got["a"].message == "the request failed in the engine: RuntimeError: its own"
    assert got["c"].message == "engine step failed: RuntimeError: boom"
    assert not isinstance(got["b"], RequestFailed) and got["b"].finished
    assert engine.aborted == []


@pytest.mark.parametrize("listed_elsewhere", [False, True])
def test_a_step_that_raised_before_recording_anything_aborts_everything(listed_elsewhere):
    def step(e):
        if listed_elsewhere:  # a failure of a request with no client left still counts as a record
            e.last_step_failures["gone-already"] = "x"
        raise RuntimeError("scheduler bug")
    engine = ScriptedEngine(step, lambda e: [e.finish(r) for r in list(e.requests)])
    got = serve(engine)
    if listed_elsewhere:
        assert all(not isinstance(got[r], RequestFailed) for r in IDS) and engine.aborted == []
    else:
        assert all(got[r].message == "engine step failed: RuntimeError: scheduler bug" for r in IDS)
        assert sorted(engine.aborted) == list(IDS)
